"""The ``lmc server`` daemon: listeners, sessions, storage, and a graceful shutdown.

One asyncio loop serves every connection (one :class:`Session` task each). Memory-tier
operations run inline on the loop (they are dictionary and pool operations); calls that may
reach the disk or Redis tiers go to a few worker threads so one slow read never stalls the
other clients. SIGTERM (or SIGINT): stop accepting, let in-flight requests finish (up to
``drain_timeout``), flush and close the storage (the disk tier's pending writes land), exit.

Bounds on what peers can hold: connections are capped at ``max_connections``, lowered to
what ``RLIMIT_NOFILE`` leaves after ``fd_reserve`` descriptors kept for the tiers
(:mod:`lmc.server.fdcap`; accepting pauses while displaced sockets are still closing);
connections before HELLO are capped below that (a newcomer displaces the oldest of them) and
closed after ``hello_timeout``; a watchdog drops any connection stalled mid-frame for
``frame_timeout``; repeating events are logged once per interval with a count (``ratelog``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import json
import logging
import os
import signal
import socket
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmc import units
from lmc.events.events_config import EventsConfig
from lmc.memory import invariants
from lmc.memory.pool import MemoryPool, check_fits
from lmc.server import fdcap
from lmc.server import metrics as M
from lmc.server.activity import Activity
from lmc.server.auth import Grant
from lmc.server.control import NamespacePins
from lmc.server.events import DaemonEvents
from lmc.server.http import MetricsHTTP
from lmc.server.interval_log import FirstSeen, IntervalLog, RateLimitedWarnings
from lmc.server.server_config import ServerConfig
from lmc.server.session import IDLE, Session
from lmc.server.store import NamespacedStore
from lmc.server.views import tier_media
from lmc.storage import chain
from lmc.storage.backends.server.client import UNIX_SNDBUF
from lmc.storage.manager import StorageManager

log = logging.getLogger(__name__)


DAEMON_KEYS = {"local_disk": "--disk", "remote_url": "--redis", "local_cpu_size": "--size"}


def preflight(config: ServerConfig) -> None:
    """What can be checked before the pool is built and pre-faulted (seconds per GiB): that
    the pool fits the host's memory, each tier's options and URL, and that the disk tier's
    directory can be made. Raises ``ValueError`` naming the flag."""
    cache_cfg = config.cache_config()
    check_fits(cache_cfg.local_cpu_size, config.prefault, DAEMON_KEYS["local_cpu_size"])
    chain.check_chain(cache_cfg, where=DAEMON_KEYS)


def build_storage(config: ServerConfig) -> tuple[MemoryPool, StorageManager]:
    """The pool, the memory tier and the configured lower tiers (``disk``, then ``redis``: any
    backend's URL), in lmc's own manager, built as an engine builds its own."""
    cache_cfg = config.cache_config()
    pool = MemoryPool(cache_cfg.local_cpu_size, pin_memory="false", hugepages=config.hugepages,
                      prefault="now" if config.prefault else "off")
    try:  # the engine's own tier stack: any lower tier an engine takes, the daemon takes
        manager = chain.build_storage(cache_cfg, pool)
    except BaseException:
        pool.close()
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
    def __init__(self, config: ServerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.auth = config.authenticator()
        self.listeners: list[tuple[socket.socket, str]] = []
        self.http: MetricsHTTP | None = None
        # bind first: a taken address fails in a second, not after the pool's pre-fault
        # (seconds per GiB); connections made meanwhile wait in the listen backlog
        self.open_listeners()
        try:
            preflight(config)
            if config.metrics_port is not None:
                self.http = MetricsHTTP(self, config.metrics_host, config.metrics_port,
                                        sock=bind_tcp(config.metrics_host, config.metrics_port,
                                                      "metrics_port"))
            log.info("bound %s; building the storage (pool %s%s)", ", ".join(self.where()),
                     units.size(config.size), ", pre-faulted before serving"
                     if config.prefault else "")
            t0 = time.perf_counter()
            self.pool, self.storage = build_storage(config)
            self.storage.retry_failed_writes(config.write_retry)
        except BaseException:
            self.close_listeners()
            raise
        log.info("storage ready in %s: tiers %s", units.seconds(time.perf_counter() - t0),
                 ", ".join(t.name for t in self.storage.tiers))
        self.kv_events: DaemonEvents | None = None  # KV events for routers (lmc.server.events)
        if config.kv_events is not None and EventsConfig.from_mapping(config.kv_events).enabled:
            try:
                self.kv_events = DaemonEvents(config.kv_events, self.storage)
            except BaseException:
                self.storage.close()
                self.pool.close()
                self.close_listeners()
                raise
        self.activity = Activity(config.max_namespaces)
        self.store = NamespacedStore(self.storage, config.quotas, config.quota_default,
                                     config.max_namespaces,
                                     reserved=self.auth.granted_namespaces())
        # PIN/UNPIN (lmc.server.control); ``clock`` times their TTLs (a test's, moved by hand)
        self.pins = NamespacePins(self.store, config, clock)
        self.offload = len(self.storage.tiers) > 1
        self.io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="lmc-server-io")
        self.commit_bytes = max(1 << 20, min(64 << 20, self.pool.size // 8))
        self.sessions: set[Session] = set()
        self.conn_cap = config.max_connections  # lowered by serve() to what fds allow
        self._closing = 0  # sockets dropped whose fd is not closed yet
        self._fd_freed: asyncio.Event | None = None
        self.pending: OrderedDict[Session, None] = OrderedDict()  # before HELLO, oldest first
        self.draining = False
        self.started = time.time()
        self._violations = 0
        self.warn = RateLimitedWarnings(logger=logging.getLogger("lmc.server.daemon"))
        self.events = {
            "accept": IntervalLog(logging.WARNING, "accept failed"),
            "refused": IntervalLog(logging.WARNING, "connections refused"),
            "hello_timeout": IntervalLog(
                logging.INFO, f"closed connections that sent no HELLO within "
                f"{config.hello_timeout:g} s"),
            "displaced": IntervalLog(
                logging.WARNING, "closed the oldest unauthenticated connection to admit a new "
                "one (the cap on connections before HELLO was reached)"),
            "write_wait": IntervalLog(
                logging.WARNING, f"a lower tier's write-behind queue stayed full for "
                f"{config.write_wait:g} s: PUTs answered, the tier misses their values"),
            "stalled": IntervalLog(
                logging.WARNING, f"dropped connections with no progress for "
                f"{config.frame_timeout:g} s mid-frame"),
        }
        self._hello_seen = FirstSeen()
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        M.bind_storage(lambda: self.pool.used_bytes, lambda: self.pool.size,
                       lambda: getattr(self.storage.l1, "__len__", lambda: 0)())

    # ---------------------------------------------------------- storage
    async def run_storage(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.offload:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    async def queue_room(self, nbytes: int) -> None:
        """Before a PUT's values are stored: wait (up to ``write_wait``) until every lower
        tier's write-behind queue can take them, so a burst of PUTs faster than the disk
        slows the writers down instead of dropping the disk copies of acknowledged values
        (which memory then evicts: lost)."""
        if not self.offload or self.storage.queues_have_room(nbytes):
            return
        deadline = time.monotonic() + self.config.write_wait
        while time.monotonic() < deadline:
            await asyncio.sleep(0.002)
            if self.storage.queues_have_room(nbytes):
                return
        M.WRITE_WAIT_EXPIRED.inc()
        self.events["write_wait"]()

    def stats(self, grant: Grant | None = None) -> dict[str, Any]:
        """Everything for an admin (or an open daemon); a tenant sees its namespaces only."""
        allowed = None if grant is None or grant.admin else grant.namespaces
        return {"server": {"version": 1, "uptime_s": time.time() - self.started,
                           "connections": len(self.sessions), "max_connections": self.conn_cap,
                           "unauthenticated": len(self.pending), "draining": self.draining},
                "pool": {**self.pool.stats(), "leaks": len(self.pool.leaks),
                         "violations": self.invariant_violations()},
                "tiers": {**self.store.stats(), **self.storage.stats()},
                "media": tier_media(self.storage.tiers),
                "requests": (self.activity.totals() if allowed is None else
                             _sum(self.activity.namespaces(allowed).values())),
                "namespaces": self._namespaces(allowed),
                **({"kv_events": self.kv_events.stats()}
                   if self.kv_events is not None and allowed is None else {})}

    def _namespaces(self, allowed: frozenset[str] | None) -> dict[str, dict[str, Any]]:
        """Every namespace that sent requests (its counts), every quota-tracked one (its
        chunks, bytes and quota in memory) and every one holding pins."""
        out: dict[str, dict[str, Any]] = {
            ns: dict(c) for ns, c in self.activity.namespaces(allowed).items()}
        for ns, held in self.store.namespace_stats(allowed).items():
            out.setdefault(ns, {}).update(held)
        for ns, pins in self.pins.stats(allowed).items():
            out.setdefault(ns, {}).update(pins)
        return out

    def invariant_violations(self) -> int:
        """Pool invariant violations so far (invariant mode only, i.e. in lmc's tests): a
        violation inside the daemon process must reach the test run, which reads this count
        through STATS, even when the code that met it turned it into a miss."""
        if not self.pool.invariants:
            return 0
        found = invariants.take()
        for msg in found:
            log.error("pool invariant violated: %s", msg)
        self._violations += len(found)
        return self._violations

    # ------------------------------------------------------------ sessions
    def established(self, s: Session) -> None:
        """``s`` has authenticated (or, with no tokens, completed a request)."""
        self.pending.pop(s, None)

    def hello_log(self, s: Session) -> None:
        """One INFO line per new (client name, token) pair, not per connection (engines open
        several connections and reconnect after failures), and a bounded number of those per
        interval whatever names peers send (:class:`FirstSeen`)."""
        who = (s.client, s.grant.name if s.grant else "-")
        if not self._hello_seen(who):
            log.debug("%s: hello from client %s (%s)", s.peer, *who)
            return
        log.info("%s: hello from client %s%s", s.peer, s.client,
                 f" (authenticated as {who[1]})" if self.auth.required else "")

    # -------------------------------------------------------- listening
    def _listen_tcp(self) -> socket.socket:
        cfg = self.config
        assert cfg.port is not None  # only called when a port is configured
        sock = bind_tcp(cfg.host, cfg.port, "port")
        if not cfg.is_loopback():
            log.warning("listening on %s, not loopback: only the tokens stand between this "
                        "cache and whoever can reach it", cfg.host)
        return sock

    def _listen_unix(self) -> socket.socket:
        assert self.config.unix_socket  # only called when a socket path is configured
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
        try:
            if self.config.port is not None:
                self.listeners.append((self._listen_tcp(), "tcp"))
            if self.config.unix_socket:
                self.listeners.append((self._listen_unix(), "unix"))
        except BaseException:
            self.close_listeners()
            raise
        for sock, _ in self.listeners:
            sock.listen(512)
            sock.setblocking(False)

    def close_listeners(self) -> None:
        for sock, via in self.listeners:
            sock.close()
            if via == "unix":
                with contextlib.suppress(OSError):
                    os.unlink(self.config.unix_socket or "")
        self.listeners = []
        if self.http is not None and self.http.sock is not None:
            self.http.sock.close()

    def where(self) -> list[str]:
        """The listening addresses, as log lines name them."""
        out = [f"tcp {self.config.host}:{self.port}" if via == "tcp"
               else f"unix {self.config.unix_socket}" for _, via in self.listeners]
        if self.http is not None and self.http.sock is not None:
            out.append(f"metrics http://{self.config.metrics_host}:"
                       f"{self.http.sock.getsockname()[1]}/metrics")
        return out

    @property
    def port(self) -> int | None:
        for sock, via in self.listeners:
            if via == "tcp":
                return sock.getsockname()[1]
        return None

    async def _accept_loop(self, lsock: socket.socket, via: str) -> None:
        loop = asyncio.get_running_loop()
        failing = 0
        while not self.draining:
            await self._fd_room()
            try:
                conn, addr = await loop.sock_accept(lsock)
            except OSError as e:
                if self.draining:
                    return
                failing += 1
                M.ACCEPT_ERRORS.inc()
                self.events["accept"](f"{via}: {e.strerror or e}")
                await asyncio.sleep(0.1)  # out of fds: retrying sooner only burns the CPU
                continue
            if failing:
                log.info("accept on %s works again after %d failure(s)", via, failing)
                failing = 0
            peer = f"{addr[0]}:{addr[1]}" if via == "tcp" else _unix_peer(conn)
            if not self._make_room():
                M.REFUSED.inc()
                self.events["refused"]("shutting down" if self.draining else
                                       f"{self.conn_cap} authenticated connections open")
                conn.close()
                continue
            conn.setblocking(False)
            if via == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:  # Unix sockets do not autotune: a larger send buffer means fewer syscalls
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
            M.ACCEPTED.labels(via).inc()
            self._start_session(conn, peer, via)

    def _make_room(self) -> bool:
        """Whether a new (unauthenticated) connection may be admitted. Connections before
        HELLO are capped below ``max_connections``; at that cap, or with every slot taken, the
        oldest of them is closed for the newcomer (a client that authenticates in time never
        loses its slot; one that idles cannot keep the door shut). Only authenticated
        connections filling every slot refuse a newcomer."""
        if self.draining:
            return False
        full = len(self.sessions) >= self.conn_cap
        if not full and len(self.pending) < self.unauthenticated_limit:
            return True
        if not self.pending:
            return False
        victim, _ = self.pending.popitem(last=False)
        M.UNAUTHENTICATED_DROPPED.labels("displaced").inc()
        self.events["displaced"]()
        self._drop(victim)
        return True

    @property
    def unauthenticated_limit(self) -> int:
        """Connections allowed before HELLO: the configured cap, kept below ``conn_cap``."""
        cfg = self.config
        below = self.conn_cap // 4 if cfg.max_unauthenticated is None else self.conn_cap - 1
        return max(1, min(cfg.unauthenticated_limit, below))

    async def _fd_room(self) -> None:
        """Wait while open sockets (sessions and dropped ones not yet closed) are at the cap:
        a burst of newcomers displacing each other must not outrun the closes."""
        assert self._fd_freed is not None
        while len(self.sessions) + self._closing > self.conn_cap:
            self._fd_freed.clear()
            await self._fd_freed.wait()

    def _drop(self, s: Session) -> None:
        """Close ``s`` now: its socket is shut at once, its task cancelled; its fd is closed
        when the task ends, and until then it counts against the cap (``_fd_room``)."""
        if s in self.sessions:
            self.sessions.discard(s)
            self._closing += 1
            s.dropped = True
        self.pending.pop(s, None)
        with contextlib.suppress(OSError):
            s.sock.shutdown(socket.SHUT_RDWR)
        if s.task is not None:
            s.task.cancel()

    def _start_session(self, conn: socket.socket, peer: str, via: str) -> None:
        s = Session(self, conn, peer, via)
        self.sessions.add(s)
        self.pending[s] = None
        M.CONNECTIONS.inc()
        s.task = asyncio.get_running_loop().create_task(s.run())

        def done(_: asyncio.Task) -> None:
            s.sock.close()  # a task cancelled before its first step never ran its finally
            self.sessions.discard(s)
            self.pending.pop(s, None)
            if s.dropped:
                self._closing -= 1
            if self._fd_freed is not None:
                self._fd_freed.set()
            M.CONNECTIONS.dec()

        s.task.add_done_callback(done)

    async def _watchdog(self) -> None:
        """Drop connections that stall mid-frame (slow-loris, dead peers, a client that went
        silent while its refused payload was being discarded) and connections that do not
        authenticate within ``hello_timeout``. A connection idle between frames is kept."""
        cfg = self.config
        while True:
            await asyncio.sleep(max(0.01, min(1.0, cfg.frame_timeout / 4,
                                              cfg.hello_timeout / 4)))
            now = time.monotonic()
            for s in list(self.pending):
                if now - s.accepted_at <= cfg.hello_timeout:
                    break  # oldest first: the rest are younger
                M.UNAUTHENTICATED_DROPPED.labels("hello_timeout").inc()
                self.events["hello_timeout"]()
                self._drop(s)
            for s in list(self.sessions):
                if s.waiting_on_peer and now - s.progress_at > cfg.frame_timeout:
                    M.STALLED.inc()
                    self.events["stalled"](s.peer)
                    self._drop(s)
            for ev in self.events.values():
                ev.flush()
            self._hello_seen.flush()
            self.pins.expire()  # pins past their TTL are ordinary chunks again

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        """asyncio's own accept loop (the /metrics listener) logs a traceback for every
        EMFILE; those go to the rate-limited accept line like the data listeners' own."""
        exc = ctx.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE,
                                                      errno.ENOBUFS, errno.ENOMEM):
            M.ACCEPT_ERRORS.inc()
            self.events["accept"](f"metrics: {exc.strerror or exc}")
            return
        loop.default_exception_handler(ctx)

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
                "metrics_port": self.http.port if self.http else None,
                "kv_events": None if self.kv_events is None else {
                    "endpoint": self.kv_events.endpoint,
                    "replay_endpoint": self.kv_events.replay_endpoint}}
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
            if self.http is not None:
                await self.http.start()
        except BaseException:
            self.close_listeners()
            await loop.run_in_executor(None, self._flush_and_close)
            raise
        loop.set_exception_handler(self._loop_exception)
        self._fd_freed = asyncio.Event()
        try:  # after the loop's own descriptors exist: they count as in use
            self.conn_cap = fdcap.connection_cap(self.config.max_connections,
                                                 self.config.fd_reserve)
        except fdcap.FdLimitError:
            self.close_listeners()
            await loop.run_in_executor(None, self._flush_and_close)
            raise
        self._tasks = [loop.create_task(self._accept_loop(s, via)) for s, via in self.listeners]
        self._tasks.append(loop.create_task(self._watchdog()))
        log.info("lmc server serving on %s; pool %s, tiers %s%s", ", ".join(self.where()),
                 units.size(self.pool.size), ", ".join(t.name for t in self.storage.tiers),
                 ", token required" if self.auth.required else "")
        if not self.auth.required:
            log.warning("no token configured: every process that can connect (to loopback or "
                        "the Unix socket) can read, write and delete every namespace; set "
                        "token_file or tokens")
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
                    os.unlink(self.config.unix_socket or "")
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
        self.pins.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.storage.close()
        self.pool.close()


def bind_tcp(host: str, port: int, key: str) -> socket.socket:
    """A TCP socket bound to ``host:port``; a failure names the address and the setting."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise OSError(f"{key}: cannot resolve {host!r}: {e.strerror}") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(f"{key}: {host}:{port} is already in use (another lmc server?); "
                          f"stop it or choose another {key}") from None
        raise OSError(f"{key}: cannot bind {host}:{port}: {e.strerror or e}") from None
    return sock


def _sum(counts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


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
    except fdcap.FdLimitError as e:
        log.error("cannot start: %s", e)
        return 2
    return 0
