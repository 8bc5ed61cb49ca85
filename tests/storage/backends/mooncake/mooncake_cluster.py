"""Real Mooncake Store processes on loopback for the ``mooncake://`` tier's tests.

* :class:`MooncakeMaster`: a ``mooncake_master`` child on free 127.0.0.1 ports (RPC and
  metrics; no HTTP metadata server: clients use P2PHANDSHAKE, which listens on loopback
  only), killed (SIGKILL), paused (SIGSTOP) and restarted on the same port by its PID.
* :class:`Peer`: another process of the cluster, driven over stdin/stdout one JSON line per
  command: a ``holder`` (a bare client contributing a segment, as a storage node would), a
  ``tier`` (lmc's tier, storing and reading chunks whose bytes are a function of their
  name, so any process checks any hit bit for bit), or ``raw`` (a bare client reading and
  rewriting stored values out of band: how the tests damage a value). A reader that may
  meet a library crash runs as a peer, so a segfault is a dead peer and a failed test, not
  a dead pytest.

Run as a module (``python -m tests.storage.backends.mooncake.mooncake_cluster ROLE ...``) it is that
peer. Every process is stopped by its own PID, never by name.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.server_process import ServerProcess

START_TIMEOUT = 30.0
ROOT = Path(__file__).resolve().parents[4]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_mooncake() -> None:
    """Skip (fail under CI) unless the wheel and its system library are installed."""
    from tests.requirements import missing
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        missing(f"the Mooncake store client is not importable ({e}); pip install "
                f"mooncake-transfer-engine-non-cuda==0.3.13.post1 and apt-get install "
                f"libibverbs1")
    if not master_binary().exists():
        missing(f"mooncake_master not found at {master_binary()}")


def master_binary() -> Path:
    import mooncake
    return Path(mooncake.__file__).parent / "mooncake_master"


def quiet_env() -> dict[str, str]:
    """The environment of every Mooncake process here: its INFO logs off, one setup try."""
    env = dict(os.environ)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class MooncakeMaster(ServerProcess):
    """One ``mooncake_master`` on 127.0.0.1; ``client_ttl`` (s) is how long a client that
    stopped sending heartbeats keeps its segment, ``lease_ms`` how long a read leases."""

    stop_timeout = 15.0

    def __init__(self, workdir: Path, client_ttl: int = 10, lease_ms: int = 10000,
                 *extra: str) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.metrics_port = free_port()
        self.client_ttl = client_ttl
        self.lease_ms = lease_ms
        self.extra = extra
        super().__init__()

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> MooncakeMaster:
        logf = self.workdir / f"master-{self.port}.log"
        with open(logf, "ab") as log:
            self.proc = subprocess.Popen(
                [str(master_binary()), "-rpc_address=127.0.0.1", f"-rpc_port={self.port}",
                 "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}",
                 f"-client_ttl={self.client_ttl}", f"-default_kv_lease_ttl={self.lease_ms}",
                 *self.extra], stdout=log, stderr=subprocess.STDOUT, env=quiet_env())
        deadline = time.monotonic() + START_TIMEOUT
        while not _accepts(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited ({self.proc.returncode}):\n"
                                   f"{logf.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not listen in {START_TIMEOUT:.0f} s")
            time.sleep(0.02)
        return self


def wait_client_closes(timeout: float) -> list[str]:
    """Wait (at most ``timeout`` s) for this process's Mooncake clients to finish closing;
    the threads still closing. Call before stopping the master: a client's close talks to
    it, holding the GIL (lmc.storage.backends.mooncake.client), so a close that meets a
    dead master stalls the whole test process."""
    import threading
    end = time.monotonic() + timeout
    for t in threading.enumerate():
        if t.name == "lmc-mooncake-close":
            t.join(max(0.0, end - time.monotonic()))
    return [t.name for t in threading.enumerate()
            if t.name == "lmc-mooncake-close" and t.is_alive()]


class Peer:
    """Another process of the cluster (see the module docstring), one command at a time."""

    def __init__(self, role: str, master: MooncakeMaster, **settings: Any) -> None:
        self.role = role
        env = quiet_env()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.storage.backends.mooncake.mooncake_cluster", role,
             master.address, json.dumps(settings)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env, cwd=ROOT, text=True, bufsize=1)
        try:
            ready = self._reply(START_TIMEOUT)
        except BaseException:  # silent or dead: never left running behind the test
            self.kill()
            raise
        if not ready.get("ready"):
            self.kill()
            raise RuntimeError(f"mooncake {role} peer did not start: {ready}")
        self.info = ready

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _reply(self, timeout: float) -> dict[str, Any]:
        import select
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"mooncake {self.role} peer (pid {self.pid}) gave no answer in "
                               f"{timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=10)
            raise RuntimeError(f"mooncake {self.role} peer (pid {self.pid}) died "
                               f"(exit code {code})")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, timeout: float = 60.0, **command: Any) -> dict[str, Any]:
        """Send one command, wait at most ``timeout`` for its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


