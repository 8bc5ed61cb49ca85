"""``lmc config`` on the files a person shows it (issue 26, items 8 and 10): an engine config
with the vLLM connector's documented ``vllm:`` section, the daemon's own files (recognised by
their keys, or named with ``--server``), a file mixing the two; and every shipped example
passes it and runs as an ordinary user on a small machine. Each check runs ``lmc config`` as
a process, as a person would."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lmc.settings import parse_size
from tests.deadlines import HANG_S

ROOT = Path(__file__).resolve().parents[2]
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


def _prepared_home(path: Path, tmp_path: Path) -> dict[str, str]:
    """An ordinary user's environment (a fresh HOME) in which ``path``'s own preparation
    commands (its comment lines that make directories or files) have been run as written."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LMC_") or k == "LMC_DEBUG_INVARIANTS"}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    for line in path.read_text().splitlines():
        cmd = line.removeprefix("#").strip()
        if line.startswith("#   ") and cmd.startswith("mkdir "):
            subprocess.run(["bash", "-c", cmd], env=env, check=True, timeout=60)
    return env


@pytest.mark.parametrize("path", SERVER_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_daemon_config_passes_lmc_config(path, tmp_path):
    """As it is, after the preparation its comment gives, in an ordinary user's home (it
    named token files under /etc, which only root may make)."""
    env = _prepared_home(path, tmp_path)
    out = subprocess.run([sys.executable, "-m", "lmc.cli", "config", "--config",
                          str(path.relative_to(ROOT))], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "an lmc server (daemon) config" in out.stdout.splitlines()[0]


@pytest.mark.parametrize("path", SERVER_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_daemon_config_runs_as_an_ordinary_user(path, tmp_path):
    """``lmc server --config FILE`` starts and serves, as the comment says to run it (any
    free ports and a disk directory of the test's own: other runs share this machine)."""
    from lmc.storage.backends.server.client import Address, ClientConnection

    env = _prepared_home(path, tmp_path)
    data = yaml.safe_load(path.read_text())
    assert parse_size(data.get("size", "1GiB")) <= SMALL_MACHINE_POOL, path.name
    assert parse_size(data.get("disk_size", "16GiB")) <= SMALL_MACHINE_DISK, path.name
    ready = tmp_path / "ready.json"
    extra = ["--disk", str(tmp_path / "disk")] if data.get("disk") else []
    proc = subprocess.Popen([sys.executable, "-m", "lmc.cli", "server", "--config",
                             str(path.relative_to(ROOT)), "--port", "0", "--metrics-port", "0",
                             "--ready-file", str(ready), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + HANG_S
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the daemon never became ready"
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        tokens = [t.get("token_file") for t in data.get("tokens") or []]
        secret = None
        if tokens:  # the first tenant's token, as its engines would present it
            first = str(tokens[0])
            if first.startswith("~/"):  # in the prepared home
                first = str(Path(env["HOME"]) / first[2:])
            secret = Path(first).read_text().strip()
        conn = ClientConnection(Address.parse(f"lmc://127.0.0.1:{info['port']}"), secret,
                                timeout=HANG_S)
        conn.ping()
        conn.close()
    finally:
        proc.terminate()
        out = proc.communicate(timeout=HANG_S)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


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


@pytest.mark.parametrize("path", CONFIGS + SERVER_CONFIGS, ids=lambda p: p.name)
def test_lmc_config_never_imports_torch(path, tmp_path):
    """``lmc config`` reads YAML and the backends' declared options: no tensor is made, so
    torch (3-5 s to import on an idle 2-core machine, 8-34 s on a busy one) is not loaded.
    Checked by what Python imported (``-X importtime``), not by how long it took."""
    env = _prepared_home(path, tmp_path)
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "lmc.cli", "config",
                          "--config", str(path.relative_to(ROOT))], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")}
    assert "lmc.config" in imported  # the check itself ran
    assert "torch" not in imported, "lmc config imported torch"
