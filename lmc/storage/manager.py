"""Ordered tiers behind one interface: L1 (the pool) first, lower tiers after it.

Lookups are batched per tier and answer the longest contiguous prefix present in *any* tier:
each tier is asked once, only about the keys no earlier tier had. Stores land in L1
synchronously; objects become visible only after the caller has finished writing them.

Lower tiers are fed by write-behind (:mod:`lmc.storage.write_behind`), one byte-bounded queue and
writer thread per tier, so the engine's store never waits on them. ``write_policy``:

* ``write_through``: every chunk stored in L1 is queued for every lower tier at once;
* ``write_on_evict``: L1 queues a chunk when it evicts it (:class:`WriteOnEvict`, a listener). Chunks
  still in L1 at ``close()`` are not written down. A lower-tier hit promoted into L1 keeps
  its copy below, demoted to the first victim of its priority there (``demote``): L1 will
  write it back if it evicts it, so the two tiers hold different chunks as far as room
  requires. Write-ahead: once L1's pool has less free room than a queue's bound and that
  (local) tier's queue is idle, a store queues copies of L1's next victims (half a queue's
  worth) for it; L1 evicts them later without queueing them (the tier holds them), so its
  memory comes back at once instead of one allocation filling the queue with victims and
  dropping the rest. An evicted chunk keeps its pool memory
  until written, so a store under memory pressure evicts further LRU chunks into the queue
  until the queue is full and only then frees memory by dropping a victim (as L1 alone would
  have): no store waits, but one allocation can move up to a queue's worth of cold chunks out
  of L1 (they stay readable from the queue). The queue bound is therefore capped at a quarter
  of the pool under this policy, or the queue could hold all of it and stores would fail.

Under write-through a queued chunk is L1's own object, referenced until written and so
unevictable; each queue is capped at half the pool (every queue mostly holds the same
chunks), so a slow tier drops writes (counted) instead of leaving stores no room.

A lower-tier hit is promoted: the object the tier read (allocated from the shared pool through
:class:`TierPool`, which may evict L1) is put into L1, and under write-through it is also
queued for the lower tiers above the one that had it. Chunks waiting in a queue are served
from there. Every lower-tier call is timed and counted in that tier's :class:`TierMetrics`;
with ``speeds`` set (a :class:`lmc.storage.speeds.Speeds`, the engine sets it), each read
that moved bytes, or failed, is also an observation of that tier's load speed.

Listeners (:class:`lmc.storage.tier.TierListener`, :meth:`StorageManager.add_listener`)
observe every tier's stores, promotions, evictions, deletes and clears, each event naming the
tier (name, declared medium, level). Write-on-evict is one of them. With no listener the
tiers' hooks are unset and each store pays one truthiness check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from lmc.lazy_import import LazyModule
from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.metrics import TierMetrics
from lmc.storage.layered_read import Coordinators, LayeredRead, LayerGate
from lmc.storage.layered_watch import watch_layered
from lmc.storage.load_watch import LoadWatch, Running, read_watched
from lmc.storage.priorities import Sticky
from lmc.storage.speeds import Speeds
from lmc.storage.tier import (
    DELETED,
    EVICTED,
    PROMOTED,
    STORED,
    Key,
    Medium,
    MemoryTier,
    StorageBackend,
    TierInfo,
    TierListener,
    tier_capabilities,
    tier_medium,
)
from lmc.storage.timed_contains import MIN_S as MIN_LOOKUP_S
from lmc.storage.timed_contains import TimedContains, budget_s
from lmc.storage.write_behind import QuietWindow, WriteBehind

if TYPE_CHECKING:
    import torch
else:  # imported at first use (lmc.lazy_import says why)
    torch = LazyModule("torch", globals())

log = logging.getLogger(__name__)
UNANSWERED = -2
"""``sources``' value for a key no tier had and some lower tier did not answer for in time."""
WRITE_POLICIES = ("write_through", "write_on_evict")


class TierPool:
    """The memory pool as lower tiers see it: ``allocate`` may evict unreferenced L1 chunks.

    A lower tier's ``get`` allocates its destination with ``self.pool.allocate(shape, dtype,
    num_tokens)``. Given the raw pool, that fails as soon as L1 has filled it (the steady
    state); through this wrapper it evicts L1's least recently used chunks first, exactly as a
    store does. It offers only what a lower tier may use of a pool: allocation, the pool's
    size and stats. Bytes of an object are read and written through the object itself
    (``MemoryObj.byte_view()``, ``io_spans()``), never through the pool's buffer.
    """

    def __init__(self, l1: MemoryTier) -> None:
        self._l1 = l1
        self.raw: MemoryPool = l1.pool
        """The pool itself: what an object's ``pool`` is (``obj.pool is tier_pool.raw``)."""

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, num_tokens: int = 0
                 ) -> MemoryObj | None:
        return self._l1.allocate(shape, dtype, num_tokens)

    def allocate_many(self, shape: Sequence[int], dtype: torch.dtype, count: int,
                      num_tokens: int = 0) -> list[MemoryObj]:
        return self._l1.allocate_many(shape, dtype, count, num_tokens)

    @property
    def size(self) -> int:
        return self.raw.size

    @property
    def used_bytes(self) -> int:
        return self.raw.used_bytes

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def stats(self) -> dict[str, float]:
        return self.raw.stats()


