"""L3: a Redis / Valkey server or cluster shared by every engine instance.

One value per chunk, ``{remote_key_prefix}:{key.hex()}`` → ``lmc.storage.serde`` header + payload.
Every call is batched: ``contains`` is one pipeline per server (one round trip for a whole
prompt); ``get``/``put`` spread a prompt's chunks over ``connections`` parallel connections
(an option, like ``ttl``: see ``RedisBackend.OPTIONS``), each a pipeline whose payloads go
between the socket and pool memory without intermediate copies (``wire``); reads
stream windowed ``GETRANGE`` pieces so that the server never buffers more than a few MiB per
connection (``fetch``). A put first asks
which keys the server already has (content addressing: same key, same bytes) and sends only
the others. Every read (``get``, ``get_layers``) checks the header key and both checksums (and,
with ``integrity_secret``, the value's keyed tag; given the engine's geometry, the header's
shape and dtype: ``lmc.storage.integrity``); a bad value is a miss, is deleted and is counted, on
every read path alike (``docs/threats/tiers.md``). The modules: ``url`` (URL forms), ``nodes`` (connections,
cluster slots), ``redis_jobs``/``fetch`` (pipelines); the breaker and the batch
splitter are every remote tier's (``lmc.storage.breaker``, ``lmc.storage.remote``).

Failure policy: nothing raises into the engine for I/O. ``get``/``contains``/``delete`` end
within ``remote_timeout`` (one deadline for the whole call, connects included); ``put`` runs
on the write-behind path and allows ``remote_timeout`` per socket operation instead, so a
large batch is not cut off while it progresses. Transport failures feed a circuit breaker
per server; while it is open the tier answers misses without calling.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.metrics import TierMetrics
from lmc.settings import parse_duration, parse_int, parse_positive_size
from lmc.storage.breaker import OPEN, STATE_CODES, CircuitBreaker
from lmc.storage.framing import ValueFraming
from lmc.storage.integrity import Geometry, Integrity
from lmc.storage.layered_read import Coordinators, LayeredRead
from lmc.storage.remote import breaker_options, split_batch
from lmc.storage.serde import encodable
from lmc.storage.tier import (
    BackendOption,
    Key,
    Medium,
    StorageBackend,
    TierCapabilities,
    register_backend,
)

from . import metrics
from .fetch import GetJob
from .jobs import Call, Job, SetJob, SmallJob
from .nodes import NodeConnections, Router
from .redis_layered_read import RedisLayeredRead
from .url import SCHEMES, parse_target
from .wire import Deadline

log = logging.getLogger(__name__)
JobFactory = Callable[[Call, Sequence[int]], Job]


def _error_kind(e: BaseException) -> str:
    if isinstance(e, (TimeoutError, RedisTimeoutError)):
        return "timeout"
    if isinstance(e, (OSError, RedisError)):
        return "connection"
    return "internal"


@register_backend("redis", schemes=tuple(SCHEMES))
class RedisBackend(StorageBackend):
    """Remote tier over redis-py connections (hiredis) with a zero-copy value path."""

    medium = Medium.REMOTE
    capabilities = TierCapabilities(layered_reads=True, existence_without_reading=True,
                                    durable=True)
    check_spec = staticmethod(parse_target)  # the URL alone, checked before start-up's slow work

    OPTIONS = {  # remote_options / ?name=value in the URL; defaults as in __init__
        "connections": BackendOption(4, lambda v, k: parse_int(v, k, minimum=1),
                                     "parallel connections a large batch is spread over"),
        "ttl": BackendOption(0.0, lambda v, k: parse_duration(v, k, minimum=0),
                             "seconds (or '12h') a value lives in Redis; 0 = no expiry"),
        "get_piece": BackendOption(1 << 20, parse_positive_size,
                                   "bytes per GETRANGE of a streamed read"),
        "get_window": BackendOption(4 << 20, parse_positive_size,
                                    "bytes a connection asks for ahead of what it has read"),
        **breaker_options("a server's"),
    }

    def __init__(self, spec: str = "redis://127.0.0.1:6379", *, config: CacheConfig,
                 pool: MemoryPool, connections: int = 4, ttl: float = 0.0,
                 breaker_threshold: int = 3,
                 breaker_backoff: float = 0.25, breaker_max_backoff: float = 10.0,
                 get_piece: int = 1 << 20, get_window: int = 4 << 20, **_: Any) -> None:
        self.target = parse_target(spec)
        self.pool = pool  # the engine passes one whose allocate() may evict L1 chunks
        self.metrics = TierMetrics(self.name)  # the storage manager adds its counts here too
        self.timeout = config.remote_timeout
        self.prefix = config.remote_key_prefix.encode() + b":"
        self.px = int(round(ttl * 1000))
        self.connections = connections
        self.get_piece = get_piece    # bytes per GETRANGE (see fetch.py)
        self.get_window = get_window  # bytes requested ahead per connection
        # the framing stage (lmc.storage.framing): header, checksum and keyed tag of each value
        self.framing = ValueFraming(Integrity.from_config(config))
        # the engine's chunk geometry (lmc.storage.integrity.expect_geometry): a value whose header
        # describes another chunk is refused from its header, like a checksum failure
        self.expected_geometry: Geometry | None = None

        def make_breaker(label: str) -> CircuitBreaker:
            listener = metrics.breaker_listener(label)

            def on_change(state: str) -> None:
                listener(state)
                log.log(logging.WARNING if state == OPEN else logging.INFO,
                        "redis tier %s: circuit breaker for %s is now %s",
                        self.target.display, label, state)

            return CircuitBreaker(breaker_threshold, breaker_backoff, breaker_max_backoff,
                                  probe_timeout=max(5.0, 4 * self.timeout), on_change=on_change)

        # a fetch and a write-behind batch may each use ``connections`` at the same time
        self.router = Router(self.target, make_breaker, max_idle=2 * self.connections + 2,
                             warm=self.connections)
        # the first calls find their connections made (nodes.py says why)
        self.router.checked.wait(self.router.check_timeout * len(self.router.seeds))
        self._executor: ThreadPoolExecutor | None = None
        self._exec_lock = threading.Lock()
        self._counts: Counter[str] = Counter()  # plain figures for stats()
        self._count_lock = threading.Lock()
        self.coordinators = Coordinators("lmc-redis-layers")  # layered reads in progress
        self.closed = False

    @property
    def ttl_seconds(self) -> float:
        """How long a value lives here (0: until evicted): the funnel's ``ttl`` misses."""
        return self.px / 1000.0

    # ------------------------------------------------------------------ helpers
    def remote_key(self, key: Key) -> bytes:
        return self.prefix + key.hex().encode()

    def _count(self, **kv: float) -> None:
        with self._count_lock:
            self._counts.update(kv)

    def _threads(self) -> ThreadPoolExecutor:
        ex = self._executor
        if ex is None:
            with self._exec_lock:
                if self.closed:  # a call that raced close() must not start a new executor
                    raise RuntimeError("redis tier closed")
                ex = self._executor
                if ex is None:
                    ex = self._executor = ThreadPoolExecutor(
                        max_workers=2 * self.connections, thread_name_prefix="lmc-redis")
        return ex

    def _failed(self, node: NodeConnections, op: str, e: BaseException) -> None:
        kind = _error_kind(e)
        self.metrics.error(op, kind)
        self._count(**{f"errors_{kind}": 1})
        if kind == "internal":
            log.error("redis tier %s: %s failed on %s", self.target.display, op, node.label,
                      exc_info=e)
            return
        log.debug("redis tier %s: %s on %s failed: %s", self.target.display, op, node.label, e)
        node.reset()
        node.breaker.failure(e)
        if self.target.cluster:
            self.router.invalidate()

    def _attempt(self, node: NodeConnections, job: Job, dl: Deadline) -> None:
        """Run one job; never raises. A stale pooled connection gets one fresh retry."""
        try:
            dl.remaining()
        except TimeoutError:  # waited in our own queue past the deadline: not the server's
            job.abort()       # fault, so a miss that does not count against the breaker
            self._count(expired_in_queue=1)
            return
        for attempt in (0, 1):
            wc, reused, seen = None, False, 0
            try:
                wc, reused = node.take(dl)
                seen = wc.bytes_in
                job.send(wc, dl)
                job.recv(wc, dl)
            except Exception as e:
                if wc is not None:
                    wc.close()
                job.abort()
                stale = (reused and wc is not None and wc.bytes_in == seen
                         and _error_kind(e) == "connection")
                if stale and attempt == 0:
                    node.reset()
                    continue
                self._failed(node, job.op, e)
                return
            node.give(wc)
            node.breaker.success()
            return

    def _dispatch(self, call: Call, make_job: JobFactory, dl: Deadline, parallel: bool) -> None:
        """Route keys to servers (breakers permitting) and run their jobs."""
        try:
            groups = self.router.group(call.rkeys, dl)
        except Exception as e:
            self.metrics.error(call.op, "topology")
            self._count(errors_topology=1)
            log.debug("redis tier %s: no cluster topology: %s", self.target.display, e)
            return
        n = len(call.rkeys)
        pairs: list[tuple[NodeConnections, Job]] = []
        for node, idxs in groups.items():
            if not node.breaker.allow():
                metrics.REJECTED_KEYS.labels(call.op).inc(len(idxs))
                self._count(rejected_keys=len(idxs))
                continue
            parts = max(1, round(self.connections * len(idxs) / n)) if parallel else 1
            pairs += [(node, make_job(call, idxs[a:b]))
                      for a, b in split_batch([1] * len(idxs), parts)]
        if not pairs:
            return
        if len(pairs) == 1:
            self._attempt(*pairs[0], dl)
        elif parallel:
            futs = []
            for node, job in pairs[1:]:
                try:
                    futs.append(self._threads().submit(self._attempt, node, job, dl))
                except RuntimeError:  # close() shut the executor down: this part is a miss
                    job.abort()
            self._attempt(*pairs[0], dl)
            for f in futs:
                # _attempt never raises; every job is bounded by the deadline; a job close()
                # cancelled before it ran never started: its keys stay misses
                with contextlib.suppress(CancelledError):
                    f.result()
        else:
            self._pipelined(pairs, dl)
        if call.reply_errors:
            kinds = Counter(e.kind for e in call.reply_errors)
            self.metrics.error(call.op, "reply", len(call.reply_errors))
            self._count(errors_reply=len(call.reply_errors))
            log.debug("redis tier %s: %s error replies: %s", self.target.display, call.op,
                      dict(kinds))
            if call.topology_changed:
                self.router.invalidate()

    def _pipelined(self, pairs: list[tuple[NodeConnections, Job]], dl: Deadline) -> None:
        """Small jobs on several servers from this thread: send all, then read all, so the
        call costs one round trip however many servers it touches."""
        sent = []
        for node, job in pairs:
            wc = None
            try:
                wc, reused = node.take(dl)
                job.send(wc, dl)
                sent.append((node, job, wc))
            except Exception:
                if wc is not None:
                    wc.close()
                job.abort()
                self._attempt(node, job, dl)  # one more try, on its own
        for node, job, wc in sent:
            try:
                job.recv(wc, dl)
            except Exception as e:
                wc.close()
                job.abort()
                self._failed(node, job.op, e)
                continue
            node.give(wc)
            node.breaker.success()

    def _finish(self, op: str, t0: float, call: Call, **outcomes: int) -> None:
        """Count one call (hits, bytes and latency per tier are the storage manager's)."""
        self.metrics.checksum_failure(call.corrupt)
        self._count(**{f"{op}_calls": 1, f"{op}_seconds": time.perf_counter() - t0},
                    **{f"{op}_{k}": v for k, v in outcomes.items()}, corrupt=call.corrupt,
                    alloc_failures=call.alloc_failures,
                    **{f"bytes_{'read' if op == 'get' else 'written'}": call.nbytes})

    # ------------------------------------------------------------------ tier API
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        if not keys or self.closed:
            return [False] * len(keys)
        t0 = time.perf_counter()
        call = Call("contains", keys, [self.remote_key(k) for k in keys], [0] * len(keys))
        self._dispatch(call, lambda c, idxs: SmallJob(c, idxs, (b"STRLEN",)),
                       Deadline(self.timeout), parallel=False)
        # STRLEN, not EXISTS: a value too short to hold a header is not there
        out = [r is not None and r >= self.framing.size for r in call.results]
        hits = sum(out)
        self._finish("contains", t0, call, hit=hits, miss=len(keys) - hits)
        return out

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        if not keys or self.closed:
            return [None] * len(keys)
        t0 = time.perf_counter()
        results: list[Any] = [None] * len(keys)
        call = Call("get", keys, [self.remote_key(k) for k in keys], results)
        self._dispatch(call, lambda c, idxs: GetJob(c, idxs, self.pool.allocate,
                                                    self.get_piece, self.get_window,
                                                    self.framing, self.expected_geometry),
                       Deadline(self.timeout), parallel=True)
        hits = sum(r is not None for r in results)
        self._finish("get", t0, call, hit=hits, miss=len(keys) - hits)
        return results

    def get_layers(self, keys: Sequence[Key]) -> LayeredRead | None:
        """Heads now (one round trip), payloads layer by layer in the background
        (:mod:`lmc.storage.backends.redis.redis_layered_read`)."""
        if not keys or self.closed:
            return None
        call = RedisLayeredRead(RedisCalls(self), keys)
        call.start()
        return call.read

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        if len(keys) != len(objs):
            raise ValueError(f"put: {len(keys)} keys but {len(objs)} objects")
        ok = [i for i, o in enumerate(objs) if encodable(o)]
        if len(ok) < len(objs):  # what lmc.storage.serde cannot encode is skipped, as every tier does
            self.metrics.error("put", "unsupported", len(objs) - len(ok))
            keys, objs = [keys[i] for i in ok], [objs[i] for i in ok]
        if not keys or self.closed:
            return 0
        t0 = time.perf_counter()
        rkeys = [self.remote_key(k) for k in keys]
        # content-addressed: a key already there holds these bytes, so skip its transfer
        # (with a TTL, its life is renewed in the same round trip)
        probe = Call("put", keys, rkeys, [None] * len(keys))
        verbs = [(b"PEXPIRE", b"%d" % self.px)] if self.px else []
        self._dispatch(probe, lambda c, idxs: SmallJob(c, idxs, *verbs, (b"STRLEN",)),
                       Deadline(self.timeout), parallel=False)
        head = self.framing.size
        present = sum(r is not None and r >= head for r in probe.results)
        todo = [i for i, r in enumerate(probe.results) if r is not None and r < head]
        stored = 0
        call = Call("put", keys, rkeys, [False] * len(keys))
        if todo:
            sub = Call("put", [keys[i] for i in todo], [rkeys[i] for i in todo],
                       [False] * len(todo))
            sub_objs = [objs[i] for i in todo]
            self._dispatch(sub, lambda c, idxs: SetJob(c, idxs, sub_objs, self.px,
                                                       self.framing),
                           Deadline(self.timeout, idle=True), parallel=True)
            stored = sum(r is True for r in sub.results)
            call = sub
        failed = len(keys) - present - stored
        self._finish("put", t0, call, stored=stored, present=present, failed=failed)
        return stored + present

    def delete(self, keys: Sequence[Key]) -> int:
        if not keys or self.closed:
            return 0
        t0 = time.perf_counter()
        call = Call("delete", keys, [self.remote_key(k) for k in keys], [0] * len(keys))
        self._dispatch(call, lambda c, idxs: SmallJob(c, idxs, (b"DEL",)),
                       Deadline(self.timeout), parallel=False)
        n = sum(r or 0 for r in call.results)
        self._finish("delete", t0, call, deleted=n)
        return n

    def clear_namespace(self, prefix: bytes = b"") -> list[Key]:
        """Every value under this tier's ``remote_key_prefix`` (or whose key starts with
        ``prefix``), server by server through ``SCAN``/``UNLINK`` (``remote_timeout`` per
        command); a server that fails keeps its values, said in one warning."""
        if self.closed:
            return []
        match = self.prefix + prefix.hex().encode() + b"*"
        out: list[Key] = []
        try:
            nodes = self.router.primaries(Deadline(self.timeout))
        except Exception as e:  # noqa: BLE001 - failure is a miss: nothing removed
            log.warning("redis tier %s: clearing found no server (%s)", self.target.display, e)
            return out
        for node in nodes:
            try:
                names = node.scan_unlink(match, self.timeout)
            except Exception as e:  # noqa: BLE001
                log.warning("redis tier %s: clearing %s failed (%s): its values stay",
                            self.target.display, node.label, e)
                continue
            for n in names:
                with contextlib.suppress(ValueError):
                    out.append(bytes.fromhex(n[len(self.prefix):].decode()))
        self._count(cleared=len(out))
        return out

    # ------------------------------------------------------------------ lifecycle
    def breaker_state(self) -> str:
        """The worst state over the tier's servers."""
        states = [p.breaker.state for p in self.router.nodes.values()]
        return max(states, key=STATE_CODES.__getitem__) if states else "closed"

    def stats(self) -> dict[str, Any]:
        with self._count_lock:
            counts = dict(self._counts)
        nodes = {p.label: {**p.breaker.stats(), "idle_connections": p.idle_count(),
                           "connects": p.connects}
                 for p in list(self.router.nodes.values())}
        return {"url": self.target.display, "cluster": self.target.cluster,
                "breaker": self.breaker_state(), "nodes": nodes,
                "slot_refreshes": self.router.refreshes, **counts}

    def close(self) -> None:
        with self._exec_lock:  # after this no call makes a new executor (see _threads)
            self.closed = True
            ex, self._executor = self._executor, None
        self.coordinators.close()  # layered reads end within their deadline
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)
        self.router.close()


