"""``lmc demo`` as a person meets it: bad flags and Ctrl-C end with a line, not a traceback;
``--model`` takes the directory or its ``config.json``; a mistake in ``--config`` is found
before any pass runs; the temporary disk folder goes on every way out (``| head``, Ctrl-C);
the headline is read from the table's own rows; every lmc pass says why its computed tokens
were computed."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmc.cli import main
from lmc.demo import Headline, PassResult, Workload, default_threads, resolve_model_dir, run_demo
from lmc.demo import passes as demo_passes
from lmc.demo.report import computed_causes
from lmc.reference import make_tiny_checkpoint
from tests.deadlines import HANG_S

ROOT = Path(__file__).resolve().parents[2]
TINY = Workload(system_tokens=300, sessions=1, rounds=2, turn_tokens=20, doc_tokens=300,
                questions=1, max_tokens=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama")


def lmc_demo(*argv: str, tmp: Path, **kw) -> subprocess.Popen:
    """``lmc demo`` as a process whose temporary folders go to ``tmp/t`` (checked after)."""
    (tmp / "t").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp / "t")}
    return subprocess.Popen([sys.executable, "-m", "lmc.cli", "demo", *argv], cwd=tmp,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


def left_behind(tmp: Path) -> list[str]:
    return sorted(p.name for p in (tmp / "t").iterdir() if p.name.startswith("lmc-demo"))


@pytest.mark.parametrize("value", ["-3", "0", "two", "4097", str(2**63)])
def test_bad_thread_count_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--threads", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--threads" in err and "[1, 4096]" in err
    assert "Traceback" not in err


def test_model_accepts_the_directory_or_its_config_json(tiny_dir, tmp_path, capsys):
    assert resolve_model_dir(str(tiny_dir)) == tiny_dir
    assert resolve_model_dir(str(tiny_dir / "config.json")) == tiny_dir
    with pytest.raises(FileNotFoundError, match="no such directory"):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_dir(str(tmp_path))
    assert main(["demo", "--model", str(tmp_path / "nope" / "config.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmc demo: --model") and "Traceback" not in err


def test_headline_is_the_tables_rows_with_the_rounds_range():
    base = PassResult("no lmc", rounds=[[0.8, 0.9, 1.0], [0.8, 0.8, 0.9], [1.0, 1.2, 1.1]])
    warm = PassResult("warm", rounds=[[0.1, 0.1, 0.1], [0.02, 0.03, 0.04], [0.1, 0.1, 0.1]])
    h = Headline(base, warm)
    assert h.ratio == pytest.approx(0.9 / 0.1)  # p50 of all nine over p50 of all nine
    assert [round(r, 1) for r in h.round_ratios] == [9.0, 26.7, 11.0]
    line = h.line()
    assert "9.0x TTFT p50" in line and "no lmc 900 ms, warm L1 100.0 ms" in line
    assert "3 rounds; per round 9.0x-26.7x" in line
    assert "meaning:" in Headline.MEANING


def test_run_demo_pins_threads_and_warms_every_engine_first(tiny_dir, monkeypatch):
    torch.set_num_threads(1)
    events: list[tuple[str, object]] = []  # every engine is warmed up before it is timed
    warm_up, run_script = demo_passes.warm_up, demo_passes.run_script

    def spy_warm(llm, *args, **kw):
        events.append(("warm", llm))  # held: no engine's id() is reused by the next one
        return warm_up(llm, *args, **kw)

    def spy_timed(engines, *args, **kw):
        events.extend(("timed", e) for e in engines)
        return run_script(engines, *args, **kw)

    monkeypatch.setattr(demo_passes, "warm_up", spy_warm)
    monkeypatch.setattr(demo_passes, "run_script", spy_timed)
    out = io.StringIO()
    run_demo(tiny_dir, None, TINY, baseline=True, out=out, rounds=2)
    engines: list[object] = []
    for _, e in events:
        if not any(e is x for x in engines):
            engines.append(e)
    assert len(engines) == 3, events  # lmc; no lmc; lmc restarted
    for e in engines:
        assert next(name for name, x in events if x is e) == "warm", events
    text = out.getvalue()
    assert "engine threads: 1" in text
    assert "2 rounds; per round" in text
    assert "meaning: how many times sooner the first token arrives" in text
    assert "generated tokens identical in every pass: yes" in text


def test_default_thread_count_leaves_a_core():
    assert default_threads() == max(1, (os.cpu_count() or 2) // 2)


def _row(text: str, name: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(name))
    return line[28:].split()


def test_headline_figures_are_the_tables(tiny_dir):
    """Issue 40: the headline's baseline was measured in rounds run after the table's passes,
    so the two said different things with no word why. Now both are the same rows."""
    torch.set_num_threads(1)
    out = io.StringIO()
    run_demo(tiny_dir, None, TINY, baseline=True, out=out, rounds=2)
    text = out.getvalue()
    base_p50 = float(_row(text, "no lmc (engine alone)")[0].removesuffix("ms"))
    warm_p50 = float(_row(text, "lmc, warm (L1)")[0].removesuffix("ms"))
    head = re.search(r"speed-up: ([\d.]+)x TTFT p50 \(the table's rows: no lmc ([\d,]+) ms, "
                     r"warm L1 ([\d.,]+) ms", text)
    assert head, text
    assert float(head[2].replace(",", "")) == pytest.approx(base_p50, abs=0.5)
    assert float(head[3].replace(",", "")) == pytest.approx(warm_p50, abs=0.05)
    assert float(head[1]) == pytest.approx(base_p50 / warm_p50, rel=0.02, abs=0.05)


def test_every_lmc_pass_says_why_its_tokens_were_computed(tiny_dir, tmp_path):
    """Issue 40: ``lmc demo --quick``'s restart pass computed 58% of its tokens and nothing
    said why. Each lmc pass now lists the causes, and they add up to the table's computed
    share -- here over a disk tier behind a slow link, where lmc's load policy may recompute
    what the disk holds (then named as such, never left unexplained)."""
    torch.set_num_threads(1)
    cfg = tmp_path / "slow-disk.yaml"
    # lookups wait for the disk's answer (lookup_min_wait): a loaded machine's slow answer
    # would otherwise be named "tier too slow to answer", a cause this test is not about
    cfg.write_text("chunk_size: 256\nlocal_cpu_size: 256MiB\nsave_unfull_chunk: true\n"
                   f"lookup_min_wait: {HANG_S}\n"
                   "write_policy: write_through\ntiers:\n  - memory\n"
                   f"  - {{wrap: rate_limit, bytes_per_second: 2MiB, tier: {{backend: disk, "
                   f"path: '{tmp_path / 'disk'}', capacity: 512MiB}}}}\n")
    out = io.StringIO()
    results = run_demo(tiny_dir, str(cfg), TINY, baseline=False, out=out)
    text = out.getvalue()
    assert [r.name for r in results] == ["lmc, cold cache", "lmc, warm (L1)",
                                         "lmc, restarted (disk -> L1)"], text
    section = text.split("where each lmc pass's computed tokens come from:\n", 1)[1]
    for r in results:
        causes = computed_causes(r, ["cpu", "disk"])
        loaded = r.stats.get("worker.tokens_from_cpu", 0) + r.stats.get(
            "worker.tokens_from_disk", 0)
        assert sum(causes.values()) == r.prompt_tokens - loaded, (r.name, causes)
        assert "other" not in causes, (r.name, causes, r.stats)
        assert causes.get("last") == r.requests  # each prompt's last token
        line = next(ln for ln in section.splitlines() if ln.strip().startswith(r.name))
        assert f"{sum(causes.values()):,}" in line, line
    assert "held by no tier" in section and "last tokens" in section


def test_config_mistakes_are_found_before_any_pass(tiny_dir, tmp_path):
    """Issue 40: an oversized pool or a bad ``local_disk`` in ``--config`` was found only after
    the whole engine-alone pass, and the message named ``lmc server``'s flag."""
    total = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                 if ln.startswith("MemTotal:")) * 1024
    for body, needle in ((f"local_cpu_size: {2 * total}\n", "lower local_cpu_size"),
                         ("local_disk: /proc/lmc-demo-disk\n", "local_disk '/proc/lmc-demo-disk'")):
        cfg = tmp_path / "bad.yaml"
        cfg.write_text(body)
        proc = lmc_demo("--model", str(tiny_dir), "--config", str(cfg), "--quick", "--threads",
                        "1", tmp=tmp_path)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (out, err)
        assert needle in err and "lmc server" not in err and "Traceback" not in err, err
        assert "[#" not in err and "TTFT" not in err, err  # no pass ran
        assert "model dir:" not in out, out  # nor was the model loaded