def tier_metrics(tier: StorageBackend) -> TierMetrics:
    """The tier's own ``metrics`` if it has one (so its checksum failures and the manager's
    counts land in one place), else a fresh one."""
    m = getattr(tier, "metrics", None)
    return m if isinstance(m, TierMetrics) else TierMetrics(tier.name)


class WriteOnEvict(TierListener):
    """Write-on-evict as a listener: L1's victims are queued for every lower tier. Runs
    under L1's lock, before the victims' memory is released, so it only queues (each queue
    takes its own reference). A local tier that answers presence from its index (the disk)
    is asked first, and the victims it holds already (promoted copies) are not queued: they
    would take the queue's room (and their memory would stay held) only to be skipped by
    the writer; the tier counts its copies as just written instead (``refresh``: left
    demoted, they were its first victims the moment L1 let go of them, and the chunk was
    lost from both). A remote tier is never asked under L1's lock."""

    observes_stores = False

    def __init__(self, queues: Sequence[WriteBehind]) -> None:
        self.queues = list(queues)
        self.local = [tier_medium(q.tier) is Medium.LOCAL_STORAGE
                      and tier_capabilities(q.tier).existence_without_reading
                      for q in self.queues]

    def on_removed(self, keys: Sequence[Key], tier: TierInfo, reason: str,
                   objs: Sequence[MemoryObj] | None = None) -> None:
        if tier.level == 0 and reason == EVICTED and objs:
            for q, local in zip(self.queues, self.local):
                if local:
                    try:
                        held = q.tier.contains(keys)
                    except Exception:  # noqa: BLE001 - then the writer asks again
                        held = [False] * len(keys)
                    if any(held):
                        q.offer([k for k, h in zip(keys, held) if not h],
                                [o for o, h in zip(objs, held) if not h])
                        try:  # the copy below stands for the write-back: no longer demoted
                            q.tier.refresh([k for k, h in zip(keys, held) if h])
                        except Exception as e:  # noqa: BLE001 - an eviction-order hint
                            log.debug("tier %s: refresh failed: %s", q.tier.name, e)
                        continue
                q.offer(keys, objs)


class EvictionMetrics(TierListener):
    """The engine's metrics as a listener: each lower tier's own evictions (the disk tier's
    capacity evictions) counted in ``lmc_evictions{tier}`` and the engine's
    ``evictions_<tier>`` through ``metrics.evicted(tier, chunks)`` (an
    :class:`lmc.metrics.EngineMetrics`). L1 counts its own evictions already."""

    observes_stores = False

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics

    def on_removed(self, keys: Sequence[Key], tier: TierInfo, reason: str,
                   objs: Sequence[MemoryObj] | None = None) -> None:
        if reason == EVICTED and tier.level > 0:
            self.metrics.evicted(tier.name, len(keys))


