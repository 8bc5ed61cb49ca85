"""Ordinary mistakes at start-up, as an operator makes them: each is one line naming what was
wrong, exit status 2, no traceback, and found before the slow work (the pool's pre-fault,
loading the model) starts. Servers are started as processes with the mistake in place."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmc.reference import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
LMC = [sys.executable, "-c", "import sys; from lmc.cli import main; sys.exit(main())"]
SERVE = [sys.executable, "-m", "lmc.reference.serve"]


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(key)


def run(cmd: list[str], timeout: float = 120) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def clean_failure(rc: int, out: str, *needles: str) -> None:
    assert rc == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for n in needles:
        assert n in out, (n, out[-3000:])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("startup") / "llama")


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


# ------------------------------------------------------------------ lmc server
def test_server_pool_larger_than_the_host_names_both():
    too_big = 2 * _meminfo("MemTotal")
    rc, out, _ = run([*LMC, "server", "--port", "0", "--size", str(too_big)])
    clean_failure(rc, out, "does not fit this host", "of memory", "--size")


def test_server_disk_it_cannot_make_names_the_flag_before_the_prefault(tmp_path):
    rc, out, _ = run([*LMC, "server", "--port", "0", "--size", "64MiB", "--disk",
                      "/proc/lmc-disk"])
    clean_failure(rc, out, "--disk '/proc/lmc-disk'", "cannot create")
    # why, in words: mkdir under /proc says "No such file or directory" of a parent that is
    # there, which is what the message used to end with
    assert "/proc is the kernel's proc filesystem" in out, out
    assert "No such file or directory" not in out, out
    assert "pre-faulting" not in out  # checked before the pool was built


def test_server_redis_url_typo_is_refused_with_the_closest_option():
    rc, out, _ = run([*LMC, "server", "--port", "0", "--size", "64MiB", "--redis",
                      "redis://127.0.0.1:1/?tll=1h"])
    clean_failure(rc, out, "unknown option 'tll'", "did you mean 'ttl'")
    assert "pre-faulting" not in out


# --------------------------------------------------------------- reference server
def test_reference_server_taken_port_fails_before_loading_the_model(ckpt, tmp_path,
                                                                    taken_port):
    cfg = tmp_path / "lmc.yaml"
    cfg.write_text("chunk_size: 16\nlocal_cpu_size: 1GiB\n")
    rc, out, _ = run([*SERVE, "--model", str(ckpt), "--port", str(taken_port),
                      "--lmc-config", str(cfg)])
    clean_failure(rc, out, f"cannot listen on 127.0.0.1:{taken_port}", "already in use",
                  "--port")
    assert "pre-fault" not in out and "loading" not in out


def test_reference_server_config_typo_is_one_line(ckpt, tmp_path):
    cfg = tmp_path / "lmc.yaml"
    cfg.write_text("chunk_sise: 16\n")
    rc, out, _ = run([*SERVE, "--model", str(ckpt), "--port", "0", "--lmc-config", str(cfg)])
    clean_failure(rc, out, "chunk_sise", "chunk_size")
    assert len(out.strip().splitlines()) <= 3, out


@pytest.mark.parametrize("key, value, needle", [
    ("local_disk", "/proc/lmc-disk", "local_disk '/proc/lmc-disk'"),
    ("local_cpu_size", None, "does not fit this host"),
    ("remote_url", "redis://127.0.0.1:1/?conections=8", "did you mean 'connections'"),
])
def test_reference_server_checks_its_tiers_before_loading(ckpt, tmp_path, key, value,
                                                          needle):
    value = value or str(2 * _meminfo("MemTotal"))
    cfg = tmp_path / "lmc.yaml"
    cfg.write_text(f"chunk_size: 16\n{key}: '{value}'\n")
    rc, out, _ = run([*SERVE, "--model", str(ckpt), "--port", "0", "--lmc-config", str(cfg)])
    clean_failure(rc, out, needle)
    assert "loading" not in out  # the model was never loaded


# ------------------------------------------------------------------- lmc router
def test_router_taken_port_names_the_address(taken_port):
    rc, out, _ = run([*LMC, "router", "--instance", "http://127.0.0.1:1", "--port",
                      str(taken_port)])
    clean_failure(rc, out, f"cannot listen on 127.0.0.1:{taken_port}", "already in use",
                  "--port")
    assert "Errno" not in out, out


# ------------------------------------------------------------------- lmc itself
@pytest.mark.parametrize("typo, meant", [("sever", "server"), ("confg", "config"),
                                         ("pd_proxy", "pd-proxy")])
def test_a_mistyped_command_names_the_closest(typo, meant):
    rc, out, _ = run([*LMC, typo, "--port", "0"])
    clean_failure(rc, out, f"unknown command {typo!r} (did you mean {meant!r}?)")
    assert len(out.strip().splitlines()) <= 2, out


# ------------------------------------------------------------------- lmc pd-proxy
def test_pd_proxy_taken_port_names_the_address(taken_port):
    rc, out, _ = run([*LMC, "pd-proxy", "--prefill", "http://127.0.0.1:1", "--decode",
                      "http://127.0.0.1:2", "--port", str(taken_port)])
    clean_failure(rc, out, f"cannot listen on 127.0.0.1:{taken_port}", "already in use")