def test_demo_piped_into_head_removes_its_disk_folder(tiny_dir, tmp_path):
    """Issue 40: ``lmc demo | head`` left its temporary disk folder behind."""
    for lines in (1, 3):  # the pipe breaks at different points of the run
        proc = lmc_demo("--model", str(tiny_dir), "--quick", "--no-baseline", "--threads", "1",
                        tmp=tmp_path)
        assert proc.stdout is not None
        for _ in range(lines):
            proc.stdout.readline()
        proc.stdout.close()  # what head does after its lines
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 141, (lines, proc.returncode, err)
        assert left_behind(tmp_path) == [], lines


def test_ctrl_c_ends_with_a_line_and_removes_the_disk_folder(tmp_path):
    proc = lmc_demo("--quick", "--threads", "1", tmp=tmp_path)
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    seen = ""
    while "model dir:" not in seen:  # past start-up: the checkpoint is being used
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        seen += proc.stdout.readline()
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "lmc demo: interrupted" in err and "Traceback" not in err
    assert left_behind(tmp_path) == []


def test_sliding_window_is_for_the_demo_model_only(tiny_dir, capsys):
    assert main(["demo", "--model", str(tiny_dir), "--sliding-window", "64"]) == 2
    err = capsys.readouterr().err
    assert "--sliding-window makes the demo model hybrid" in err and "Traceback" not in err


