"""Connections to the servers of the remote tier, and which server owns which key.

One :class:`NodeConnections` per server keeps idle data connections (redis-py makes them:
TCP or TLS, AUTH, SELECT, all replies of the handshake parsed by hiredis) and the server's
circuit breaker, so that in a cluster one dead node costs only its own keys. :class:`Router`
maps keys to nodes: trivially for one server, through the slot table (``CLUSTER SLOTS``) for a
cluster, refreshed when a node answers MOVED/ASK or fails.

A tier that cannot be reached says so: at start-up a thread PINGs each seed node (the
handshake included: TLS, AUTH, SELECT) and logs one warning naming the URL and why when
one does not answer; the first failure of each server's calls is logged with its cause
(later ones are counted, and the breaker's opening is logged), so a dead or frozen server
is never only "stored 1000 / lookup 0".

The same thread then opens the data connections a batch spreads over and leaves them idle,
and the tier's constructor waits for it (:data:`STARTUP_TIMEOUT` per seed at most): a
connection's set-up is two to four round trips (TCP or TLS, AUTH, SELECT, the client's
name), which on a loaded machine took 0.87-2.9 s, so a fresh engine's first lookup, paying
it inside its ``remote_timeout`` of 0.5 s, timed out in 3 of 6 runs and lost the hit.
"""

from __future__ import annotations

import functools
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence

from redis.backoff import NoBackoff
from redis.connection import AbstractConnection
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.retry import Retry

from lmc import units
from lmc.storage.breaker import CircuitBreaker

from .url import RedisTarget
from .wire import Deadline, WireConn

log = logging.getLogger(__name__)
BreakerFactory = Callable[[str], CircuitBreaker]
STARTUP_TIMEOUT = 5.0
"""Seconds the start-up check gives each seed node: its PING and its data connections."""


