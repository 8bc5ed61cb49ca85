"""``lmc config`` on the files a person shows it (issue 26, items 8 and 10): an engine config
with the vLLM connector's documented ``vllm:`` section, the daemon's own files (recognised by
their keys, or named with ``--server``), a file mixing the two; and every shipped example
passes it and runs as an ordinary user on a small machine. Each check runs ``lmc config`` as
a process, as a person would."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmc.settings import parse_size

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
SERVER_CONFIGS = sorted((ROOT / "configs" / "server").glob("*.yaml"))


def lmc_config(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LMC_") or k == "LMC_DEBUG_INVARIANTS"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "lmc.cli", "config", *argv], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_documented_vllm_section_is_checked_not_refused(tmp_path):
    f = tmp_path / "vllm.yaml"
    f.write_text("local_cpu_size: 1GiB\nvllm:\n  lookup_timeout: 250ms\n  layerwise: false\n")
    out = lmc_config("--config", str(f))
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["local_cpu_size"] == "1GiB"
    assert shown["vllm"]["lookup_timeout"] == "250ms" and shown["vllm"]["layerwise"] is False
    # the section's options are checked by the connector's own loader: file:line, closest key
    f.write_text("local_cpu_size: 1GiB\nvllm:\n  lookup_timeot: 3\n")
    out = lmc_config("--config", str(f))
    assert out.returncode == 2, out.stdout
    assert f"'vllm.lookup_timeot' in {f}:3; did you mean 'vllm.lookup_timeout'?" in out.stderr
    f.write_text("vllm:\n  lookup_timeout: soon\n")
    out = lmc_config("--config", str(f))
    assert out.returncode == 2 and "vllm.lookup_timeout" in out.stderr and "soon" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_daemons_file_is_recognised_and_checked_as_the_daemon_reads_it():
    out = lmc_config("--config", "configs/server/server.yaml")
    assert out.returncode == 0, out.stderr
    first, rest = out.stdout.split("\n", 1)
    assert first.startswith("# configs/server/server.yaml: an lmc server (daemon) config, "
                            "recognised by its keys (host, port"), first
    shown = yaml.safe_load(rest)
    assert shown["host"] == "127.0.0.1" and shown["port"] == 7451 and shown["size"] == "1GiB"
    assert shown["unix_socket_mode"] == "0600"
    # the same with --server, and what it prints is a daemon config that loads again
    again = lmc_config("--server", "--config", "configs/server/server.yaml")
    assert again.returncode == 0 and yaml.safe_load(again.stdout) == shown


def test_a_daemon_file_with_a_mistake_is_named(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("host: 127.0.0.1\nport: 7451\nsise: 1GiB\n")
    out = lmc_config("--server", "--config", str(f))
    assert out.returncode == 2 and "'sise'" in out.stderr and "'size'" in out.stderr, out
    # a token file the daemon would read at start-up is read now
    f.write_text(f"port: 7451\ntoken_file: {tmp_path / 'missing.token'}\n")
    out = lmc_config("--config", str(f))
    assert out.returncode == 2 and "missing.token" in out.stderr, out
    # storage keys under cache: are the engine's, checked with its messages
    f.write_text("port: 7451\ncache: {write_polcy: write_through}\n")
    out = lmc_config("--config", str(f))
    assert out.returncode == 2 and "write_policy" in out.stderr, out
    assert "Traceback" not in out.stderr


def test_mixed_and_misdirected_files_say_which_keys_are_whose(tmp_path):
    f = tmp_path / "mixed.yaml"
    f.write_text("host: 0.0.0.0\nchunk_size: 256\n")
    out = lmc_config("--config", str(f))
    assert out.returncode == 2
    assert "mixes daemon keys (host) with engine keys (chunk_size)" in out.stderr, out.stderr
    assert "under cache:" in out.stderr
    out = lmc_config("--server", "--config", "configs/cpu.yaml")
    assert out.returncode == 2 and "engine config keys, not the daemon's" in out.stderr, out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_engine_config_passes_lmc_config(path):
    out = lmc_config("--config", str(path.relative_to(ROOT)))
    if out.returncode and "pip install" in out.stderr:  # a backend's optional package
        pytest.fail(f"{path.name} needs an extra the test environment lacks: {out.stderr}")
    assert out.returncode == 0, out.stderr


def _substituted(path: Path, tmp_path: Path) -> Path:
    """A daemon example with its /etc/lmc token files made under ``tmp_path``."""
    text = path.read_text()
    for name in re.findall(r"/etc/lmc/([\w.-]+\.token)", text):
        (tmp_path / name).write_text(f"secret-of-{name}-0123456789\n")
    out = tmp_path / path.name
    out.write_text(text.replace("/etc/lmc/", f"{tmp_path}/"))
    return out


@pytest.mark.parametrize("path", SERVER_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_daemon_config_passes_lmc_config(path, tmp_path):
    out = lmc_config("--config", str(_substituted(path, tmp_path)))
    assert out.returncode == 0, out.stderr
    assert "an lmc server (daemon) config" in out.stdout.splitlines()[0]


def _world_writable_parent(path: str) -> bool:
    p = Path(path).expanduser()
    while not p.exists():
        p = p.parent
    mode = p.stat().st_mode
    return p.is_dir() and bool(mode & stat.S_IWOTH) and bool(mode & stat.S_ISVTX)


SMALL_MACHINE_POOL = 2 << 30  # per process: a laptop or a small VM runs the example as it is
SMALL_MACHINE_DISK = 16 << 30


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_examples_run_as_an_ordinary_user_on_a_small_machine(path):
    """No example needs root (its directories go where any user may create one: /tmp,
    /var/tmp) or a big host (at most 2 GiB of pool, 16 GiB of disk)."""
    data = yaml.safe_load(path.read_text())
    assert parse_size(data.get("local_cpu_size", "2GiB")) <= SMALL_MACHINE_POOL, path.name
    if data.get("local_disk"):
        assert _world_writable_parent(data["local_disk"]), (path.name, data["local_disk"])
        assert parse_size(data.get("local_disk_size", "16GiB")) <= SMALL_MACHINE_DISK, path.name