# ----------------------------------------------------------------------------- the peers
def _bare_client(master: str, segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 0, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"setup returned {rc}")
    return s


def _say(**kv: Any) -> None:
    sys.stdout.write(json.dumps(kv) + "\n")
    sys.stdout.flush()


def _holder(master: str, settings: dict[str, Any]) -> None:
    """Contribute a segment until stdin closes (then close) or SIGKILL."""
    s = _bare_client(master, int(settings.get("segment", 256 << 20)))
    _say(ready=True, pid=os.getpid())
    for _ in sys.stdin:
        _say(ok=True)
    s.close()


def _raw(master: str, settings: dict[str, Any]) -> None:
    """Read and rewrite stored values: ``read`` (hex of the whole value), ``write`` (the
    value replaced: forced remove, then put)."""
    s = _bare_client(master, 0)
    buf = mmap.mmap(-1, 64 << 20)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    s.register_buffer(ptr, len(buf))
    _say(ready=True, pid=os.getpid())
    def retried(fn: Any, *args: Any) -> int:
        """A call, again while it meets a master restarted since the last one."""
        for _ in range(10):
            rc = int(fn(*args))
            if rc not in (-900, -901):
                return rc
            time.sleep(0.2)
        return rc

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "read":
            n = retried(s.get_into, cmd["key"], ptr, len(buf))
            _say(code=n, hex=bytes(buf[:n]).hex() if n > 0 else "")
        elif cmd["op"] == "write":
            data = bytes.fromhex(cmd["hex"])
            retried(s.remove, cmd["key"], True)
            buf[:len(data)] = data
            _say(code=retried(s.put_from, cmd["key"], ptr, len(data)))
    s.close()


def _tier(master: str, settings: dict[str, Any]) -> None:
    """lmc's tier in a process of its own: ``put``/``get``/``contains`` of named chunks."""
    import torch

    from lmc.config import CacheConfig
    from lmc.memory.pool import MemoryPool
    from lmc.storage.backends.mooncake import MooncakeBackend
    from lmc.testing.harness import SHAPE, expected_bytes, fill, key_of, raw

    config = CacheConfig(**settings.get("config", {}))
    pool = MemoryPool(int(settings.get("pool", 64 << 20)), pin_memory="false")
    tier = MooncakeBackend(f"mooncake://{master}", config=config, pool=pool,
                           **settings.get("options", {}))
    _say(ready=tier.guard.ready, pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        keys = [key_of(n) for n in cmd.get("names", [])]
        t0 = time.monotonic()
        if cmd["op"] == "put":
            objs = pool.allocate_many(SHAPE, torch.float16, len(keys), SHAPE[2])
            for o, k in zip(objs, keys):
                fill(o, k)
            n = tier.put(keys, objs)
            for o in objs:
                o.release()
            _say(stored=n, seconds=time.monotonic() - t0)
        elif cmd["op"] == "get":
            got = tier.get(keys)
            took = time.monotonic() - t0
            exact = [o is not None and torch.equal(raw(o), expected_bytes(k, o.nbytes))
                     for o, k in zip(got, keys)]
            for o in got:
                if o is not None:
                    o.release()
            _say(hits=[o is not None for o in got], exact=exact, seconds=took)
        elif cmd["op"] == "contains":
            _say(present=tier.contains(keys), seconds=time.monotonic() - t0)
        elif cmd["op"] == "stats":
            _say(stats={k: v for k, v in tier.stats().items() if not isinstance(v, dict)})
    tier.close()
    _say(closed=True, used=pool.used_bytes)


if __name__ == "__main__":
    role, master_addr, raw_settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    {"holder": _holder, "raw": _raw, "tier": _tier}[role](master_addr, raw_settings)
