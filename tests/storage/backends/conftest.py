"""Real servers for the tier tests: redis-server on free loopback ports, persistence off.

Every server is a child process of the test run, stopped by its own pid (never by name).
``RedisServer.kill()`` / ``.start()`` let a test SIGKILL a server and bring it back on the same
port; ``.pause()`` / ``.resume()`` (SIGSTOP / SIGCONT) make a server that accepts connections
but never answers. Start-up waits are generous: a loaded 2-core machine can take seconds.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.tier import create_backend
from tests.requirements import missing
from tests.server_process import ServerProcess

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
START_TIMEOUT = 30.0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; Redis wants it <= 55535."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def redis_module() -> Any:
    """The ``redis`` client package, imported where used: a bare GPU box (whose image has no
    redis) still collects the tests that import these fixtures."""
    try:
        import redis
    except ImportError as e:
        missing(f"the redis Python package is not installed ({e}; pip install redis, "
                 "or lmc's [redis] extra)")
    return redis


def require_redis() -> None:
    redis_module()
    if REDIS_SERVER is None or REDIS_CLI is None:
        missing("redis-server/redis-cli not installed (.ci/run installs Debian's redis-server)")


class RedisServer(ServerProcess):
    """One redis-server child process on 127.0.0.1."""

    def __init__(self, workdir: Path, port: int | None = None, *extra: str,
                 tls: dict[str, str] | None = None, password: str | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra = extra
        self.tls = tls
        self.password = password
        super().__init__()

    @property
    def url(self) -> str:
        if self.tls:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls['ca']}"
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        args = [REDIS_SERVER, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--protected-mode", "yes", "--daemonize", "no",
                "--proto-max-bulk-len", "1gb", "--loglevel", "warning"]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", self.tls["cert"], "--tls-key-file", self.tls["key"],
                     "--tls-ca-cert-file", self.tls["ca"], "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        return args + list(self.extra)

    def client(self, **kw) -> Any:
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=self.tls["ca"])
        if self.password:
            kw.setdefault("password", self.password)
        return redis_module().Redis(host="127.0.0.1", port=self.port, socket_timeout=10, **kw)

    def start(self) -> RedisServer:
        log = open(self.workdir / f"redis-{self.port}.log", "ab")  # noqa: SIM115 - child owns it
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.workdir)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                tail = (self.workdir / f"redis-{self.port}.log").read_text()[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} exited "
                                   f"({self.proc.returncode}):\n{tail}")
            try:
                with self.client(socket_connect_timeout=1) as c:
                    if c.ping():
                        return self
            except redis_module().RedisError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer in "
                                   f"{START_TIMEOUT:.0f} s")
            time.sleep(0.05)


class RedisCluster:
    """Three primaries, no replicas, all slots assigned by ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, n: int = 3) -> None:
        self.nodes = [RedisServer(workdir / f"node{i}", free_cluster_port(),
                                  "--cluster-enabled", "yes",
                                  "--cluster-config-file", "nodes.conf",
                                  "--cluster-node-timeout", "5000") for i in range(n)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)

    def start(self) -> RedisCluster:
        for s in self.nodes:
            s.start()
        addrs = [f"127.0.0.1:{s.port}" for s in self.nodes]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + START_TIMEOUT
        while not all(self._ok(s) for s in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    @staticmethod
    def _ok(s: RedisServer) -> bool:
        with s.client() as c:
            info = c.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    def stop(self) -> None:
        for s in self.nodes:
            s.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One server for the whole session; tests keep apart through their own key prefixes."""
    require_redis()
    s = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield s
    s.stop()


@pytest.fixture
def own_redis(tmp_path):
    """A server of the test's own, to kill, pause and restart."""
    require_redis()
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    require_redis()
    c = RedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start()
    except BaseException:
        c.stop()
        raise
    yield c
    c.stop()


@pytest.fixture(scope="session")
def tls_redis(tmp_path_factory):
    """A TLS-only server with a self-signed certificate for 127.0.0.1."""
    require_redis()
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not installed: cannot make a certificate for the TLS test")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    s = RedisServer(d / "srv", None, tls={"cert": str(cert), "key": str(key), "ca": str(cert)})
    try:
        s.start()
    except RuntimeError as e:
        if "TLS" in str(e) and "not" in str(e):  # a build without TLS says so and exits
            pytest.skip(f"this redis-server is built without TLS: {e}")
        raise
    yield s
    s.stop()


@pytest.fixture
def tiers():
    """``make(url, **config)`` → a tier over its own pool; all closed (and leak-checked) after."""
    made: list[Any] = []

    def make(url: str, pool_size: int = 32 << 20, tier_kw: dict | None = None,
             **cfg: Any) -> Any:
        cfg.setdefault("remote_key_prefix", f"t{uuid.uuid4().hex[:10]}")
        cfg.setdefault("remote_timeout", 5.0)
        config = CacheConfig(remote_url=url, **cfg)
        pool = MemoryPool(pool_size, pin_memory="false")
        t = create_backend(url, config, pool, **(tier_kw or {}))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()
        assert t.pool.used_bytes == 0, "the tier kept or leaked pool memory"
        t.pool.close()
