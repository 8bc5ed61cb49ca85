"""``lmc demo`` as a person meets it: bad flags and Ctrl-C end with a line, not a traceback;
``--model`` takes the directory or its ``config.json``; the headline speed-up is a median over
interleaved rounds, with its range and one line saying what it means."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmc import demo
from lmc.cli import main
from lmc.demo import Headline, Workload, default_threads, resolve_model_dir, run_demo
from lmc.reference import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = Workload(system_tokens=300, sessions=1, rounds=2, turn_tokens=20, doc_tokens=300,
                questions=1, max_tokens=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama")


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


def test_headline_is_a_median_with_its_range():
    h = Headline(ratios=[8.0, 30.0, 10.0], base_p50s=[0.8, 0.9, 1.0],
                 warm_p50s=[0.1, 0.03, 0.1])
    assert h.median == 10.0
    line = h.line()
    assert "10.0x median" in line and "3 interleaved round(s)" in line
    assert "range 8.0x-30.0x" in line
    assert "meaning:" in Headline.MEANING


def test_run_demo_pins_threads_and_prints_the_headline(tiny_dir, monkeypatch):
    torch.set_num_threads(1)
    events: list[tuple[str, object]] = []  # every engine is warmed up before it is timed

    def spy(name, real):
        def call(llm, *args, **kw):
            events.append((name, llm))  # held: no engine's id() is reused by the next one
            return real(llm, *args, **kw)
        return call

    monkeypatch.setattr(demo, "warm_up", spy("warm", demo.warm_up))
    monkeypatch.setattr(demo, "run_pass", spy("timed", demo.run_pass))
    out = io.StringIO()
    run_demo(tiny_dir, None, TINY, baseline=True, out=out, rounds=2)
    engines: list[object] = []
    for _, e in events:
        if not any(e is x for x in engines):
            engines.append(e)
    assert len(engines) == 3, events  # no lmc; lmc; lmc restarted
    for e in engines:
        assert next(name for name, x in events if x is e) == "warm", events
    text = out.getvalue()
    assert "engine threads: 1" in text
    assert "over 2 interleaved round(s)" in text and "range" in text
    assert "meaning: how many times sooner the first token arrives" in text
    assert "generated tokens identical in every pass: yes" in text
    # --no-baseline's "speed-up: not measured" is checked by test_cli_plain_install.py


def test_default_thread_count_leaves_a_core():
    assert default_threads() == max(1, (os.cpu_count() or 2) // 2)


def test_ctrl_c_ends_with_a_line_not_a_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "lmc.cli", "demo", "--quick",
                             "--threads", "1"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
