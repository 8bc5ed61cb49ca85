"""The ``lmc server`` daemon: listeners, sessions, storage, and a graceful shutdown.

One asyncio loop serves every connection (one :class:`Session` task each). Memory-tier
operations run inline on the loop (they are dictionary and pool operations); calls that may
reach the disk or Redis tiers go to a small thread pool so one slow read never stalls the
other clients. SIGTERM (or SIGINT): stop accepting, let in-flight requests finish (up to
``drain_timeout``), flush and close the storage (the disk tier's pending writes land), exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import stat
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmc.memory import MemoryPool
from lmc.pool_tuning import tune_pool
from lmc.server import metrics as M
from lmc.server.client import UNIX_SNDBUF
from lmc.server.config import ServerConfig
from lmc.server.http import MetricsHTTP
from lmc.server.session import IDLE, READING, SENDING, Session
from lmc.server.store import NamespacedStore
from lmc.storage_backend import StorageBackend, create_backend
from lmc.storage_manager import StorageManager, TierPool

log = logging.getLogger(__name__)


class RateLimitedWarnings:
    """At most ``per_second`` warnings a second: a peer spraying bad frames cannot flood the
    log (the suppressed count is reported with the next warning that gets through)."""

    def __init__(self, per_second: int = 20) -> None:
        self.per_second = per_second
        self._window = 0.0
        self._count = 0
        self._suppressed = 0

    def __call__(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._window >= 1.0:
            self._window, self._count = now, 0
        self._count += 1
        if self._count > self.per_second:
            self._suppressed += 1
            return
        if self._suppressed:
            log.warning("(%d similar warnings suppressed)", self._suppressed)
            self._suppressed = 0
        log.warning(msg, *args)


def build_storage(config: ServerConfig) -> tuple[MemoryPool, StorageManager]:
    """The pool, the memory tier and the configured lower tiers, in lmc's own manager."""
    cache_cfg = config.cache_config()
    pool = MemoryPool(cache_cfg.local_cpu_size, pin_memory="false")
    tune_pool(pool.buffer, huge=config.hugepages, touch=config.prefault)
    l1 = create_backend("cpu", cache_cfg, pool)
    lower_pool = TierPool(l1)  # lower tiers' reads may evict L1, like a store does
    tiers: list[StorageBackend] = [l1]
    try:
        if config.disk:
            tiers.append(create_backend("disk", cache_cfg, lower_pool))
        if config.redis:
            tiers.append(create_backend(config.redis, cache_cfg, lower_pool))
        manager = StorageManager(tiers, write_policy=cache_cfg.write_policy,
                                 queue_bytes=cache_cfg.write_queue_size)
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return pool, manager


def _unix_peer(conn: socket.socket) -> str:
    """Who is on the other end of a Unix socket: its pid and uid (SO_PEERCRED, Linux)."""
    try:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET,
                                                          socket.SO_PEERCRED, 12))
        return f"unix:pid={pid},uid={uid}"
    except (AttributeError, OSError):
        return "unix:?"