class NodeConnections:
    """Idle data connections to one server, plus that server's breaker."""

    def __init__(self, host: str, port: int, target: RedisTarget, breaker: CircuitBreaker,
                 max_idle: int) -> None:
        self.host, self.port = host, port
        self.label = f"{host}:{port}"
        self.target = target
        self.breaker = breaker
        self.max_idle = max_idle
        self._idle: list[WireConn] = []
        self._lock = threading.Lock()
        self.connects = 0

    def _redis_conn(self, dl: Deadline) -> AbstractConnection:
        t = dl.remaining()
        conn = self.target.connection_class(
            host=self.host, port=self.port, socket_timeout=t, socket_connect_timeout=t,
            retry=Retry(NoBackoff(), 0), **self.target.options)
        conn.connect()  # handshake within the call's deadline; no retries of our own
        self.connects += 1
        return conn

    def connect(self, dl: Deadline) -> WireConn:
        conn = self._redis_conn(dl)
        sock: socket.socket | None = conn._sock  # redis-py has no public accessor for it
        if sock is None:
            raise ConnectionError(f"redis-py connected to {self.host}:{self.port} but holds "
                                  "no socket")
        return WireConn(sock, conn)

    def take(self, dl: Deadline) -> tuple[WireConn, bool]:
        """A connection and whether it was reused (a reused one may have gone stale)."""
        while True:
            with self._lock:
                wc = self._idle.pop() if self._idle else None
            if wc is None:
                return self.connect(dl), False
            if _looks_alive(wc):
                return wc, True
            wc.close()

    def give(self, wc: WireConn) -> None:
        if wc.idle:
            with self._lock:
                if len(self._idle) < self.max_idle:
                    self._idle.append(wc)
                    return
        wc.close()

    def reset(self) -> None:
        """Drop idle connections (after a failure they are probably dead too)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for wc in idle:
            wc.close()

    def control(self, dl: Deadline, *args: object) -> object:
        """One control command on a fresh connection, reply parsed by redis-py (hiredis)."""
        conn = self._redis_conn(dl)
        try:
            conn.send_command(*args)
            return conn.read_response()
        finally:
            conn.disconnect()

    def idle_count(self) -> int:
        return len(self._idle)

    def scan_unlink(self, match: bytes, step: float, count: int = 1000) -> list[bytes]:
        """Unlink every key matching ``match`` (a ``SCAN`` pattern), a page at a time on one
        connection, each command given ``step`` seconds; the keys unlinked. SCAN may name a
        key twice: each is unlinked once, and a key stored meanwhile may stay."""
        conn = self._redis_conn(Deadline(step))
        out: list[bytes] = []
        seen: set[bytes] = set()
        try:
            cursor = b"0"
            while True:
                conn.send_command("SCAN", cursor, "MATCH", match, "COUNT", count)
                reply = conn.read_response()
                if not isinstance(reply, list) or len(reply) != 2:
                    raise ConnectionError(f"SCAN answered {type(reply).__name__}")
                cursor, names = reply
                page = [n for n in names if isinstance(n, bytes) and n not in seen]
                if page:
                    conn.send_command("UNLINK", *page)
                    conn.read_response()
                    seen.update(page)
                    out += page
                if cursor in (b"0", 0, "0"):
                    return out
        finally:
            conn.disconnect()

    def warm(self, dl: Deadline, count: int) -> None:
        """Open up to ``count`` data connections now and keep them idle for the first calls."""
        for _ in range(max(0, min(count, self.max_idle) - self.idle_count())):
            self.give(self.connect(dl))


def _why(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def _looks_alive(wc: WireConn) -> bool:
    """An idle connection must have nothing to read; EOF or stray bytes mean it is stale."""
    try:
        readable, _, _ = select.select([wc.sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


class Router:
    """Key → server. One server, or a cluster's slot table."""

    def __init__(self, target: RedisTarget, make_breaker: BreakerFactory, max_idle: int,
                 check_timeout: float | None = STARTUP_TIMEOUT, warm: int = 1) -> None:
        """``check_timeout``: seconds the start-up check gives each seed node (in a thread:
        :attr:`checked` is set when it is over); None: no check. ``warm``: data connections
        it opens to each seed node that answered."""
        self.target = target
        self._make_breaker = make_breaker
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self.nodes: dict[tuple[str, int], NodeConnections] = {}
        self.seeds = [self.node(h, p) for h, p in target.nodes]
        self._slots: list[NodeConnections | None] | None = None
        self.refreshes = 0
        self.checked = threading.Event()  # the start-up check is over
        self.unreachable: list[str] = []  # seed nodes that did not answer it
        self._warm = warm
        self.check_timeout = check_timeout or 0.0
        if check_timeout is None:
            self.checked.set()
        else:
            threading.Thread(target=self._check, args=(check_timeout,), daemon=True,
                             name="lmc-redis-check").start()

    def _check(self, timeout: float) -> None:
        """PING every seed node once, then open its data connections; one warning per node
        that does not answer."""
        try:
            for node in self.seeds:
                t0 = time.monotonic()
                try:
                    dl = Deadline(timeout)
                    node.control(dl, "PING")
                except Exception as e:  # noqa: BLE001 - refused, timed out, TLS, AUTH: all told
                    self.unreachable.append(node.label)
                    log.warning("redis tier %s: %s did not answer at start-up (%s): lookups "
                                "miss and stores are dropped until it does", self.target.display,
                                node.label, _why(e))
                    continue
                log.info("redis tier %s: %s answered in %s", self.target.display, node.label,
                         units.seconds(time.monotonic() - t0))
                try:
                    node.warm(dl, self._warm)
                except Exception as e:  # noqa: BLE001 - it answered: calls connect as needed
                    log.debug("redis tier %s: %s: %d connection(s) made at start-up, then %s",
                              self.target.display, node.label, node.idle_count(), _why(e))
        finally:
            self.checked.set()

    def node(self, host: str, port: int) -> NodeConnections:
        with self._lock:
            node = self.nodes.get((host, port))
            if node is None:
                breaker = self._make_breaker(f"{host}:{port}")
                breaker.on_first_failure = functools.partial(self._first_failure,
                                                             f"{host}:{port}")
                node = NodeConnections(host, port, self.target, breaker, self._max_idle)
                self.nodes[(host, port)] = node
            return node

    def _first_failure(self, label: str, error: BaseException | None) -> None:
        why = f" ({_why(error)})" if error is not None else ""
        log.warning("redis tier %s: a call to %s failed%s: served as misses; later failures "
                    "are counted (errors_* in stats), and failures in a row open its breaker",
                    self.target.display, label, why)

    def invalidate(self) -> None:
        """Re-read the slot table before the next cluster call."""
        self._slots = None

    def group(self, rkeys: Sequence[bytes], dl: Deadline) -> dict[NodeConnections, list[int]]:
        """Indexes of ``rkeys`` per owning server; keys of unknown owner are left out."""
        if not self.target.cluster:
            return {self.seeds[0]: list(range(len(rkeys)))}
        slots = self._slots
        if slots is None:
            slots = self._refresh(dl)
        out: dict[NodeConnections, list[int]] = {}
        for i, k in enumerate(rkeys):
            owner = slots[key_slot(k)]
            if owner is not None:
                out.setdefault(owner, []).append(i)
        return out

    def _refresh(self, dl: Deadline) -> list[NodeConnections | None]:
        """Ask the known nodes (breakers permitting) for ``CLUSTER SLOTS``."""
        candidates = list(dict.fromkeys([*self.nodes.values(), *self.seeds]))
        last: Exception | None = None
        for node in candidates:
            if not node.breaker.allow():
                continue
            try:
                reply = node.control(dl, "CLUSTER", "SLOTS")
            except Exception as e:  # any failure: try the next node
                node.breaker.failure()
                node.reset()
                last = e
                continue
            node.breaker.success()
            table = self._table(reply, node)
            self._slots = table
            self.refreshes += 1
            return table
        raise ConnectionError(f"no cluster node answered CLUSTER SLOTS ({last or 'all breakers open'})")

    def _table(self, reply: object, asked: NodeConnections) -> list[NodeConnections | None]:
        table: list[NodeConnections | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        if not isinstance(reply, list):
            raise ConnectionError(f"CLUSTER SLOTS answered {type(reply).__name__}")
        for entry in reply:
            start, end, primary = int(entry[0]), int(entry[1]), entry[2]
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            if host in ("", "?"):  # the node does not know its own address: the one we asked
                host = asked.host
            owner = self.node(host, int(primary[1]))
            for s in range(start, end + 1):
                table[s] = owner
        return table

    def primaries(self, dl: Deadline) -> list[NodeConnections]:
        """Every server holding keys: the one, or each primary of the slot table."""
        if not self.target.cluster:
            return [self.seeds[0]]
        slots = self._slots if self._slots is not None else self._refresh(dl)
        return list(dict.fromkeys(p for p in slots if p is not None))

    def close(self) -> None:
        for node in list(self.nodes.values()):
            node.reset()
