"""Fixtures for the P2P tests: a daemon (the directory) and engine processes driven over
pipes. NIXL runs only in child processes: an agent makes its process crash at interpreter
exit, which must not be pytest's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.requirements import missing
from tests.server.daemon_proc import ROOT, DaemonProc


def require_nixl() -> None:
    """Skip without NIXL, except under CI=true, where a missing NIXL fails the test."""
    if importlib.util.find_spec("nixl") is None:
        missing("NIXL is not installed (pip install --no-deps nixl nixl-cu12; .ci/run does it)")


class EngineProc:
    """``tests.storage.backends.p2p.engine_proc`` in a child process: one JSON command, one JSON answer."""

    def __init__(self, url: str, workdir: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.storage.backends.p2p.engine_proc", url, str(workdir)], cwd=ROOT,
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(workdir / "engines.log", "ab"), text=True)  # noqa: SIM115
        self.pid = self.proc.pid
        self.agent = ""

    def ready(self) -> EngineProc:
        """Wait for the process's first answer (start several, then wait: they take
        seconds each)."""
        hello = self._read()
        assert hello["pid"] == self.pid
        self.agent = hello["agent"]
        return self

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine process ended (rc={self.proc.poll()}); "
                                   "see engines.log")
            if line.startswith("@lmc "):  # other lines: something below NIXL printing
                return json.loads(line[5:])

    def __call__(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        assert "error" not in out, out
        return out

    def exit(self) -> None:
        """Close the engine and end the process (``os._exit``: exit code 0 proves a clean
        close; the NIXL exit-time crash is skipped by design)."""
        if self.proc.poll() is None:
            assert self("exit") == {"closed": True}
        assert self.proc.wait(30) in (0, -9)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


class Directory:
    """The daemon serving the directory, and the engines started against it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.daemon = DaemonProc(workdir / "daemon", ["--size", "16MiB"]).start()
        self.url = f"p2p+lmc://127.0.0.1:{self.daemon.info['port']}"
        self.engines_started: list[EngineProc] = []

    def engines(self, n: int) -> list[EngineProc]:
        """``n`` engine processes, started together."""
        new = [EngineProc(self.url, self.workdir) for _ in range(n)]
        self.engines_started.extend(new)
        return [e.ready() for e in new]

    def close(self) -> None:
        try:
            for e in self.engines_started:
                e.exit()
        finally:
            for e in self.engines_started:
                e.kill()
            self.daemon.kill()


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    """One daemon per module (engine processes take seconds to start: tests share them)."""
    require_nixl()
    d = Directory(tmp_path_factory.mktemp("p2p"))
    yield d
    d.close()


@pytest.fixture(scope="module")
def pair(directory):
    """Two long-lived engines: ``(owner, reader)``; tests that kill an owner start their own."""
    return tuple(directory.engines(2))


@pytest.fixture(scope="module")
def owner(pair):
    return pair[0]


@pytest.fixture(scope="module")
def reader(pair):
    """The engine that misses locally and pulls from its peers."""
    return pair[1]