class Daemon:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        tok = config.resolved_token()
        self.token: bytes | None = tok.encode() if tok else None
        self.pool, self.storage = build_storage(config)
        self.store = NamespacedStore(self.storage, config.quotas, config.quota_default,
                                     config.max_namespaces)
        self.offload = len(self.storage.tiers) > 1
        self.io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="lmc-server-io")
        self.commit_bytes = max(1 << 20, min(64 << 20, self.pool.size // 8))
        self.sessions: set[Session] = set()
        self.listeners: list[tuple[socket.socket, str]] = []
        self.draining = False
        self.started = time.time()
        self.warn = RateLimitedWarnings()
        self.http: MetricsHTTP | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        M.bind_storage(lambda: self.pool.used_bytes, lambda: self.pool.size,
                       lambda: len(self.storage.l1) if hasattr(self.storage.l1, "__len__")
                       else 0)

    # ---------------------------------------------------------- storage
    async def run_storage(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.offload:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    def stats(self) -> dict[str, Any]:
        return {"server": {"version": 1, "uptime_s": time.time() - self.started,
                           "connections": len(self.sessions), "draining": self.draining},
                "pool": self.pool.stats(), "tiers": {**self.store.stats(), **self.storage.stats()},
                "namespaces": self.store.namespace_stats()}

    # -------------------------------------------------------- listening
    def _listen_tcp(self) -> socket.socket:
        cfg = self.config
        info = socket.getaddrinfo(cfg.host, cfg.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        if not cfg.is_loopback():
            log.warning("listening on %s, not loopback%s", cfg.host,
                        "" if self.token else ", and without a token: anyone who can reach "
                        "this address can read and write the cache")
        return sock

    def _listen_unix(self) -> socket.socket:
        path = Path(self.config.unix_socket)
        if path.exists():
            if not stat.S_ISSOCK(path.stat().st_mode):
                raise ValueError(f"unix_socket: {path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
                raise ValueError(f"unix_socket: {path} is in use by another server")
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink()  # left behind by a server that died
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # no window in which the socket is reachable by others
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, self.config.unix_socket_mode)
        return sock

    def open_listeners(self) -> None:
        if self.config.port is not None:
            self.listeners.append((self._listen_tcp(), "tcp"))
        if self.config.unix_socket:
            self.listeners.append((self._listen_unix(), "unix"))
        for sock, _ in self.listeners:
            sock.listen(512)
            sock.setblocking(False)

    @property
    def port(self) -> int | None:
        for sock, via in self.listeners:
            if via == "tcp":
                return sock.getsockname()[1]
        return None

    async def _accept_loop(self, lsock: socket.socket, via: str) -> None:
        loop = asyncio.get_running_loop()
        while not self.draining:
            try:
                conn, addr = await loop.sock_accept(lsock)
            except OSError as e:
                if self.draining:
                    return
                log.warning("accept failed on %s: %s", via, e)
                await asyncio.sleep(0.05)
                continue
            peer = f"{addr[0]}:{addr[1]}" if via == "tcp" else _unix_peer(conn)
            if self.draining or len(self.sessions) >= self.config.max_connections:
                M.REFUSED.inc()
                self.warn("%s: refused (%s)", peer, "shutting down" if self.draining
                          else f"{self.config.max_connections} connections open")
                conn.close()
                continue
            conn.setblocking(False)
            if via == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:  # Unix sockets do not autotune: a larger send buffer means fewer syscalls
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
            M.ACCEPTED.labels(via).inc()
            self._start_session(conn, peer, via)

    def _start_session(self, conn: socket.socket, peer: str, via: str) -> None:
        s = Session(self, conn, peer, via)
        self.sessions.add(s)
        M.CONNECTIONS.inc()
        s.task = asyncio.get_running_loop().create_task(s.run())

        def done(_: asyncio.Task) -> None:
            self.sessions.discard(s)
            M.CONNECTIONS.dec()

        s.task.add_done_callback(done)

    async def _watchdog(self) -> None:
        """Drop connections that stall half-way through a frame (slow-loris, dead peers)."""
        limit = self.config.frame_timeout
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = time.monotonic()
            for s in list(self.sessions):
                mid_frame = s.state in (READING, SENDING) or (s.state == IDLE
                                                               and s.reader.buffered > 0)
                if mid_frame and now - s.progress_at > limit and s.task is not None:
                    M.STALLED.inc()
                    self.warn("%s: no progress for %.1f s mid-frame; dropping", s.peer, limit)
                    s.task.cancel()

    # -------------------------------------------------------- lifecycle
    def request_stop(self) -> None:
        if self._stop is not None and not self._stop.is_set():
            log.info("shutdown requested: draining")
            self._stop.set()

    def _write_ready_file(self) -> None:
        path = self.config.ready_file
        if not path:
            return
        info = {"pid": os.getpid(), "port": self.port, "unix_socket": self.config.unix_socket,
                "metrics_port": self.http.port if self.http else None}
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)

    async def serve(self) -> None:
        """Run until SIGTERM/SIGINT (or :meth:`request_stop`), then drain and flush."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            self.open_listeners()
            if self.config.metrics_port is not None:
                self.http = MetricsHTTP(self, self.config.metrics_host,
                                        self.config.metrics_port)
                await self.http.start()
        except BaseException:
            for sock, _ in self.listeners:
                sock.close()
            await loop.run_in_executor(None, self._flush_and_close)
            raise
        self._tasks = [loop.create_task(self._accept_loop(s, via)) for s, via in self.listeners]
        self._tasks.append(loop.create_task(self._watchdog()))
        where = [f"tcp {self.config.host}:{self.port}" if via == "tcp"
                 else f"unix {self.config.unix_socket}" for _, via in self.listeners]
        log.info("lmc server listening on %s; pool %d MiB, tiers %s%s", ", ".join(where),
                 self.pool.size >> 20, [t.name for t in self.storage.tiers],
                 ", token required" if self.token else "")
        gc.collect()
        gc.freeze()  # torch's many import-time objects leave every future collection's scan
        self._write_ready_file()
        await self._stop.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        self.draining = True
        for t in self._tasks:
            t.cancel()
        for sock, via in self.listeners:
            sock.close()
            if via == "unix":
                with contextlib.suppress(OSError):
                    os.unlink(self.config.unix_socket)
        for s in list(self.sessions):  # idle ones go now; busy ones finish their request
            if s.state == IDLE and not s.reader.buffered and s.task is not None:
                s.task.cancel()
        pending = [s.task for s in self.sessions if s.task is not None]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.config.drain_timeout)
            for t in late:
                t.cancel()
            if late:
                log.warning("%d connection(s) still busy after %.1f s; dropped", len(late),
                            self.config.drain_timeout)
                await asyncio.wait(late, timeout=1.0)
        if self.http is not None:
            await self.http.stop()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._flush_and_close)
        self.io.shutdown(wait=True)
        log.info("lmc server stopped")

    def _flush_and_close(self) -> None:
        """Pending write-behind lands in the disk (and Redis) tier before the tiers close."""
        try:
            if not self.storage.flush(self.storage.close_timeout):
                log.warning("write-behind not drained after %.0f s", self.storage.close_timeout)
        except Exception as e:
            log.error("flushing the storage failed: %s", e)
        self.storage.close()
        self.pool.close()


def run(config: ServerConfig) -> int:
    """Blocking entry point of ``lmc server``."""
    logging.basicConfig(level=config.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        daemon = Daemon(config)
    except (ValueError, OSError) as e:
        log.error("cannot start: %s", e)
        return 2
    try:
        asyncio.run(daemon.serve())
    except OSError as e:
        log.error("cannot listen: %s", e)
        return 2
    return 0
