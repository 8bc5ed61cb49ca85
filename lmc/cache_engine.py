"""``CacheEngine``: the public API over content addressing, transfer and the storage tiers.

``store`` gathers the engine's KV for new chunks into pool objects and makes them visible only
once complete; ``lookup`` answers how many leading prompt tokens lmc can supply; ``retrieve``
scatters them back into the engine's cache. ``store_layer`` / ``retrieve_layer`` are the
layer-wise forms a connector uses to overlap copies with compute. All methods are thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import torch

from lmc import units
from lmc.cache_control import CacheControl
from lmc.config import CacheConfig
from lmc.hybrid.engine import HybridCache
from lmc.hybrid.rules import default_interval
from lmc.keyed_chunks import KeyedChunks
from lmc.layerwise import CopyLease, LayerwiseRetrieve, LayerwiseStore
from lmc.memory.pool import LazyTensors, Lease, MemoryObj, MemoryPool, PoolArrays
from lmc.metrics import EngineMetrics
from lmc.storage.chain import TierSpec, build_storage
from lmc.storage.funnel import Funnel
from lmc.storage.integrity import GroupGeometry, expect_geometry
from lmc.storage.kvcodecs.gate import open_gates
from lmc.storage.layered_read import READY, LayerGate
from lmc.storage.load_watch import LoadWatch
from lmc.storage.lookup import LookupResult
from lmc.storage.manager import EvictionMetrics, StorageManager
from lmc.storage.pins import PinTable
from lmc.storage.speeds import KVBytes, Speeds
from lmc.storage.tier import Key, tier_capabilities, tier_medium
from lmc.token_database import (
    Chunk,
    ChunkedTokenDatabase,
    ChunkKey,
    Tokens,
    namespace_digest,
    tokens_to_bytes,
)
from lmc.transfer.bound_caches import TransferCache
from lmc.transfer.factory import TransferFactory, make_transfer
from lmc.transfer.grouped import GroupedTransfer
from lmc.transfer.kv_spec import KVCaches, KVSpec
from lmc.transfer.plan import ChunkRanges, KVTransfer, TransferPlan
from lmc.transfer.warm import pinned_buffer, warm_up

log = logging.getLogger(__name__)
FUNNEL_ROOT = bytes(16)  # the tokens' own chain, whatever the request's tag (lmc.storage.funnel)
MAX_QUEUED_PREFETCHES = 64  # prefetches waiting for the prefetch thread; more are refused
PREFETCH_PIECE = 4  # chunks per read of a prefetch: a cancelled one stops within a piece
Keys = Sequence[ChunkKey] | None  # a prompt's chunk keys computed ahead (RequestKeys), or None


def _size_runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(i, j)`` per run of chunks of one size, neighbours or not: what a store allocates
    in one call (``lmc.planner`` replays exactly these calls: keep the two in step)."""
    if isinstance(ranges, ChunkRanges):
        return ranges.runs()
    out = []
    i = 0
    while i < len(ranges):
        size = ranges[i][1] - ranges[i][0]
        j = i + 1
        while j < len(ranges) and ranges[j][1] - ranges[j][0] == size:
            j += 1
        out.append((i, j))
        i = j
    return out


