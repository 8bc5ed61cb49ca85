"""A long ``lmc replay`` as a person runs it (issue 26, item 4): the progress line says how
long is left, and Ctrl-C ends the run with the summary of what finished, the per-request
records and the plot of those requests, never only "interrupted"."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmc.reference import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", hidden=64, layers=2)


def _trace(path: Path, tiny_dir: Path, conversations: int) -> int:
    out = subprocess.run([sys.executable, "-m", "lmc.cli", "workload", "chat", "-o", str(path),
                          "--conversations", str(conversations), "--turns", "4-4",
                          "--system-tokens", "300", "--output-len", "24",
                          "--tokenizer", str(tiny_dir)],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return sum(1 for _ in path.open())


def test_ctrl_c_prints_what_finished_and_writes_records_and_plot(tiny_dir, tmp_path):
    pytest.importorskip("matplotlib")  # the test extra has it: --plot is part of the promise
    trace = tmp_path / "t.jsonl"
    total = _trace(trace, tiny_dir, conversations=30)
    records, plot = tmp_path / "r.jsonl", tmp_path / "p.png"
    proc = subprocess.Popen([sys.executable, "-m", "lmc.cli", "replay", str(trace),
                             "--target", f"reference:{tiny_dir}", "--fast", "--concurrency",
                             "1", "--threads", "1", "--records", str(records),
                             "--plot", str(plot)],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    progress: list[str] = []
    deadline = time.monotonic() + 240
    while not any("ETA" in ln for ln in progress):  # at least 10% done: a line with its ETA
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        progress.append(proc.stderr.readline())
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = "".join(progress) + err
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    eta = next(ln for ln in progress if "ETA" in ln)
    assert re.search(rf"replay \[#*\.*\] \d+/{total} .* ETA \d[\d.]* ?(ms|s|m \d+s|h)", eta), eta
    m = re.search(r"lmc replay: interrupted after (\d+) of (\d+) requests", err)
    assert m, err
    done = int(m.group(1))
    assert 0 < done < total and int(m.group(2)) == total, err
    assert f"interrupted: the {done} of {total} requests that finished" in out, out
    assert re.search(rf"requests\s+{done} ok, 0 failed", out), out
    assert re.search(r"TTFT\s+p50 [\d.]+ (ms|s)", out), out
    lines = records.read_text().splitlines()
    assert len(lines) == done, (len(lines), done)
    assert all(json.loads(ln)["ttft_s"] > 0 for ln in lines)
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_finished_replay_says_how_long_it_took(tiny_dir, tmp_path):
    trace = tmp_path / "t.jsonl"
    total = _trace(trace, tiny_dir, conversations=2)
    out = subprocess.run([sys.executable, "-m", "lmc.cli", "replay", str(trace),
                          "--target", f"reference:{tiny_dir}", "--fast", "--threads", "1"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert re.search(rf"{total}/{total} .* took \d", last), out.stderr
    assert "interrupted" not in out.stdout
