"""Starting, finding, signalling and measuring a daemon process (loopback only)."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.backends.server.client import Address, ClientConnection
from tests.deadlines import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class DaemonProc:
    """One ``python -m lmc.server`` process with its log and ready file under ``workdir``."""

    def __init__(self, workdir: Path, flags: list[str], unix: bool = False,
                 port: int | None = None, env: dict[str, str] | None = None,
                 nofile: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.flags = flags
        self.unix_path = str(self.workdir / "lmc.sock") if unix else None
        self.want_port = 0 if port is None else port
        self.env = env or {}
        self.nofile = nofile  # a low RLIMIT_NOFILE for the daemon (fd exhaustion tests)
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self.log_path = self.workdir / "daemon.log"

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 60.0) -> DaemonProc:
        ready = self.workdir / "ready.json"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "lmc.server", "--host", "127.0.0.1",
               "--port", str(self.want_port), "--ready-file", str(ready),
               "--metrics-port", "0", "--log-level", "INFO", *self.flags]
        if self.unix_path:
            cmd += ["--unix-socket", self.unix_path]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log,
                                     preexec_fn=self._limits if self.nofile else None)
        log.close()
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"daemon not ready after {timeout} s:\n{self.log()}")
            time.sleep(0.05)
        self.info = json.loads(ready.read_text())
        if self.want_port == 0:
            self.want_port = self.info["port"]  # a restart comes back on the same port
        return self

    def _limits(self) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def audit(self) -> None:
        """Fail if the daemon met a pool invariant violation or leaked pool objects (the
        test process cannot see inside it otherwise): its STATS where it still answers
        without a token, and its log in any case."""
        problems = [line for line in self.log().splitlines()
                    if "InvariantError" in line or "pool invariant violated" in line]
        if self.alive():
            try:
                pool = self.stats()["pool"]
            except Exception:  # a token-only or dying daemon: the log is what we have
                pool = {}
            if pool.get("violations") or pool.get("leaks"):
                problems.append(f"STATS pool: {pool}")
        assert not problems, (f"daemon {self.workdir} broke pool invariants:\n"
                              + "\n".join(problems[:20]))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL to this pid only
            self.proc.wait(10)

    # ------------------------------------------------------------- talking
    @property
    def port(self) -> int:
        return self.info["port"]

    @property
    def url(self) -> str:
        return f"lmc://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        return f"lmc+unix://{self.unix_path}"

    def connect(self, token: str | None = None, timeout: float = 5.0) -> ClientConnection:
        return ClientConnection(Address.parse(self.url), token, timeout, "test")

    def stats(self, token: str | None = None, timeout: float = HANG_S) -> dict[str, Any]:
        """The daemon's STATS: a success path, so only a hang reaches ``timeout``."""
        c = self.connect(token, timeout)
        try:
            return c.stats()
        finally:
            c.close()

    def rss(self) -> int:
        return rss_bytes(self.pid)


def client_pool(size: str = "64MiB") -> tuple[CacheConfig, MemoryPool]:
    cfg = CacheConfig(local_cpu_size=size, pin_memory="false")
    return cfg, MemoryPool(cfg.local_cpu_size, pin_memory="false")