class StorageManager:
    """``tiers[0]`` is L1, a :class:`lmc.storage.tier.MemoryTier` over the pool."""

    def __init__(self, tiers: Sequence[StorageBackend], *, write_policy: str = "write_through",
                 queue_bytes: int = 1 << 30, close_timeout: float = 30.0,
                 write_quiet_s: float = 0.0) -> None:
        if not tiers:
            raise ValueError("StorageManager needs at least one tier")
        l1 = tiers[0]
        if not isinstance(l1, MemoryTier):
            missing = [m for m in ("pool", "allocate", "allocate_many", "touch", "on_evict")
                       if not hasattr(l1, m)]
            raise TypeError(f"the first tier must be a memory tier (lmc.storage.tier."
                            f"MemoryTier); {type(l1).__name__} lacks {', '.join(missing)}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy {write_policy!r}: choose one of "
                             f"{', '.join(WRITE_POLICIES)}")
        self.tiers = list(tiers)
        self.l1: MemoryTier = l1
        self.lower = self.tiers[1:]
        self.write_policy = write_policy
        self.close_timeout = close_timeout
        self.metrics = [tier_metrics(t) for t in self.lower]
        self._l1_pool = l1.pool
        # queued chunks hold pool memory: see the module doc
        share = 4 if write_policy == "write_on_evict" else 2
        queue_bytes = min(queue_bytes, self._l1_pool.size // share)
        self.queues = [WriteBehind(t, queue_bytes, m) for t, m in zip(self.lower, self.metrics)]
        self.quiet: QuietWindow | None = None
        """The engine's saves, which the writers hold off for (``write_quiet_ms``; None: off):
        :meth:`note_saving`."""
        if write_quiet_s > 0:
            self.quiet = QuietWindow(write_quiet_s)
            for q in self.queues:
                q.hold = self.quiet
        self.infos = [TierInfo(t.name, tier_medium(t), i) for i, t in enumerate(self.tiers)]
        self.speeds: Speeds | None = None
        """Load-speed estimates fed by every lower-tier read (set by the owner)."""
        self.chunk_tokens = 0
        """Tokens per key (set by the owner with ``speeds``): with the compute estimate, how
        long a lookup may wait for the lower tiers (:mod:`lmc.storage.timed_contains`)."""
        self.lookup_min_s = MIN_LOOKUP_S
        """The least a lookup waits for each lower tier's ``contains`` (set by the owner from
        the config's ``lookup_min_wait``; :mod:`lmc.storage.timed_contains`)."""
        self._probes = [TimedContains(t) for t in self.lower]
        """What listeners are told of each tier (name, declared medium, level)."""
        self._fetch_pool: ThreadPoolExecutor | None = None
        self._fetch_lock = threading.Lock()
        self._running = Running()  # watched reads' pieces running, or abandoned and landing
        self._watchers = Coordinators("lmc-watch")  # one per watched layered read
        self._listeners: tuple[TierListener, ...] = ()
        self._store_listeners: tuple[TierListener, ...] = ()  # those that observe stores
        self.priorities = Sticky()  # priorities that follow chunks (lmc.storage.priorities)
        self._ahead: list[WriteBehind] = []  # queues write-ahead feeds (write_on_evict)
        if self.queues and write_policy == "write_on_evict":
            woe = WriteOnEvict(self.queues)
            self._ahead = [q for q, local in zip(self.queues, woe.local) if local]
            self.add_listener(woe)

    # -------------------------------------------------------------- listeners
    @property
    def listeners(self) -> tuple[TierListener, ...]:
        return self._listeners

    def add_listener(self, listener: TierListener) -> None:
        """Observe every tier from now on (:class:`lmc.storage.tier.TierListener`)."""
        self._listeners = (*self._listeners, listener)
        self._wire()

    def remove_listener(self, listener: TierListener) -> None:
        self._listeners = tuple(x for x in self._listeners if x is not listener)
        self._wire()

    def _wire(self) -> None:
        """Set the tiers' and queues' hooks while someone listens, unset them otherwise (a
        store then pays nothing for the feature). The tuple is replaced, never mutated, so
        an event in flight on another thread iterates a consistent set."""
        on = bool(self._listeners)
        self._store_listeners = tuple(x for x in self._listeners
                                      if getattr(x, "observes_stores", True))
        stores = bool(self._store_listeners)
        self.l1.on_evict = self._l1_evicted if on else None
        sticky = bool(self.priorities)
        rank = self.priorities.get if sticky else None
        for tier in self.tiers:  # a chunk has its remembered rank as it lands in a tier
            try:
                tier.rank_arrivals(rank)
            except Exception as e:  # noqa: BLE001 - a hint; set_priority after still runs
                log.debug("tier %s: rank_arrivals failed: %s", tier.name, e)
        for level, (tier, q) in enumerate(zip(self.lower, self.queues), 1):
            q.on_written = partial(self._written, level) if stores or sticky else None
            q.rank = rank  # a full queue drops the lowest priority first
            try:
                tier.on_evicted = partial(self._lower_evicted, level) if on else None
            except AttributeError:  # a tier refusing attributes: its evictions go unseen
                log.debug("tier %s takes no on_evicted hook", tier.name)

    def _written(self, level: int, keys: Sequence[Key]) -> None:
        """Write-behind stored ``keys`` in lower tier ``level``: their priorities follow
        (:mod:`lmc.storage.priorities`), the listeners hear of it."""
        if self.priorities:
            try:
                self.priorities.apply(self.tiers[level], keys)
            except Exception as e:  # noqa: BLE001 - a hint, never the writer's failure
                log.warning("tier %s failed set_priority(): %s", self.tiers[level].name, e)
        if self._store_listeners:
            self._emit_stored(level, keys, reason=STORED)

    def _emit_stored(self, level: int, keys: Sequence[Key], reason: str = STORED) -> None:
        for x in self._store_listeners:
            try:
                x.on_stored(keys, self.infos[level], reason)
            except Exception as e:  # an observer's bug is never the caller's error
                log.warning("listener %r failed on_stored: %s", x, e)

    def _emit_removed(self, level: int, keys: Sequence[Key], reason: str = DELETED,
                      objs: Sequence[MemoryObj] | None = None) -> None:
        for x in self._listeners:
            try:
                x.on_removed(keys, self.infos[level], reason, objs)
            except Exception as e:
                log.warning("listener %r failed on_removed: %s", x, e)

    def _lower_evicted(self, level: int, keys: list[Key]) -> None:
        """A lower tier's own eviction (its ``on_evicted`` hook)."""
        self.queues[level - 1].note_evicted(keys)
        self._emit_removed(level, keys, EVICTED)

    def _l1_evicted(self, victims: list[tuple[Key, MemoryObj]]) -> None:
        """L1's eviction hook: runs under L1's lock with the victims gone from its map and
        their memory not yet released."""
        self._emit_removed(0, [k for k, _ in victims], EVICTED, [o for _, o in victims])

    def retry_failed_writes(self, seconds: float) -> None:
        """Keep a chunk whose lower-tier write failed queued (referenced, so L1 cannot evict
        it) and write it again with a doubling backoff for up to ``seconds``
        (:mod:`lmc.storage.write_behind`). Off by default: an engine recomputes a lost chunk, while
        the daemon holds the only copy of what its clients stored."""
        for q in self.queues:
            q.retry_for = max(0.0, float(seconds))

    def queues_have_room(self, nbytes: int) -> bool:
        """Whether a store of ``nbytes`` now would be queued whole for every lower tier
        (write-through; under write-on-evict stores queue nothing). Lets a caller that may
        wait (the daemon's PUT) wait for room instead of having the writes dropped."""
        if self.write_policy != "write_through":
            return True
        return all(q.has_room(nbytes) for q in self.queues)

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, num_tokens: int
                 ) -> MemoryObj | None:
        return self.l1.allocate(shape, dtype, num_tokens)

    def allocate_many(self, shape: Sequence[int], dtype: torch.dtype, count: int,
                      num_tokens: int) -> list[MemoryObj]:
        return self.l1.allocate_many(shape, dtype, count, num_tokens)

    def l1_touch(self, keys: Sequence[Key]) -> list[bool]:
        """L1 presence, refreshing the recency of present keys."""
        return self.l1.touch(keys)

    def l1_contains(self, keys: Sequence[Key]) -> list[bool]:
        return self.l1.contains(keys)

    # ---------------------------------------------------------------- lookups
    def prefix_hits(self, keys: Sequence[Key]) -> int:
        """Leading keys present in some tier (each tier asked once, batched)."""
        return len(self.prefix_sources(keys))

    def prefix_sources(self, keys: Sequence[Key]) -> list[int]:
        """For each leading key present in some tier, the index in ``tiers`` of the first
        tier holding it (a chunk waiting in a write-behind queue counts as L1): the longest
        present prefix and where it lies, from one batched pass (each tier asked once)."""
        return self.prefix_lookup(keys)[0]

    def prefix_lookup(self, keys: Sequence[Key]) -> tuple[list[int], bool]:
        """:meth:`prefix_sources`, and whether the prefix ended at a key a lower tier did
        not answer for in time (:data:`UNANSWERED`): it may have held it."""
        if not keys:
            return [], False
        if len(self.tiers) == 1:
            return [0] * self.l1.prefix_hits(keys), False
        where = self.sources(keys)
        n = 0
        while n < len(where) and where[n] >= 0:
            n += 1
        return where[:n], n < len(where) and where[n] == UNANSWERED

    def sources(self, keys: Sequence[Key]) -> list[int]:
        """For every key, the index in ``tiers`` of the first tier holding it, -1 where no
        tier does (each tier asked once, batched, only for the keys the tiers above miss):
        a hybrid model's lookup asks for parts that are not one prefix. ``UNANSWERED``
        (-2) where no tier had it and one did not answer in time (a miss all the same)."""
        if not keys:
            return []
        present = self.l1.contains(keys)
        for q in self.queues:
            if q.queued_chunks:
                present = [p or w for p, w in zip(present, q.contains(keys))]
        where = [0 if p else -1 for p in present]
        budget = self._lookup_budget(len(keys))
        deadline = None if budget is None else time.monotonic() + budget
        for level, (tier, m) in enumerate(zip(self.lower, self.metrics), 1):
            todo = [i for i, w in enumerate(where) if w < 0]
            if not todo:
                break
            t0 = time.perf_counter()
            try:
                if deadline is None:
                    found = tier.contains([keys[i] for i in todo])
                else:
                    left = max(self.lookup_min_s, deadline - time.monotonic())
                    answer = self._probes[level - 1].ask([keys[i] for i in todo], left)
                    if isinstance(answer, str):  # too slow now: a miss for this lookup
                        m.lookup_late(answer, len(todo), time.perf_counter() - t0)
                        for i in todo:
                            where[i] = UNANSWERED
                        continue
                    found = answer
            except Exception as e:  # a failing tier is a miss, never an error to the engine
                log.warning("tier %s failed contains(): %s", tier.name, e)
                m.error("lookup", type(e).__name__)
                continue
            hits = 0
            for i, f in zip(todo, found):
                if f:
                    where[i] = level
                    hits += 1
            m.lookup(hits, len(todo) - hits, time.perf_counter() - t0)
        return where

    def _lookup_budget(self, num_keys: int) -> float | None:
        """Seconds a lookup of ``num_keys`` keys may wait for the lower tiers (a share of
        recomputing them, :func:`lmc.storage.timed_contains.budget_s`); ``None``: no
        compute estimate, no deadline."""
        if self.speeds is None or self.chunk_tokens <= 0:
            return None
        return budget_s(self.speeds.prefill.estimate(), num_keys * self.chunk_tokens,
                        self.lookup_min_s)

    def get_prefix(self, keys: Sequence[Key]) -> list[MemoryObj]:
        """Objects for the longest present prefix of ``keys``, each acquired for the caller.
        Lower-tier hits are promoted into L1 on the way."""
        return self.fetch_prefix(keys)[0]

    def fetch_prefix(self, keys: Sequence[Key], watch: LoadWatch | None = None
                     ) -> tuple[list[MemoryObj], list[int]]:
        """``get_prefix``, and for each object the index in ``tiers`` of the tier it came
        from (queued chunks count as L1): a load's per-tier attribution without asking any
        tier a second time. ``watch``: whole-chunk reads stop by its rule
        (:mod:`lmc.storage.load_watch`)."""
        found: list[MemoryObj | None] = list(self.l1.get(keys)) if keys else []
        where = [0] * len(found)
        if self.lower and None in found:
            try:
                self._fill_from_lower(keys, found, where, watch=watch)
            except BaseException:  # the caller never sees these: their references are ours
                for o in found:
                    if o is not None:
                        o.release()
                raise
        if None not in found:  # every chunk found: no loop per chunk
            return cast(list[MemoryObj], found), where
        out = cast(list[MemoryObj], found[: found.index(None)])  # the prefix before a miss
        for o in found[len(out):]:
            if o is not None:
                o.release()
        return out, where[: len(out)]

    def fetch_prefix_layered(self, keys: Sequence[Key], watch: LoadWatch | None = None
                             ) -> tuple[list[MemoryObj], list[int], LayerGate]:
        """:meth:`fetch_prefix` for a layer-wise retrieve: tiers offering ``get_layers``
        answer at once and fill their objects layer by layer afterwards; the gate says
        which layer has landed and whether the chunks verified (:mod:`lmc.storage.layered_read`).
        Such chunks are promoted into L1 only once verified. ``watch``: whole-chunk reads
        stop by its rule as in :meth:`fetch_prefix`; layered reads are watched on a thread
        each and may be cut while they run (:mod:`lmc.storage.layered_watch`): the gate's
        ``kept()`` then says how many chunks load."""
        found: list[MemoryObj | None] = list(self.l1.get(keys)) if keys else []
        where = [0] * len(found)
        parts: list[tuple[LayeredRead, int] | None] = [None] * len(found)
        if self.lower and any(o is None for o in found):
            try:
                self._fill_from_lower(keys, found, where, parts, watch=watch)
            except BaseException:
                for o in found:
                    if o is not None:
                        o.release()
                raise
        n = 0
        while n < len(found) and found[n] is not None:
            n += 1
        for o in found[n:]:
            if o is not None:
                o.release()  # a read still filling it holds its own reference
        return [o for o in found[:n] if o is not None], where[:n], LayerGate(parts[:n])

    def _fill_from_lower(self, keys: Sequence[Key], found: list[MemoryObj | None],
                         where: list[int],
                         parts: list[tuple[LayeredRead, int] | None] | None = None,
                         watch: LoadWatch | None = None) -> None:
        """Fill L1's misses in ``found`` from the queues, then tier by tier (promoting);
        ``where[i]`` becomes the index in ``tiers`` of the tier that supplied ``found[i]``.
        With ``parts``, tiers that read layer by layer may answer (``parts[i]``: the read
        filling ``found[i]``). With ``watch``, whole-chunk reads go in pieces and stop by
        its rule; nothing is read after a stop."""
        self._from_queues(keys, found)
        for level, tier in enumerate(self.lower):
            todo = [i for i, o in enumerate(found) if o is None]
            if not todo:
                break
            read = None if parts is None else self._open_layers(level, tier,
                                                                [keys[i] for i in todo])
            if read is not None:
                for j, (i, o) in enumerate(zip(todo, read.objs)):
                    if o is not None:
                        found[i], where[i], parts[i] = o, level + 1, (read, j)  # type: ignore
                if watch is not None:  # cut, not stopped: its chunks are all in flight
                    self._watchers.start(partial(watch_layered, read, watch, todo, tier.name))
                continue
            if watch is None:
                got = self._get_lower(level, tier, [keys[i] for i in todo])
            else:
                got = read_watched(partial(self._get_piece, level, tier),
                                   partial(self._abandoned, level),
                                   [keys[i] for i in todo], todo, watch, self._fetcher(),
                                   tier.name, learn=not self._measured(level),
                                   observe=partial(self._observe, level),
                                   running=self._running)
            hit = [(i, o) for i, o in zip(todo, got) if o is not None]
            for i, o in hit:
                found[i] = o
                where[i] = level + 1
            self._promote(level, [keys[i] for i, _ in hit], [o for _, o in hit])
            if watch is not None and watch.stopped_at is not None:
                break

    def _get_piece(self, level: int, tier: StorageBackend, keys: list[Key]
                   ) -> list[MemoryObj | None]:
        """One piece of a watched read (on a fetch thread; ``close`` waits for these)."""
        self._running.enter()
        try:
            return self._get_lower(level, tier, keys, observe=False)
        finally:
            self._running.leave()

    def _measured(self, level: int) -> bool:
        """Whether lower tier ``level`` has been read since the speeds were made (a watched
        read learns an unmeasured tier's rate from one chunk before it reads on)."""
        speeds = self.speeds
        if speeds is None or level + 1 >= len(speeds.tiers):
            return False
        return speeds.tiers[level + 1].fit.count > 0

    def _fetcher(self) -> ThreadPoolExecutor:
        """The threads watched reads run their pieces on (``load_watch.DEPTH`` per read; a
        piece abandoned in flight keeps one busy until it returns, so there are more)."""
        with self._fetch_lock:
            if self._fetch_pool is None:
                self._fetch_pool = ThreadPoolExecutor(8, thread_name_prefix="lmc-fetch")
            return self._fetch_pool

    def _abandoned(self, level: int, keys: list[Key], objs: list[MemoryObj | None]) -> None:
        """A watched read's piece that landed after its load stopped: its chunks are good,
        so they go into L1 for the next request; this read's references end here."""
        hit = [(k, o) for k, o in zip(keys, objs) if o is not None]
        try:
            self._promote(level, [k for k, _ in hit], [o for _, o in hit])
        except Exception as e:  # noqa: BLE001 - a callback thread: never raise
            log.warning("promoting chunks read after a stopped load failed: %s", e)
        finally:
            for _, o in hit:
                o.release()

    def _from_queues(self, keys: Sequence[Key], found: list[MemoryObj | None]) -> None:
        """Fill misses from chunks waiting in write-behind queues (and put them back in L1)."""
        for q in self.queues:
            if not q.queued_chunks:
                continue
            todo = [i for i, o in enumerate(found) if o is None]
            got = q.lookup([keys[i] for i in todo])
            back = [(keys[i], o) for i, o in zip(todo, got) if o is not None]
            for i, o in zip(todo, got):
                if o is not None:
                    found[i] = o
            if back:
                self._l1_put([k for k, _ in back], [o for _, o in back])

    def _get_lower(self, level: int, tier: StorageBackend, keys: list[Key],
                   observe: bool = True) -> list[MemoryObj | None]:
        """``tier.get`` counted (and, with ``observe``, timed for the speed estimates; a
        watched read's pieces are timed as one read instead)."""
        m = self.metrics[level]
        t0 = time.perf_counter()
        try:
            got = list(tier.get(keys))
        except Exception as e:
            log.warning("tier %s failed get(): %s", tier.name, e)
            m.error("get", type(e).__name__)
            self._observe(level, 0, time.perf_counter() - t0, failed=True)  # always: slow
            return [None] * len(keys)
        if len(got) != len(keys):
            log.error("tier %s answered %d objects for %d keys: treated as misses", tier.name,
                      len(got), len(keys))
            for o in got:
                if o is not None:
                    o.release()
            return [None] * len(keys)
        hits = [o for o in got if o is not None]
        nbytes = sum(o.nbytes for o in hits)
        dt = time.perf_counter() - t0
        m.read(len(hits), len(keys) - len(hits), nbytes, dt)
        if hits and observe:
            self._observe(level, nbytes, dt)
        return got

    def _observe(self, level: int, nbytes: int, seconds: float, failed: bool = False) -> None:
        """One read of lower tier ``level`` for the speed estimates (if kept)."""
        speeds = self.speeds
        if speeds is None or level + 1 >= len(speeds.tiers):
            return
        tier = speeds.tiers[level + 1]
        if failed:
            tier.observe_failure(seconds)
        else:
            tier.observe(nbytes, seconds)

    def _open_layers(self, level: int, tier: StorageBackend, keys: list[Key]
                     ) -> LayeredRead | None:
        """The tier's layered read of ``keys``, with its promotion and counting set to run
        when it ends; ``None`` when the tier reads whole chunks (then ``get`` is used)."""
        m = self.metrics[level]
        t0 = time.perf_counter()
        try:
            read = tier.get_layers(keys)
        except Exception as e:
            log.warning("tier %s failed get_layers(): %s", tier.name, e)
            m.error("get", type(e).__name__)
            return None
        if read is None:
            return None
        if len(read.objs) != len(keys):
            log.error("tier %s opened %d reads for %d keys: treated as misses", tier.name,
                      len(read.objs), len(keys))
            read.add_done_callback(lambda r: None)
            for o in read.objs:
                if o is not None:
                    o.release()
            return None

        def ended(r: LayeredRead) -> None:
            try:
                ok = r.ok or []
                good = [(k, o) for k, o, g in zip(keys, r.objs, ok) if g and o is not None]
                nbytes = sum(o.nbytes for _, o in good)
                dt = time.perf_counter() - t0
                m.read(len(good), len(keys) - len(good), nbytes, dt)
                if r.error is not None:  # (values failing a check are the tier's to count)
                    m.error("get", "layered_read", sum(o is not None for o in r.objs))
                    self._observe(level, 0, dt, failed=True)
                elif good:
                    self._observe(level, nbytes, dt)
                self._promote(level, [k for k, _ in good], [o for _, o in good])
            finally:
                self._running.leave()

        # its promotion lands when the whole read ends, which may be after the load that
        # used its layers returned: wait_reads (and close) wait for it
        self._running.enter()
        read.add_done_callback(ended)
        return read

    def _l1_put(self, keys: list[Key], objs: list[MemoryObj]) -> int:
        """Put copies read from below (or waiting in a queue) into L1: a promotion."""
        mine = [(k, o) for k, o in zip(keys, objs) if o.pool is self._l1_pool]
        if not mine:
            return 0
        ks = [k for k, _ in mine]
        if not self._store_listeners:
            return self.l1.put(ks, [o for _, o in mine])
        fresh = self._absent_from_l1(ks)
        n = self.l1.put(ks, [o for _, o in mine])
        if n and fresh:
            self._emit_stored(0, fresh, PROMOTED)
        return n

    def _absent_from_l1(self, keys: Sequence[Key]) -> list[Key]:
        """Keys L1 does not hold, each once: what a put will newly make readable."""
        seen: set[Key] = set()
        out = []
        for k, present in zip(keys, self.l1.contains(keys)):
            if not present and k not in seen:
                seen.add(k)
                out.append(k)
        return out

    def write_ahead(self) -> int:
        """Under ``write_on_evict``: for each local lower tier whose queue is idle while
        L1's pool has less free room than the queue's bound, queue copies of L1's next
        victims (up to half the bound) that the tier does not hold yet (module doc).
        Returns the chunks queued."""
        coldest = getattr(self.l1, "coldest", None)
        if coldest is None:
            return 0
        n = 0
        for q in self._ahead:
            if q.queued_chunks or self._l1_pool.free_bytes >= q.max_bytes:
                continue
            cold = coldest(q.max_bytes // 2)
            if not cold:
                continue
            try:
                held = q.tier.contains([k for k, _ in cold])
                todo = [(k, o) for (k, o), h in zip(cold, held) if not h]
                if todo:
                    n += q.offer([k for k, _ in todo], [o for _, o in todo])
            except Exception as e:  # noqa: BLE001 - eviction writes them as before
                log.debug("tier %s: write-ahead failed: %s", q.tier.name, e)
            finally:
                for _, o in cold:
                    o.release()
        return n

    def _promote(self, level: int, keys: list[Key], objs: list[MemoryObj]) -> None:
        if not keys:
            return
        self.metrics[level].promoted(self._l1_put(keys, objs))
        if self.priorities:  # back in L1 with the rank it had
            self.priorities.apply(self.l1, keys)
        if self.write_policy == "write_through":
            for q in self.queues[:level]:  # the tiers above it missed these chunks
                q.offer(keys, objs)
        else:  # L1 writes them back when it evicts them: the copy below goes first
            try:
                self.lower[level].demote(keys)
            except Exception as e:  # noqa: BLE001 - an eviction-order hint
                log.debug("tier %s: demote failed: %s", self.lower[level].name, e)

    # ----------------------------------------------------------------- writes
    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        """Store fully written chunks in L1; under write-through also queue them for every
        lower tier (never waits on them)."""
        if self._store_listeners:
            fresh = self._absent_from_l1(keys)
            n = self.l1.put(keys, objs)
            if n and fresh:
                self._emit_stored(0, fresh, STORED)
        else:
            n = self.l1.put(keys, objs)
        if self.write_policy == "write_through":
            for q in self.queues:
                q.offer(keys, objs)
        elif self._ahead:
            self.write_ahead()
        return n

    def delete(self, keys: Sequence[Key]) -> int:
        """Remove ``keys`` from every tier and queue (and forget their priorities). With listeners, each tier is asked
        first which it holds (a delete is rare; the event names only keys that were there)."""
        self.priorities.forget(keys)
        for q in self.queues:
            q.discard(keys)
        n = 0
        for level, tier in enumerate(self.tiers):
            try:
                held = self._held(tier, keys) if self._listeners else []
                n += tier.delete(keys)
            except Exception as e:
                log.warning("tier %s failed delete(): %s", tier.name, e)
                continue
            if held:
                self._emit_removed(level, held, DELETED)
        return n

    @staticmethod
    def _held(tier: StorageBackend, keys: Sequence[Key]) -> list[Key]:
        return list(dict.fromkeys(k for k, p in zip(keys, tier.contains(keys)) if p))

    def clear_namespace(self, prefix: bytes = b"") -> dict[str, int | None]:
        """Remove every value of the tiers' own namespace (or the keys starting with
        ``prefix``) from every queue and tier (:meth:`StorageBackend.clear_namespace`), and
        tell the listeners: the keys each tier listed as removed, or a clear of a tier that
        could not list them. Returns, per tier name, how many went (``None``: unknown; a
        tier that cannot clear, or failed, is left out and logged)."""
        for q in self.queues:
            q.discard_prefix(prefix)
        if not prefix:
            self.priorities.clear()
        out: dict[str, int | None] = {}
        for level, tier in enumerate(self.tiers):
            try:
                keys = tier.clear_namespace(prefix)
            except NotImplementedError as e:
                log.warning("clear: %s", e)
                continue
            except Exception as e:  # a failing tier: its values stay, the others go
                log.warning("tier %s failed clear_namespace(): %s", tier.name, e)
                continue
            out[tier.name] = None if keys is None else len(keys)
            if keys:
                self.priorities.forget(keys)
                self._emit_removed(level, keys, DELETED)
            elif keys is None and not prefix:
                self._emit_cleared(level)
        return out

    def _emit_cleared(self, level: int) -> None:
        for x in self._listeners:
            try:
                x.on_cleared(self.infos[level])
            except Exception as e:
                log.warning("listener %r failed on_cleared: %s", x, e)

    def set_priority(self, keys: Sequence[Key], priority: int) -> int:
        """Retention ``priority`` for the held ``keys`` in every tier that keeps priorities
        (L1, disk: :mod:`lmc.storage.eviction`); returns how many L1 holds."""
        was = bool(self.priorities)
        self.priorities.remember(keys, priority)
        if was != bool(self.priorities):
            self._wire()  # write-behind now (or no longer) carries priorities down
        n = 0
        for level, tier in enumerate(self.tiers):
            try:
                got = tier.set_priority(keys, priority)
            except Exception as e:  # noqa: BLE001 - a hint, never the caller's error
                log.warning("tier %s failed set_priority(): %s", tier.name, e)
                continue
            if level == 0:
                n = got
        return n

    def clear_l1(self) -> None:
        """Drop everything L1 holds (a tier with ``clear()``; otherwise a delete of what its
        ``stats`` cannot list is impossible, so it is refused) and tell the listeners."""
        clear = getattr(self.l1, "clear", None)
        if clear is None:
            raise TypeError(f"memory tier {type(self.l1).__name__} has no clear()")
        clear()
        self._emit_cleared(0)

    # -------------------------------------------------------------- lifecycle
    def note_saving(self) -> None:
        """The engine is saving now (a layer-wise store's layer, a commit): with
        ``write_quiet_ms`` set, lower-tier writes wait for it to be quiet
        (:mod:`lmc.storage.write_behind`)."""
        if self.quiet is not None:
            self.quiet.touch()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has reached its tier (or failed); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ok = True
        for q in self.queues:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ok = q.flush(left) and ok
        return ok

    def wait_reads(self, timeout: float | None = None) -> bool:
        """Wait until no whole-chunk watched read is running and every piece a stopped load
        abandoned has landed, been observed (the tier's speed) and promoted into L1; False
        if ``timeout`` seconds passed first. Nothing waits for this on a request's path."""
        return self._running.wait_idle(timeout)

    def stats(self) -> dict[str, float]:
        """Per lower tier: the manager's counts and queue state, keys ``<tier>.<name>``."""
        out: dict[str, float] = {}
        for tier, m, q in zip(self.lower, self.metrics, self.queues):
            for k, v in {**m.snapshot(), **q.stats()}.items():
                out[f"{tier.name}.{k}"] = v
        return out

    def close(self, drain: bool = True) -> None:
        """Drain the write-behind queues (bounded by ``close_timeout`` in all), then close the
        tiers, lowest first, waiting (within the same bound) before L1 for reads abandoned by
        loads that stopped, which hold pool memory until they return."""
        deadline = time.monotonic() + self.close_timeout
        for probe in self._probes:  # a lookup now asks no lower tier
            probe.close()
        for q in self.queues:
            q.close(drain, max(0.0, deadline - time.monotonic()))
        for tier in reversed(self.lower):
            self._close_tier(tier)
        self._watchers.close()  # each ends once its read ended (the tiers' close ends them)
        # the lower tiers' close woke their reads: an abandoned piece lands (and is promoted
        # into L1, still open) before L1 closes
        with self._fetch_lock:
            pool, self._fetch_pool = self._fetch_pool, None
        if pool is not None:
            idle = self._running.wait_idle(max(0.0, deadline - time.monotonic()))
            pool.shutdown(wait=idle)
        self._close_tier(self.tiers[0])

    @staticmethod
    def _close_tier(tier: StorageBackend) -> None:
        try:
            tier.close()
        except Exception as e:
            log.warning("tier %s failed to close: %s", tier.name, e)