def test_readme_quotes_what_the_demo_prints():
    """The README's excerpt of ``make demo`` is the demo's own wording: its questions are the
    script's, its answers lines and headline have the demo's format, the flags it names exist."""
    from lmc.demo.script import REAL_CHATS, REAL_QUESTIONS

    readme = (ROOT / "README.md").read_text()
    excerpt = readme.split("make demo   #", 1)[1].split("**What `make test` runs.**", 1)[0]
    asked = re.findall(r"^  (?:chat \d, round \d|document, question \d) +(.+)$", excerpt, re.M)
    assert asked, excerpt
    assert set(asked) <= {q for c in REAL_CHATS for q in c} | set(REAL_QUESTIONS), asked
    assert re.search(r"^speed-up: [\d.]+x TTFT p50 \(the table's rows: no lmc [\d,]+ ms, warm "
                     r"L1 [\d.,]+ ms; each request asked of both engines back to back, 1 round\)$",
                     excerpt, re.M), excerpt
    assert re.search(r"^generated tokens identical in every pass: yes \(4 passes, \d+ "
                     r"requests\)$", excerpt, re.M)
    assert re.search(r"^demo took \d+ s \(\d+ s of CPU time in this process\)$", excerpt, re.M)
    flags = set(re.findall(r"`(--[a-z-]+)", excerpt))
    help_text = subprocess.run([sys.executable, "-m", "lmc.cli", "demo", "--help"],
                               capture_output=True, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert flags and all(f in help_text for f in flags), (flags, help_text)