class RedisCalls:
    """What the tier hands its layered reader (:mod:`.layered`), and all that reader may use
    of it: routing a call's jobs to the servers (breakers, retries, counting), its plain
    counters, deleting bad values, its coordinators, and the figures a read needs (framing,
    pool, deadline, piece and window sizes, the engine's geometry at the call's start)."""

    def __init__(self, tier: RedisBackend) -> None:
        self._tier = tier
        self.framing = tier.framing
        self.pool = tier.pool
        self.metrics = tier.metrics
        self.timeout = tier.timeout
        self.piece = tier.get_piece
        self.window = tier.get_window
        self.geometry = tier.expected_geometry
        self.display = tier.target.display
        self.coordinators = tier.coordinators

    def remote_key(self, key: Key) -> bytes:
        return self._tier.remote_key(key)

    def dispatch(self, call: Call, make_job: JobFactory, dl: Deadline, parallel: bool) -> None:
        """Run ``call``'s jobs on their servers (never raises: failures are misses)."""
        self._tier._dispatch(call, make_job, dl, parallel)

    def count(self, **kv: float) -> None:
        """Add to the tier's plain counters (``stats()``)."""
        self._tier._count(**kv)

    def delete(self, keys: Sequence[Key]) -> int:
        return self._tier.delete(keys)
