"""What a new operator meets on day one (issue 26, item 9): a mistyped flag is answered by the
subcommand it was typed to, a replay names the target the user typed, and ``lmc demo`` prints
binary sizes as MiB and does not call a pass "cold" when its disk tier was kept from an
earlier run. Each test runs ``lmc`` as a process, as a person would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmc.reference import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def lmc(*argv: str, cwd: Path | None = None, timeout: float = 120,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "lmc.cli", *argv], cwd=cwd or ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", hidden=64, layers=2)


@pytest.mark.parametrize("argv, usage, hint", [
    (["server", "--sise", "1GiB"], "usage: lmc server", "did you mean --size?"),
    (["server", "--prot=7451"], "usage: lmc server", "did you mean --port?"),
    (["replay", "t.jsonl", "--target", "reference", "--concurency", "2"], "usage: lmc replay",
     "did you mean --concurrency?"),
    (["workload", "chat", "-o", "x", "--conversatons", "3"], "usage: lmc workload chat",
     "did you mean --conversations?"),
    (["config", "--confg", "x.yaml"], "usage: lmc config", "did you mean --config?"),
])
def test_a_mistyped_flag_is_answered_by_its_subcommand(argv, usage, hint):
    out = lmc(*argv)
    assert out.returncode == 2, out
    assert out.stderr.startswith(usage), out.stderr[:300]
    assert "unrecognized arguments: " + argv[-2 if "=" not in argv[-1] else -1] in out.stderr
    assert hint in out.stderr and "Traceback" not in out.stderr


def test_top_level_flags_still_get_the_top_level_usage():
    out = lmc("--bogus")
    assert out.returncode == 2 and out.stderr.startswith("usage: lmc [-h]"), out.stderr


def test_replay_names_the_target_the_user_typed(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "request_id": "a", "prompt": "Hello there.", '
                     '"output_len": 1}\n')
    for model, why in ((tmp_path / "nope", "no such directory"), (tmp_path, "no config.json")):
        out = lmc("replay", str(trace), "--target", f"reference:{model}", cwd=tmp_path)
        assert out.returncode == 2, out
        assert f"--target reference:{model}" in out.stderr and why in out.stderr, out.stderr
        assert "--model" not in out.stderr and "Traceback" not in out.stderr


def _table_rows(stdout: str) -> dict[str, str]:
    lines = stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("pass"))
    rows = {}
    for ln in lines[head + 2:]:
        if not ln.strip():
            break
        rows[ln[:28].strip()] = ln
    return rows


def test_demo_sizes_are_mib_and_a_kept_disk_is_not_called_cold(tiny_dir, tmp_path):
    """Two runs over one disk directory (``--config`` with ``local_disk``): the first pass of
    the second run is served from that disk, so it is labelled warm and the reason is said.
    Sizes are binary, so their unit is MiB (the README's MB is 10^6 bytes)."""
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(f"local_cpu_size: 64MiB\nlocal_cpu_prefault: 'off'\n"
                   f"local_disk: {tmp_path / 'disk'}\nlocal_disk_size: 256MiB\n")
    argv = ("demo", "--model", str(tiny_dir), "--config", str(cfg), "--quick", "--no-baseline",
            "--threads", "1")
    first = lmc(*argv, cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = _table_rows(first.stdout)
    assert "lmc, cold cache" in rows, first.stdout
    assert "pass starts warm" not in first.stdout
    header = next(ln for ln in first.stdout.splitlines() if ln.startswith("pass"))
    assert "KV loaded" in header
    for row in rows.values():
        assert re.search(r"\d MiB?\b|\dMiB", row), row
        assert not re.search(r"\dMB\b", row), row
    second = lmc(*argv, cwd=tmp_path, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    rows = _table_rows(second.stdout)
    assert "lmc, cold cache" not in rows, second.stdout
    assert "lmc, first (tiers warm)" in rows, second.stdout
    assert re.search(r"lower tiers are not empty \(disk [\d,]+ chunks, from an earlier run\)",
                     second.stdout), second.stdout


def test_demo_piped_into_head_stops_quietly(tiny_dir, tmp_path):
    """``lmc demo | head``: once the reader is gone the demo stops, with no error line (it
    printed "lmc demo: [Errno 32] Broken pipe" and exited 2)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "lmc.cli", "demo", "--quick", "--model",
                             str(tiny_dir), "--no-baseline"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what head does after its lines
    _, err = proc.communicate(timeout=300)
    assert first.startswith("model"), first
    assert proc.returncode == 141, (proc.returncode, err)
    assert "Broken pipe" not in err and "Traceback" not in err, err