class CacheEngine:
    """Stores and retrieves an engine's KV cache by token prefix.

    ``model_id``, the spec's shape/dtype, ``tp_rank``/``tp_size``, ``chunk_size`` and the
    config's ``tenant`` form the key namespace: engines agreeing on all of them share KV.

    Tiers: L1 is the pool; below it the disk tier when ``local_disk`` is set, then the backend
    claiming ``remote_url``'s scheme, then ``tiers`` (instances, or factories
    ``(config, pool) -> StorageBackend`` handed the pool lower tiers allocate from). Stores
    reach lower tiers by write-behind (``write_policy``; ``flush`` waits for it); lower-tier
    hits are promoted into L1.

    Adapters use this object's public calls only: by token prefix (``store``, ``lookup``,
    ``retrieve`` and their layer-wise forms), by key (``chunks``: :class:`KeyedChunks`, for
    an engine that keys its own pages), cache control (``pin``, ``delete``, ``clear``, ...),
    ``flush``, ``stats``; never ``storage``, the tiers' manager.
    """

    def __init__(self, config: CacheConfig, spec: KVSpec, model_id: str, tp_rank: int = 0,
                 tp_size: int = 1, *, tiers: Sequence[TierSpec] | None = None,
                 transfer: str | TransferFactory = "auto",
                 model_dir: str | os.PathLike | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        self.config = config
        self.spec = spec
        self.model_id = model_id
        ns = namespace_digest(model_id, spec.namespace_fields(), tp_rank, tp_size,
                              config.chunk_size, config.tenant)
        self.db = ChunkedTokenDatabase(config.chunk_size, config.save_unfull_chunk, ns)
        self.pool = MemoryPool(config.local_cpu_size, config.pin_memory,
                               debug=config.debug_leaks, prefault=config.local_cpu_prefault)
        try:  # the tier stack the daemon builds too (lmc.storage.chain)
            self.storage: StorageManager = build_storage(config, self.pool, tiers or ())
            # shared tiers check a value's header against this before allocating for it:
            # a rewritten shape or dtype is counted, deleted and a miss (docs/threats/tiers.md)
            expect_geometry(self.storage.lower, GroupGeometry.of_groups(spec, config.chunk_size))
            # a tier's lossy codec only with a passing quality verdict for this model
            open_gates(self.storage.lower, model_id, spec.dtype, model_dir)
        except BaseException:
            self.pool.close()
            raise
        self.metrics = EngineMetrics()
        self.storage.add_listener(EvictionMetrics(self.metrics))  # lower tiers' evictions
        # measured load and compute speeds, for the connectors' load-or-recompute decision
        # (lmc.storage.speeds): L1's "load" is the copy into the KV, under the compute
        self.speeds = Speeds(
            [(t.name, tier_medium(t).value, i == 0 or tier_capabilities(t).layered_reads)
             for i, t in enumerate(self.storage.tiers)], config.load_policy_priors)
        self.storage.speeds = self.speeds
        self.storage.chunk_tokens = config.chunk_size  # a lookup's deadline (timed_contains)
        self.storage.lookup_min_s = config.lookup_min_wait
        self.events = None  # KV events for routers (config kv_events; lmc.events)
        self.hybrid = self._hybrid_cache() if spec.is_hybrid else None
        # one publisher per instance: tensor-parallel ranks hold the same chunks (rank 0
        # speaks for them; another rank's block hashes would differ: tp_rank is in the key)
        if config.kv_events is not None and tp_rank == 0 and self.hybrid is not None:
            log.warning("lmc: kv_events are not published for a hybrid model (%s): its "
                        "chunks are stored as per-group parts a router cannot match",
                        self.describe_groups())
        elif config.kv_events is not None and tp_rank == 0:
            from lmc.events.engine import attach  # the app rank, imported only when on
            try:
                self.events = attach(self, config.kv_events)
            except BaseException:
                self.storage.close()
                self.pool.close()
                raise
        if tp_rank == 0 and self.hybrid is None:  # a publishing daemon learns chunks' blocks
            from lmc.events.notes import bind  # (a no-op without such a tier; attach binds)

            bind(self)
        self._transfer_pref = transfer
        # bound to the cache's geometry, not its block count: a re-created cache (vLLM's
        # allocation after profiling, sleep/wake) of the same model is accepted
        bound = spec.geometry_only()
        if spec.is_hybrid:  # a transfer per KV group, over the group's layers
            self._transfers = TransferCache(lambda caches: cast(KVTransfer, self._bind_groups(
                GroupedTransfer(bound, caches, transfer))), capacity=4)
        else:
            self._transfers = TransferCache(
                lambda caches: self._bind(make_transfer(bound, caches, transfer)), capacity=4)
        self._pins = PinTable(config.max_pinned_chunks, config.pin_timeout)
        self.control = CacheControl(self)  # pin/set_priority/delete/clear (lmc.cache_control)
        # the tiers by key, for an adapter whose engine keys its own pages (lmc.keyed_chunks)
        self.chunks = KeyedChunks(self.storage)
        self.funnel: Funnel | None = None  # the hit-rate funnel (lmc.storage.funnel)
        if config.funnel:
            self.funnel = Funnel(self.control.namespace, self.tier_names, config.chunk_size,
                                 [float(getattr(t, "ttl_seconds", 0.0) or 0.0)
                                  for t in self.storage.tiers])
            self.storage.add_listener(self.funnel)
            for q in self.storage.queues:
                q.on_dropped = self.funnel.note_dropped
        self._lock = threading.RLock()
        self._worker: ThreadPoolExecutor | None = None
        # prefetches run on a thread of their own: a slow tier's read must never hold up
        # the layer-wise copies of the requests being served (the "lmc-io" thread)
        self._prefetcher: ThreadPoolExecutor | None = None
        self._prefetch_queued = 0
        self.prefetches = 0  # asked for (stats: a router's prefetch shows here)
        self._closed = False

    # ------------------------------------------------------------- plumbing
    def _hybrid_cache(self) -> HybridCache:
        """The hybrid paths (:mod:`lmc.hybrid`), their checkpoint interval from the config."""
        cs = self.config.chunk_size
        interval = self.config.hybrid_checkpoint_interval or default_interval(
            cs, self.spec.groups)
        hc = HybridCache(self.spec, self.db, self.storage, self, self.tier_names, interval,
                         self.metrics)
        log.info("lmc: hybrid KV groups %s; sliding-window and state parts kept around "
                 "checkpoints every %d tokens and each prompt's end", self.describe_groups(),
                 interval)
        return hc

    def describe_groups(self) -> str:
        """The KV groups in one phrase (``full x 4, sliding(128) x 4``); "plain" without."""
        return ", ".join(g.describe() for g in self.spec.groups) or "plain"

    def _bind_groups(self, tr: GroupedTransfer) -> GroupedTransfer:
        for part in tr.parts:
            if isinstance(part, KVTransfer):
                self._bind(part)
        return tr

    def grouped_for(self, kv_caches: KVCaches) -> GroupedTransfer:
        """A hybrid engine's (cached) per-group transfers bound to these caches."""
        return cast(GroupedTransfer, self._transfers.get(kv_caches))

    def _require_hybrid(self) -> HybridCache:
        if self.hybrid is None:
            raise RuntimeError("not a hybrid engine")
        return self.hybrid

    def transfer_for(self, kv_caches: KVCaches) -> KVTransfer:
        """The (cached) transfer object bound to these cache tensors; validates new ones.
        Caches the caller has dropped are unbound, never kept alive (:mod:`lmc.transfer.bound_caches`)."""
        return self._transfers.get(kv_caches)

    def _bind(self, tr: KVTransfer) -> KVTransfer:
        """A new cache's transfer, its first-use costs paid now (:mod:`lmc.transfer.warm`):
        a registration, not the first request, waits for kernels to load. A warm-up that
        fails is logged and left to the first copy, which turns a failure into a miss."""
        try:
            secs = warm_up(tr, self._pool_buffer)
        except Exception as e:  # noqa: BLE001 - never worth failing a registration
            log.warning("lmc: warming the copies on %s failed (%s: %s): the first request "
                        "pays their first-use costs", tr.device, type(e).__name__, e)
            return tr
        if secs is not None:
            paths = getattr(tr, "paths", {})
            log.info("lmc: copies to and from %s ready in %s (kernels loaded; paths: %s)",
                     tr.device, units.seconds(secs),
                     ", ".join(f"{d} {s.replace('_', ' ')} {m}"
                               for (d, s), m in sorted(paths.items())))
        return tr

    @contextlib.contextmanager
    def _pool_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """A chunk of L1's pool for a warm-up copy (its registrations are what real copies
        use), torch's pinned memory when the pool has no room."""
        obj = self.pool.allocate(shape, dtype)
        if obj is None:
            with pinned_buffer(shape, dtype) as t:
                yield t
            return
        try:
            yield obj.tensor
        finally:
            obj.release()

    def _check_open(self) -> None:
        """Every public call passes here: a closed engine refuses it, and pins past
        ``pin_timeout`` are released (lazily, so no timer thread)."""
        if self._closed:
            raise RuntimeError("CacheEngine is closed")
        self._pins.expire()
        self.control.pins.expire()

    def executor(self) -> ThreadPoolExecutor:
        """One background thread, in order: layer-wise copies (prefetches have their own)."""
        with self._lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="lmc-io")
            return self._worker

    # LayerwiseHost (lmc.layerwise): what layer-wise copies need from the engine
    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def commit_chunks(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> None:
        self.storage.note_saving()
        self.storage.put(keys, objs)

    def note_saving(self) -> None:
        """A layer-wise store saved a layer: lower-tier writes hold off (``write_quiet_ms``)."""
        self.storage.note_saving()

    def record_transfer(self, kind: str, tokens: int, nbytes: int, seconds: float) -> None:
        self.metrics.transfer(kind, tokens, nbytes, seconds)

    # ---------------------------------------------------------------- store
    def _ranges(self, chunks: list[Chunk], regular: bool) -> Sequence[tuple[int, int]]:
        """The token ranges of ``chunks`` for planning: a :class:`ChunkRanges` where they
        are a run of a prompt's chunks as ``process_tokens`` cut them (``regular``: no
        chunk left out but at the end), which costs nothing per chunk; else a list."""
        if regular and chunks:
            return ChunkRanges(chunks[0][0], self.db.chunk_size, len(chunks), chunks[-1][1])
        return [(s, e) for s, e, _ in chunks]

    @staticmethod
    def _num_tokens(chunks: list[Chunk], ranges: Any) -> int:
        """Tokens in ``chunks``, whose token ranges are ``ranges`` (or unknown: ``None``)."""
        if isinstance(ranges, ChunkRanges):
            return ranges.end - ranges.start if ranges.n else 0
        return sum(e - s for s, e, _ in chunks)

    def _plan_store(self, tokens: Tokens, tr: KVTransfer, slots: torch.Tensor,
                    mask: Any, keys: Keys = None
                    ) -> tuple[list[Chunk], list[MemoryObj], TransferPlan | None]:
        """Chunks to store, their freshly allocated objects (owned by the caller) and the
        plan of their copy (``None`` when there is nothing to store)."""
        chunks = self.db.process_tokens(tokens, mask, keys)
        if not chunks:
            return [], [], None
        present = self.storage.l1_touch([k for _, _, k in chunks])
        todo = [c for c, p in zip(chunks, present) if not p] if True in present else chunks
        self.metrics.skipped("present", len(chunks) - len(todo))
        if not todo:
            return [], [], None
        # nothing left out: the prompt's own consecutive chunks
        ranges = self._ranges(todo, len(todo) == len(chunks))
        plan: TransferPlan | None = tr.plan(slots, ranges)
        unmapped = getattr(plan, "unmapped", None)  # known from planning, or asked
        if tr.has_negative(slots) if unmapped is None else unmapped:
            neg = (slots < 0).cpu().numpy()
            keep = [c for c in todo if not neg[c[0]:c[1]].any()]
            self.metrics.skipped("unmapped_slots", len(todo) - len(keep))
            if len(keep) < len(todo):
                todo = keep
                if not todo:
                    return [], [], None
                ranges = self._ranges(todo, False)
                plan = tr.plan(slots, ranges)
        objs: list[MemoryObj] = []
        for i, j in _size_runs(ranges):  # runs of equal-size chunks are allocated together
            a, b = ranges[i]
            got = self.storage.allocate_many(self.spec.chunk_shape(b - a), self.spec.dtype,
                                             j - i, b - a)
            objs += got
            if len(got) < j - i:  # pool full of referenced chunks: later ones are useless too
                self.metrics.skipped("pool_full", len(todo) - len(objs))
                todo = todo[: len(objs)]  # a prefix: as regular as all of them were
                plan = (tr.plan(slots, self._ranges(todo, isinstance(ranges, ChunkRanges)))
                        if todo else None)
                break
        return todo, objs, plan

    def store(self, tokens: Tokens, kv_caches: KVCaches, slot_mapping: Any,
              mask: Any = None, *, keys: Keys = None, horizon: int | None = None) -> int:
        """Save the KV of ``tokens`` (at ``slot_mapping`` in ``kv_caches``); returns new tokens
        stored. Chunks already in L1 are skipped without copying; a chunk with an unmapped
        (negative) slot or no room in the pool is skipped and counted, never half-stored.
        ``keys``: the prompt's chunk keys if already computed (``db.request_keys()``), so
        the prompt is not hashed again; every method taking ``tokens`` accepts them.

        A hybrid model's (``spec.groups``): ``slot_mapping`` is one per KV group (or one
        all groups share), each group stores the parts its kind keeps (:mod:`lmc.hybrid`)
        and ``horizon`` is the length of the sequence these tokens begin (its prompt: where
        its checkpoints lie; default ``len(tokens)``)."""
        self._check_open()
        t0 = time.perf_counter()
        if self.hybrid is not None:
            return self._hybrid_store(tokens, kv_caches, slot_mapping, mask, keys, horizon, t0)
        tr = self.transfer_for(kv_caches)
        slots = tr.check_slots(slot_mapping, self.db.num_tokens(tokens))
        chunks, objs, plan = self._plan_store(tokens, tr, slots, mask, keys)
        if not chunks:
            return 0
        assert plan is not None  # chunks to store come with their plan
        with CopyLease(objs) as lease:  # the gather owns objs until its handle is done
            # CPU: numpy views only (a tensor per chunk costs more than all else it needs),
            # a run of neighbouring objects as one view
            arrays = PoolArrays(objs) if tr.device.type == "cpu" else None
            lease.attach(tr.gather(plan, LazyTensors(objs), arrays=arrays)).wait()
            self.storage.put([k for _, _, k in chunks], objs)
        n = self._num_tokens(chunks, getattr(plan, "ranges", None))
        # every object is spec.chunk_shape(its tokens): bytes are linear in tokens
        self.metrics.transfer("store", n, self.spec.chunk_nbytes(n), time.perf_counter() - t0)
        self.metrics.pool(self.pool.used_bytes, self.pool.size)
        return n

    def _hybrid_store(self, tokens: Tokens, kv_caches: KVCaches, slot_mapping: Any,
                      mask: Any, keys: Keys, horizon: int | None, t0: float) -> int:
        hc = self._require_hybrid()
        tr = self.grouped_for(kv_caches)
        slots = tr.check_slots(slot_mapping, self.db.num_tokens(tokens))
        works = hc.plan_store(tokens, tr, slots, mask, keys, horizon)
        n = hc.store(works, tr)
        nbytes = sum(o.nbytes for w in works for o in w.objs)
        if nbytes:
            self.metrics.transfer("store", n, nbytes, time.perf_counter() - t0)
            self.metrics.pool(self.pool.used_bytes, self.pool.size)
        return n

    def store_layer(self, tokens: Tokens, kv_caches: KVCaches, slot_mapping: Any,
                    mask: Any = None, *, keys: Keys = None, horizon: int | None = None
                    ) -> LayerwiseStore:
        """Layer-wise store: call ``.save(layer)`` once each layer's KV is in the cache, then
        ``.commit()``; nothing is visible before the commit. See :class:`LayerwiseStore`
        (a hybrid model's: a :class:`~lmc.hybrid.layerwise.GroupedStore`, and ``store``'s
        arguments)."""
        self._check_open()
        if self.hybrid is not None:
            gtr = self.grouped_for(kv_caches)
            gslots = gtr.check_slots(slot_mapping, self.db.num_tokens(tokens))
            works = self.hybrid.plan_store(tokens, gtr, gslots, mask, keys, horizon)
            return cast(LayerwiseStore, self.hybrid.store_layer(works, gtr))
        tr = self.transfer_for(kv_caches)
        slots = tr.check_slots(slot_mapping, self.db.num_tokens(tokens))
        chunks, objs, plan = self._plan_store(tokens, tr, slots, mask, keys)
        return LayerwiseStore(self, tr, plan, chunks, objs)

    # --------------------------------------------------------------- lookup
    def lookup(self, tokens: Tokens, pin: bool = False, *, request_id: Hashable = None,
               keys: Keys = None) -> int:
        """Leading prompt tokens that lmc can supply now (``lookup_result(...).tokens``).

        ``pin=True`` holds the hit L1 chunks against eviction on behalf of ``request_id``
        (default: the prompt itself, its exact token sequence) until that owner's
        ``retrieve`` (which releases every pin of the owner, masked chunks included) or
        ``unpin``, for at most ``pin_timeout`` seconds. A repeated pinned lookup by the same
        owner replaces its pins (a scheduler re-asking for a waiting request never stacks
        them); past ``max_pinned_chunks`` further pins are refused and the answer is the
        same. Two requests with one prompt that each want their own pins pass request ids.
        See :mod:`lmc.storage.pins`."""
        return self.lookup_result(tokens, pin, request_id=request_id, keys=keys).tokens

    def lookup_result(self, tokens: Tokens, pin: bool = False, *,
                      request_id: Hashable = None, keys: Keys = None) -> LookupResult:
        """:meth:`lookup`'s answer with the tier holding each hit chunk, from the same single
        pass over the tiers (see :class:`~lmc.storage.lookup.LookupResult`)."""
        self._check_open()
        t0 = time.perf_counter()
        n = self.db.num_tokens(tokens)
        keys = self.db.keys(tokens) if keys is None else self.db.check_keys(keys, n)
        if self.hybrid is not None:  # only ends every KV group can serve
            found, needed = self.hybrid.lookup(tokens, keys)
            if pin:
                self._pins.pin(self._pin_owner(tokens, keys, request_id),
                               self.hybrid.pinned(needed))
            self.metrics.lookup(n, found.tokens, time.perf_counter() - t0)
            return found
        if pin:
            sources, held, unanswered = self._held_hits(keys)
            self._pins.pin(self._pin_owner(tokens, keys, request_id), held)
        else:
            sources, unanswered = self.storage.prefix_lookup(keys)
        if self.funnel is not None and keys:
            self.funnel.lookup(n, keys, self.db.keys(tokens, root=FUNNEL_ROOT), sources,
                               unanswered)
        hit_tokens = min(len(sources) * self.config.chunk_size, n)
        self.metrics.lookup(n, hit_tokens, time.perf_counter() - t0,
                            n - hit_tokens if unanswered else 0)
        return LookupResult(hit_tokens, self.config.chunk_size, self.tier_names,
                            bytes(sources) if hit_tokens else b"")

    @property
    def bytes_per_token(self) -> float:
        """KV bytes of one token in a stored chunk (what a load moves per position; a
        hybrid model's: its full-attention groups', see :attr:`load_bytes`)."""
        if self.hybrid is not None:
            return self.hybrid.load_bytes().per_token or 1.0
        cs = self.config.chunk_size
        return self.spec.chunk_nbytes(cs) / cs

    @property
    def load_bytes(self) -> KVBytes:
        """What a load of N positions moves, per group kind (what the load policy prices)."""
        if self.hybrid is not None:
            return self.hybrid.load_bytes()
        return KVBytes(self.bytes_per_token)

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The tiers' names, L1 first (what a ``LookupResult``'s sources index)."""
        return tuple(t.name for t in self.storage.tiers)

    def _held_hits(self, keys: Sequence[Key]) -> tuple[list[int], list[MemoryObj], bool]:
        """A pinned lookup's hit sources and the L1 chunks in it, acquired *before* the
        answer is counted: a chunk evicted between counting and pinning was promised
        unpinned; and whether a lower tier left the rest unanswered."""
        objs = self.storage.l1.get(keys)
        lead = next((i for i, o in enumerate(objs) if o is None), len(objs))
        rest, unanswered = self.storage.prefix_lookup(keys[lead:])
        sources = [0] * lead + rest
        Lease(objs[len(sources):]).release()
        return sources, [o for o in objs[:len(sources)] if o is not None], unanswered

    def unpin(self, tokens: Tokens = None, *, request_id: Hashable = None,
              session: str | None = None, salt: str | None = None,
              lora: str | None = None) -> int:
        """Drop pins; returns chunks unpinned. ``request_id``: what a ``lookup(pin=True)``
        took for that request. ``session``: what :meth:`pin` took for the session.
        ``tokens``: both kinds taken for exactly this prompt (``salt``/``lora`` name a
        tagged request's chain, as for :meth:`pin`)."""
        self._check_open()
        if tokens is None and request_id is None and session is None:
            raise ValueError("unpin() needs the lookup's tokens or its request_id, or a session")
        n = self.control.unpin(tokens if request_id is None else None, session, salt, lora)
        if request_id is None and tokens is None:
            return n
        keys = self.db.keys(tokens) if request_id is None else []
        return n + self._pins.release(self._pin_owner(tokens, keys, request_id))

    # --------------------------------------------------------------- control
    @property
    def namespace(self) -> str:
        """The namespace this engine serves (its config's ``tenant``, else ``default``):
        what every control call is scoped to."""
        return self.control.namespace

    def pin(self, tokens: Tokens, ttl: float, *, priority: int | None = None,
            session: str | None = None, salt: str | None = None, lora: str | None = None,
            namespace: str | None = None) -> int:
        """Keep the prompt's stored chunks in L1 for ``ttl`` seconds: eviction passes over
        them until then (lower-tier hits are read into L1 first), and an expired pin leaves
        an ordinary chunk. Returns the tokens pinned (the longest stored prefix).

        ``session``: the pins belong to that session, and each call replaces its last (a
        conversation's next turn holds the whole chain); else to this exact prompt.
        ``priority``: also :meth:`set_priority`. ``salt``/``lora``: the request's
        ``cache_salt`` and LoRA name, whose chain is its own. ``namespace``: refused
        unless this engine's (:attr:`namespace`). Bounded by ``max_ttl_pins`` chunks,
        ``max_pin_share`` of the pool and ``max_pin_ttl``: past them
        :class:`~lmc.storage.control.PinLimitError` / ``TTLError``, nothing pinned.
        See :mod:`lmc.cache_control`."""
        self._check_open()
        return self.control.pin(tokens, ttl, priority=priority, session=session, salt=salt,
                                lora=lora, namespace=namespace)

    def set_priority(self, tokens: Tokens, priority: int, *, salt: str | None = None,
                     lora: str | None = None, namespace: str | None = None) -> int:
        """Retention ``priority`` (an int in [-10, 10], default 0; higher is kept longer)
        for the prompt's chunks in every tier that orders its own evictions (L1, disk):
        eviction takes lower priorities first, the least recently used first within one.
        Returns how many of the chunks L1 holds; chunks stored later start at 0."""
        self._check_open()
        return self.control.set_priority(tokens, priority, salt=salt, lora=lora,
                                         namespace=namespace)

    def delete(self, tokens: Tokens, *, salt: str | None = None, lora: str | None = None,
               namespace: str | None = None) -> int:
        """Remove the prompt's chunks from every tier (L1, disk, Redis, an ``lmc://``
        daemon, Mooncake...) and write-behind queue, and the pins on them; KV events
        publish the removals. Returns the copies removed, summed over the tiers."""
        self._check_open()
        return self.control.delete(tokens, salt=salt, lora=lora, namespace=namespace)

    def clear(self, namespace: str | None = None) -> dict[str, int | None]:
        """Remove everything of this engine's namespace from every tier: L1 and the disk
        tier (this engine's own), a shared store's values under ``remote_key_prefix``
        (Redis, Mooncake), an ``lmc://`` daemon's namespace; and every pin :meth:`pin`
        took. Returns per tier the values removed (``None``: the tier could not count);
        a tier that cannot clear is left out, with one warning."""
        self._check_open()
        return self.control.clear(namespace)

    def _pin_owner(self, tokens: Tokens, keys: Sequence[Key], request_id: Hashable
                   ) -> Hashable:
        """Whose pins: the request named, else the prompt -- its chunk keys (each chained
        over the whole prefix, so the last names them all) and the tokens past them."""
        if request_id is not None:
            return ("request", request_id)
        n = self.db.num_tokens(tokens)
        covered = min(len(keys) * self.config.chunk_size, n)
        return ("prompt", n, keys[-1] if keys else None, tokens_to_bytes(tokens[covered:n]))

    def _release_pins(self, tokens: Tokens, request_id: Hashable) -> None:
        """A retrieve's end of its owner's pins: every chunk, the masked ones the engine
        already has included, and only this owner's (another request's pins on a shared
        prefix stay). Called once the retrieve holds its own references on the chunks it
        loads, so they stay safe from eviction."""
        if self._pins.count:
            keys = self.db.keys(tokens) if request_id is None else []
            self._pins.release(self._pin_owner(tokens, keys, request_id))

    # ------------------------------------------------------------- retrieve
    def _fetch(self, tokens: Tokens, mask: Any, keys: Keys = None, layered: bool = False,
               watch: LoadWatch | None = None
               ) -> tuple[list[Chunk], list[MemoryObj], list[int], LayerGate,
                          Sequence[tuple[int, int]]]:
        """The longest stored prefix (after the mask's False prefix), its objects, the
        index of the tier each came from, what is still arriving layer by layer
        (``layered``, :mod:`lmc.storage.layered_read`; else every object is complete) and the
        chunks' token ranges (for ``tr.plan``)."""
        chunks = self.db.process_tokens(tokens, mask, keys)
        gate = READY
        objs: list[MemoryObj]
        where: list[int]
        if not chunks:
            objs, where = [], []
        else:
            if watch is not None:
                watch.positions = [s for s, _, _ in chunks]
            if layered:
                objs, where, gate = self.storage.fetch_prefix_layered(
                    [k for _, _, k in chunks], watch)
            else:
                objs, where = self.storage.fetch_prefix([k for _, _, k in chunks], watch)
        if objs and not self._shapes_ok(chunks, objs):
            want: dict[int, tuple[int, ...]] = {}  # chunk_shape per length: a few calls each
            for i, (o, (s, e, _)) in enumerate(zip(objs, chunks)):
                shape = want.get(e - s)
                if shape is None:
                    shape = want[e - s] = self.spec.chunk_shape(e - s)
                if o.shape != shape or o.dtype != self.spec.dtype:
                    log.error("chunk %d holds %s %s, expected %s %s: deleted, treated as a "
                              "miss", i, o.shape, o.dtype, self.spec.chunk_shape(e - s),
                              self.spec.dtype)
                    self.storage.delete([chunks[i][2]])  # never served again, re-stored
                    for bad in objs[i:]:
                        bad.release()
                    objs = objs[:i]
                    break
        chunks = chunks[: len(objs)]
        # a prefix of the prompt's chunks as process_tokens cut them
        return (chunks, objs, where[: len(objs)], gate.prefix(len(objs)),
                self._ranges(chunks, True))

    def _shapes_ok(self, chunks: list[Chunk], objs: list[MemoryObj]) -> bool:
        """Whether every object has its chunk's shape and the cache's dtype, checked with
        no loop per chunk: every chunk but the last of ``process_tokens`` is full."""
        n = len(objs)
        s, e, _ = chunks[n - 1]
        shapes = [o.shape for o in objs]
        return ([o.dtype for o in objs].count(self.spec.dtype) == n
                and shapes[n - 1] == self.spec.chunk_shape(e - s)
                and shapes[: n - 1].count(self.spec.chunk_shape(self.db.chunk_size)) == n - 1)

    def retrieve(self, tokens: Tokens, kv_caches: KVCaches, slot_mapping: Any,
                 mask: Any = None, *, request_id: Hashable = None, keys: Keys = None,
                 end: int | None = None) -> int:
        """Write the stored KV of the longest hit prefix into ``kv_caches`` at
        ``slot_mapping``; returns the number of tokens written. Tokens under the mask's False
        prefix are neither looked up nor written (the engine has them); negative slots are
        skipped. Releases every pin its owner's ``lookup(pin=True)`` took (``request_id``,
        else these exact tokens), masked chunks included.

        A hybrid model's: ``slot_mapping`` per KV group (or one they share) and ``end``,
        where the load ends (default: every token; each group needs what a continuation
        there needs); returns the positions written, from the first unmasked chunk to the
        largest end every group can serve (0 if none)."""
        self._check_open()
        if self.hybrid is not None:
            rt = self.retrieve_layer(tokens, kv_caches, slot_mapping, mask,
                                     request_id=request_id, keys=keys, end=end)
            for layer in range(self.spec.num_layers):
                rt.load(layer)
            return rt.close()
        t0 = time.perf_counter()
        tr = self.transfer_for(kv_caches)
        slots = tr.check_slots(slot_mapping, self.db.num_tokens(tokens))
        chunks, objs, _, _, ranges = self._fetch(tokens, mask, keys)
        self._release_pins(tokens, request_id)
        if not chunks:
            return 0
        with CopyLease(objs) as lease:  # the scatter owns objs until its handle is done
            arrays = PoolArrays(objs) if tr.device.type == "cpu" else None
            plan = tr.plan(slots, ranges)
            lease.attach(tr.scatter(plan, LazyTensors(objs), arrays=arrays)).wait()
        n = self._num_tokens(chunks, ranges)
        # every object was checked to be spec.chunk_shape(its tokens): bytes linear in tokens
        self.metrics.transfer("retrieve", n, self.spec.chunk_nbytes(n),
                              time.perf_counter() - t0)
        return n

    def retrieve_layer(self, tokens: Tokens, kv_caches: KVCaches, slot_mapping: Any,
                       mask: Any = None, *, request_id: Hashable = None, keys: Keys = None,
                       watch: LoadWatch | None = None, end: int | None = None
                       ) -> LayerwiseRetrieve:
        """Layer-wise retrieve: ``.num_tokens`` says how many will load; ``.start()`` loads all
        layers in order on a background thread and ``.wait(layer)`` blocks until that layer is
        in the cache (``.wait(layer, stream)``: the CUDA stream waits, not the host; or
        ``.load(layer)`` synchronously). Pass host slot mappings: planning then never waits
        for the device. See :class:`LayerwiseRetrieve`. ``watch``: lower-tier reads of whole
        chunks stop by its rule (:mod:`lmc.storage.load_watch`): then fewer chunks load, a
        prefix, and ``watch.stopped_at`` says so; reads layer by layer may be cut by it
        while the retrieve runs (:mod:`lmc.storage.layered_watch`): ``close()`` then
        reports the prefix that loaded. A hybrid model's: see :meth:`retrieve`
        (a :class:`~lmc.hybrid.layerwise.GroupedRetrieve`; ``watch`` is not applied)."""
        self._check_open()
        if self.hybrid is not None:
            gtr = self.grouped_for(kv_caches)
            gslots = gtr.check_slots(slot_mapping, self.db.num_tokens(tokens))
            works, served, first = self.hybrid.fetch(tokens, mask, keys, end, layered=True)
            self._release_pins(tokens, request_id)
            return cast(LayerwiseRetrieve, self.hybrid.retrieve_layer(works, gtr, gslots,
                                                                      served, first))
        tr = self.transfer_for(kv_caches)
        slots = tr.check_slots(slot_mapping, self.db.num_tokens(tokens))
        chunks, objs, where, gate, ranges = self._fetch(tokens, mask, keys, layered=True,
                                                        watch=watch)
        self._release_pins(tokens, request_id)
        plan = tr.plan(slots, ranges) if chunks else None
        names = self.tier_names
        return LayerwiseRetrieve(self, tr, plan, chunks, objs, [names[i] for i in where], gate,
                                 replan=lambda n: tr.plan(slots, ranges[:n]))

    # ------------------------------------------------------------- prefetch
    def prefetch(self, tokens: Tokens, start: int = 0, *, root: bytes | None = None
                 ) -> Future:
        """Pull the prompt's chunks from the one holding position ``start`` on from lower
        tiers into L1 in the background (a hit in a lower tier is promoted on read). Returns
        a future of the prefix tokens then in L1 (counted from that chunk's start; the
        chunks before it are assumed there). ``root``: where the prompt's key chain starts
        (a tagged request's, :func:`lmc.token_database.request_root`; the namespace when
        None), so a tagged request pulls its own chain's chunks and never another's.

        ``cancel()`` on the future stops the pull before its next chunk (the request it was
        for was admitted with its decision: the link is for other loads now); it is read
        ``PREFETCH_PIECE`` chunks at a time for that."""
        self._check_open()
        if start < 0:
            raise ValueError(f"prefetch start must be >= 0, got {start}")
        cs = self.config.chunk_size
        first = start // cs
        all_keys = self.db.keys(tokens, root=root)
        keys = all_keys[first:]
        n = self.db.num_tokens(tokens)
        out: Future = Future()

        def run() -> None:
            try:
                if self.hybrid is not None:  # every group's parts; the end then servable
                    got_end = self.hybrid.prefetch(all_keys, first, n, out.cancelled)
                    with contextlib.suppress(InvalidStateError):
                        out.set_result(got_end)
                    return
                got = 0
                for i in range(0, len(keys), PREFETCH_PIECE):
                    if out.cancelled():
                        return
                    piece = keys[i:i + PREFETCH_PIECE]
                    objs = self.storage.get_prefix(piece)
                    Lease(objs).release()
                    got += len(objs)
                    if len(objs) < len(piece):
                        break
                with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                    out.set_result(min((first + got) * cs, n))
            except BaseException as e:
                with contextlib.suppress(InvalidStateError):
                    out.set_exception(e)
            finally:
                with self._lock:
                    self._prefetch_queued -= 1

        with self._lock:
            self.prefetches += 1
            if self._prefetch_queued >= MAX_QUEUED_PREFETCHES:  # bounded: refused, not queued
                out.set_result(min(first * cs, n))
                return out
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="lmc-prefetch")
            self._prefetch_queued += 1
            try:
                self._prefetcher.submit(run)
            except RuntimeError:  # shut down meanwhile
                self._prefetch_queued -= 1
                raise
            return out

    def prefetches_pending(self) -> int:
        """Prefetches queued or running (benchmarks wait for none before timing a load)."""
        with self._lock:
            return self._prefetch_queued

    # ----------------------------------------------------------------- misc
    def contains_chunks(self, tokens: Tokens) -> np.ndarray:
        """Per chunk, whether L1 has it (diagnostics and tests; a hybrid model's: every KV
        group's part of it)."""
        keys = self.db.keys(tokens)
        if self.hybrid is None:
            return np.array(self.storage.l1_contains(keys), dtype=bool)
        held = [self.storage.l1_contains(p) for p in self.hybrid.parts(keys)]
        return np.array([all(h) for h in zip(*held)], dtype=bool)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.metrics.snapshot())
        for tier in self.storage.tiers:
            for k, v in tier.stats().items():
                out[f"{tier.name}.{k}"] = v
        out.update(self.storage.stats())
        out.update(self._pins.stats())
        out.update(self.control.stats())
        if self.funnel is not None:
            out.update(self.funnel.stats())
        out["prefetches"] = self.prefetches
        out.update(self.speeds.stats())
        if self.events is not None:
            out.update(self.events.stats())
        for tr in self._transfers.transfers():  # CUDA: the copy path per call shape
            paths = getattr(tr, "path_stats", None)
            if paths is not None:
                for k, v in paths().items():
                    out[k] = out.get(k, 0) + v if isinstance(v, int) else v
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every chunk stored so far has reached the lower tiers (or was dropped);
        False if ``timeout`` seconds passed first. ``store`` never waits for this itself."""
        self._check_open()
        return self.storage.flush(timeout)

    def wait_reads(self, timeout: float | None = None) -> bool:
        """Wait until the pieces a stopped load abandoned in flight have landed: the speed
        they measured is in :attr:`speeds` and their chunks are in L1 (a load returns
        without waiting for them); False if ``timeout`` seconds passed first."""
        self._check_open()
        return self.storage.wait_reads(timeout)

    def close(self) -> None:
        """Finish background work, drain the write-behind queues (bounded), close the tiers."""
        if self._closed:
            return
        self._closed = True
        if self._prefetcher is not None:  # queued prefetches are dropped, a running one ends
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        if self.events is not None:  # its last events, before the tiers close
            self.events.close()
        self._pins.clear()
        self.control.pins.clear()
        self._transfers.clear()  # a closed engine keeps no cache alive
        self.storage.close()
        self.pool.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
