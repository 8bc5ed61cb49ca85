"""Worker-side half of the connector core: executes a step's :class:`ConnectorMetadata`
against the engine's KV tensors through a ``CacheEngine``.

One step, in the order the engine calls it::

    bind(meta)            # the step's plan (vLLM: bind_connector_metadata)
    start_load()          # fetch hit chunks, queue layer loads on lmc's I/O thread
    for each layer i:
        wait_for_layer(i)     # before layer i writes or reads its cache
        ... the engine computes layer i ...
        save_layer(i)         # layer i's new K/V are in the cache: gather them (async)
    wait_for_save()       # commit the step's saves; the blocks may be reused after this
    take_load_errors()    # blocks whose load failed: the engine recomputes them

Loads are queued one task per layer, each task loading that layer for every request of the
step, so layer i of all requests is in place before anything waits on layer i+1: the copy
of layer i+1 overlaps the compute of layer i. Saves go on the same I/O thread after the
loads, so they never delay a load the model waits for.

Stream ordering (CUDA): copies run on lmc's copy stream. ``wait_for_layer(i)`` makes the
engine's current stream wait for layer i's load event (the host waits only until the copy is
enqueued); ``save_layer(i)`` records a point on the engine's current stream and the gather
starts after it, so it never reads KV the forward has not written. ``wait_for_save`` blocks
the host until every copy of the step has completed, so the step's blocks are free to reuse
after it. Slot mappings are built on the host from the block ids and stay there: planning a
copy never waits for the device.

A failed load (a chunk evicted between lookup and load, a tier error, a layer's copy raising)
never raises into the engine: the request's blocks from the first bad position on are
reported, its saves of this step are dropped (its compute read bad input), and the engine
recomputes. Nothing of a failed request's step is ever stored.

Chunk keys are kept per request (:class:`~lmc.token_database.RequestKeys`): a request is
loaded and saved over many steps (chunked prefill saves a chunk or more per step), and each
step hashes only the chunks its new tokens completed, not the whole prefix again. Keys are
dropped when the metadata reports the request finished (``ConnectorMetadata.forget``, before
any work of the step, so a reused request id starts afresh), and at most
``max_tracked_requests`` are kept (least recently used go first). A tagged request's keys
(its spec's ``key_tag``: LoRA, ``cache_salt``) chain from this rank's root for the tag
(:func:`lmc.token_database.request_root`), in the step's loads and saves and in the
asynchronous loads alike.
Loaded tokens are counted by the tier they came from as the load fetches them, so the
statistics cost no second hash and no second question to any tier.

Speeds (:mod:`lmc.storage.speeds`): the worker times each step's forward (``bind`` to
``wait_for_save``; on a GPU with events on the engine's stream, read a step later so the
host never waits) and, for steps that loaded nothing, records it with the step's computed
tokens as an observation of the engine's prefill speed; on the CPU, a step whose loads all
came from L1 also gives the copy's speed (the I/O thread's time for its bytes). The load
policy decides from these.

Asynchronous loads (``meta.async_loads``, a prefill/decode consumer's) run on a thread of
their own, outside any step: each waits (up to ``remote_wait`` seconds, polled with its
own backoff, so one never published does not delay the others) until every chunk it needs
is findable (the producer publishes its chunks while the consumer is told about
the request), loads all layers into the request's blocks (the engine does not touch them
until the load is reported), then is reported by :meth:`WorkerConnector.get_finished`.
What never came, or failed, is reported as load errors *before* the request is reported
finished (vLLM wants the blocks no later than the finished id), so the engine recomputes
exactly those positions.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lmc.cache_engine import CacheEngine
from lmc.connectors.core.metadata import ConnectorMetadata, LoadSpec, SaveSpec
from lmc.layerwise import LayerwiseRetrieve, LayerwiseStore, LoadError
from lmc.storage.load_watch import LoadWatch
from lmc.storage.speeds import PrefillRate
from lmc.token_database import ChunkKey, RequestKeys, request_root
from lmc.transfer.completion import current_stream
from lmc.transfer.kv_groups import STATE
from lmc.transfer.kv_spec import KVCaches

log = logging.getLogger(__name__)
_STOP = object()  # ends the asynchronous loads' thread


@dataclass
class WorkerStats:
    """Cumulative counters; ``load_seconds`` is I/O-thread time spent copying, and
    ``load_wait_seconds`` the part of it the model actually waited for."""

    steps: int = 0
    loads: int = 0
    load_tokens: int = 0  # positions the scheduler asked to load
    loaded_tokens: int = 0  # positions fully loaded (all layers)
    load_failures: int = 0
    loads_stopped: int = 0  # loads that stopped themselves: finishing cost more than compute
    stopped_tokens: int = 0  # positions those loads left to the engine to recompute
    load_seconds: float = 0.0
    load_wait_seconds: float = 0.0
    saves: int = 0
    saved_tokens: int = 0  # new tokens stored (chunks already present are not counted)
    saves_dropped: int = 0  # saves of requests whose load failed in the same step
    save_failures: int = 0
    async_loads: int = 0  # asynchronous (prefill/decode) loads finished, failed ones too
    async_load_failures: int = 0  # of those, the ones that left positions to recompute
    async_wait_seconds: float = 0.0  # time they waited for the chunks to be published
    async_load_seconds: float = 0.0  # then fetching and copying them (all layers)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)  # positions, by source tier
    steps_timed: int = 0  # forwards recorded as prefill-speed observations
    kept_warm: int = 0  # saves whose cache hints pinned or prioritised their chain

    @property
    def recomputed_after_failure(self) -> int:
        """Positions the scheduler planned to load that the engine recomputed (a load
        failed or came up short: a miss after the decision), those of loads that stopped
        themselves apart (``stopped_tokens``)."""
        return max(0, self.load_tokens - self.loaded_tokens - self.stopped_tokens)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "tokens_by_tier"}
        out["recomputed_after_failure"] = self.recomputed_after_failure
        out.update({f"tokens_from_{t}": n for t, n in self.tokens_by_tier.items()})
        return out


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    retrieve: LayerwiseRetrieve | None
    failed: bool = False
    watch: LoadWatch | None = None
    covered: int = 0  # the end of what the load was set to cover when it started


class _StepClock:
    """Times each step's forward without making the host wait: on the CPU the host's clock
    (the forward runs on it); on a GPU two events on the engine's stream, whose elapsed
    time is read once both have completed (a later step), at most ``keep`` pending.

    A step that loads also waits for its loads: on the CPU the host's waits are subtracted
    (``minus``); on a GPU each wait is bracketed by two events on the engine's stream
    (:meth:`stall`), whose distance is exactly how long the stream stood still for it --
    the work queued before the wait, then the load's copy or the host's late arrival -- and
    the sum is subtracted when the step is read. So steps that load are observations of
    the compute too, on either device: without them a GPU saw only cold prefills, which
    also save (an H100 measured lmc's compute at half the engine's)."""

    def __init__(self, device: torch.device, keep: int = 8, event: Any = None,
                 stream: Any = None, capturing: Any = None) -> None:
        """``event``, ``stream``, ``capturing``: the timing-event factory, the engine's
        stream and the graph-capture check (torch's by default; injectable for tests of
        the arithmetic)."""
        self.cuda = device.type == "cuda"
        self.device = device
        self.keep = keep
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._stream = stream or (lambda: current_stream(device))
        self._capturing = capturing or torch.cuda.is_current_stream_capturing
        self._t0: Any = None
        self._stalls: list[tuple[Any, Any]] = []
        self._pending: list[tuple[Any, Any, tuple[int, float, int], list[tuple[Any, Any]]]] = []

    def _record(self) -> Any:
        ev = self._event()
        ev.record(self._stream())
        return ev

    def start(self) -> None:
        self._stalls = []
        if self.cuda:
            if self._capturing():  # a graph capture: not a step
                self._t0 = None
                return
            self._t0 = self._record()
        else:
            self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        """Bracket a wait of the engine's stream (GPU; nothing on the CPU, whose host waits
        the caller subtracts itself)."""
        if self.cuda and self._t0 is not None and self._capturing():
            self._t0 = None  # nothing of a capture is timed
        if not self.cuda or self._t0 is None:
            yield
            return
        try:
            a = self._record()
        except Exception:  # timing never fails a step
            yield
            return
        try:
            yield
        finally:
            try:
                self._stalls.append((a, self._record()))
            except Exception:
                self._t0 = None  # the step's stalls are incomplete: not an observation

    def stop(self, work: tuple[int, float, int] | None, minus: float = 0.0
             ) -> list[tuple[int, float, int, float]]:
        """End the step begun by :meth:`start` (``work``: its tokens, attention and tokens
        saved, or ``None`` not to record it; ``minus``: host seconds of the step that were not
        its compute, CPU only); answers the steps whose time is now known."""
        t0, self._t0 = self._t0, None
        stalls, self._stalls = self._stalls, []
        done: list[tuple[int, float, int, float]] = []
        if t0 is not None and work is not None:
            if self.cuda:
                if self._capturing():
                    return done
                self._pending.append((t0, self._record(), work, stalls))
                del self._pending[: -self.keep]
            else:
                done.append((*work, time.perf_counter() - t0 - minus))
        while self._pending and self._pending[0][1].query():
            a, b, w, st = self._pending.pop(0)
            waited = sum(x.elapsed_time(y) for x, y in st)
            done.append((*w, max(0.0, a.elapsed_time(b) - waited) / 1e3))
        return done


def slot_mapping(block_ids: tuple[int, ...] | list[int], block_size: int, num_tokens: int,
                 lo: int, hi: int) -> np.ndarray:
    """Slots of positions ``[0, num_tokens)``: real ones for ``[lo, hi)``, -1 elsewhere
    (lmc neither reads nor writes a negative slot)."""
    slots = np.full(num_tokens, -1, dtype=np.int64)
    if hi > lo:
        table = np.asarray(block_ids, dtype=np.int64)
        if len(table) * block_size < hi:
            raise ValueError(f"positions up to {hi} need {-(-hi // block_size)} blocks, "
                             f"the request has {len(table)}")
        pos = np.arange(lo, hi, dtype=np.int64)
        slots[lo:hi] = table[pos // block_size] * block_size + pos % block_size
    return slots


def prefix_mask(num_tokens: int, start: int) -> np.ndarray | None:
    """lmc's store/retrieve mask: False for the chunk-aligned prefix the call must skip."""
    if start <= 0:
        return None
    mask = np.ones(num_tokens, dtype=bool)
    mask[:start] = False
    return mask


class WorkerConnector:
    """Executes loads and saves for one engine worker (one tensor-parallel rank)."""

    def __init__(self, engine: CacheEngine, kv_caches: KVCaches, block_size: int,
                 layerwise: bool = True, max_tracked_requests: int = 1024,
                 remote_wait: float = 30.0) -> None:
        if max_tracked_requests < 1:
            raise ValueError(f"max_tracked_requests must be >= 1, got {max_tracked_requests}")
        if not remote_wait > 0:
            raise ValueError(f"remote_wait must be > 0 seconds, got {remote_wait}")
        self.remote_wait = remote_wait
        self._async_inbox: queue.Queue = queue.Queue()
        self._async_thread: threading.Thread | None = None
        self._async_done: dict[str, set[int]] = {}  # finished, not yet reported -> bad blocks
        self._async_active: set[str] = set()  # queued or running
        self._async_cancel: set[str] = set()  # finished by the engine while loading: stop
        self._async_failed: set[str] = set()  # finished with positions left to recompute
        self._closing = threading.Event()
        self.engine = engine
        self.watch_loads = engine.config.load_policy == "auto"
        """Whether a lower tier's load stops itself once recomputing would be faster
        (:meth:`_watch`); off under ``load_policy: load_all``, and where a caller forces
        the split itself (a benchmark's "load all" and sweep rows)."""
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.layerwise = layerwise
        self.num_layers = engine.spec.num_layers
        self.groups = len(engine.spec.groups)  # a hybrid model's KV groups (0: plain)
        if any(g.kind == STATE for g in engine.spec.groups):
            raise ValueError("state-space KV groups: no engine adapter passes lmc the "
                             "states of its linear-attention/SSM layers yet (lmc.hybrid "
                             "stores them given state rows; connectors do not)")
        self.chunk_size = engine.config.chunk_size
        self.device = engine.transfer_for(kv_caches).device  # validates the tensors once
        self.stats = WorkerStats()
        self._lock = threading.Lock()
        self._meta: ConnectorMetadata | None = None
        self._loads: list[_ActiveLoad] = []
        self._layer_futures: list[Future] = []
        self._stores: list[tuple[SaveSpec, LayerwiseStore]] | None = None
        self._failed: dict[str, int] = {}  # request id -> first position not validly loaded
        self._error_blocks: set[int] = set()
        self._keys: OrderedDict[str, RequestKeys] = OrderedDict()  # request id -> its keys
        self.max_tracked_requests = max_tracked_requests
        self._clock = _StepClock(self.device)
        self._step_load_seconds = 0.0  # I/O-thread time of this step's loads
        self._step_waits = (0.0, 0.0)  # load waits at bind, seconds in start_load

    # ------------------------------------------------------------------ helpers
    def _slots(self, block_ids: tuple[int, ...], num_tokens: int, lo: int, hi: int
               ) -> torch.Tensor:
        # host slots on purpose: lmc plans from them without a device sync
        return torch.from_numpy(slot_mapping(block_ids, self.block_size, num_tokens, lo, hi))

    def _spec_slots(self, spec: LoadSpec | SaveSpec, num_tokens: int, lo: int, hi: int
                    ) -> Any:
        """A load's or save's slot mapping: one tensor, or a hybrid model's one per KV group
        from its block table (a negative block id: a block the group does not hold, whose
        positions are neither read nor written)."""
        if not self.groups:
            return self._slots(spec.block_ids, num_tokens, lo, hi)
        tables = spec.group_block_ids or (spec.block_ids,) * self.groups
        if len(tables) != self.groups:
            raise ValueError(f"{len(tables)} block tables for {self.groups} KV groups")
        return [self._slots(t, num_tokens, lo, hi) for t in tables]

    def _end(self, spec: LoadSpec) -> int | None:
        """A hybrid model's load says where it ends (each group needs what a continuation
        there needs); a plain one loads whole chunks, its tail slots unmapped."""
        return spec.end if self.groups else None

    def _fail(self, spec: LoadSpec, position: int, why: str) -> None:
        """Mark positions ``[position, spec.end)`` of a load as not loaded."""
        bs = self.block_size
        position = max(position, spec.start)
        blocks = spec.block_ids[position // bs: -(-spec.end // bs)]
        with self._lock:
            first = self._failed.get(spec.request_id)
            if first is None:
                self.stats.load_failures += 1
            self._failed[spec.request_id] = position if first is None else min(first, position)
            self._error_blocks.update(blocks)
        log.warning("lmc load for request %s failed from position %d (%s): %d block(s) will "
                    "be recomputed", spec.request_id, position, why, len(blocks))

    def _watch(self, total: int) -> LoadWatch | None:
        """The stop rule of a load of a ``total``-token prompt (:mod:`lmc.storage.load_watch`):
        recomputing from a position costs the engine's compute from there to the end (the
        step already running computes past the hit either way, then is discarded for the
        request, so that step cancels out); ``None`` under ``load_policy: load_all`` (or with
        :attr:`watch_loads` off). While
        nothing says how fast the engine computes, recomputing costs "infinitely much": the
        load goes on."""
        if not self.watch_loads:  # load_all: every load finishes
            return None
        speeds = getattr(self.engine, "speeds", None)
        if speeds is None:
            return None
        est: list[PrefillRate | None] = []

        def recompute_s(pos: int) -> float:
            # asked only once a lower tier's whole chunks are read (an L1 hit never fits
            # the estimate), then kept for the load; unknown: never worth stopping for
            if not est:
                est.append(speeds.prefill.estimate())
            rate = est[0]
            return math.inf if rate is None else rate.seconds(pos, total)

        return LoadWatch(recompute_s)

    def _stopped(self, spec: LoadSpec, position: int, watch: LoadWatch) -> None:
        """A load that stopped itself at ``position`` (chunk-aligned): the positions from
        there are recomputed like a failed load's, told at INFO (it is lmc's choice)."""
        bs = self.block_size
        blocks = spec.block_ids[position // bs: -(-spec.end // bs)]
        with self._lock:
            self.stats.loads_stopped += 1
            self.stats.stopped_tokens += spec.end - position
            first = self._failed.get(spec.request_id)
            self._failed[spec.request_id] = position if first is None else min(first, position)
            self._error_blocks.update(blocks)
        log.info("lmc load of request %s stopped at position %d of %d (%s): %d block(s) "
                 "recomputed", spec.request_id, position, spec.end, watch.reason, len(blocks))

    def _root(self, key_tag: bytes | None) -> bytes:
        """This rank's key root for a request's tag (the namespace for a plain request)."""
        return request_root(self.engine.db.namespace, key_tag)

    def _request_keys(self, request_id: str, token_ids: tuple[int, ...],
                      key_tag: bytes | None = None) -> list[ChunkKey]:
        """The chunk keys of ``token_ids`` (a prefix of the request's sequence) from the
        request's root (``key_tag``), hashing only what this request has not hashed before."""
        root = self._root(key_tag)
        rk = self._keys.get(request_id)
        if rk is None or rk.root != root:  # new, or an id reused with another tag
            rk = self._keys[request_id] = self.engine.db.request_keys(root)
            while len(self._keys) > self.max_tracked_requests:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(request_id)
        return rk.keys(token_ids)

    def forget(self, request_ids: Iterable[str]) -> None:
        """The requests ended: drop their kept keys (``bind`` does it for the metadata's
        ``forget``; an id must never name another token sequence while it is kept)."""
        for rid in request_ids:
            self._keys.pop(rid, None)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._keys)

    def _count_tiers(self, spec: LoadSpec, rt: LayerwiseRetrieve) -> None:
        """Positions of ``[start, end)`` this load fetched, by source tier (stats only)."""
        counts = rt.tokens_by_tier(spec.start, spec.end)
        with self._lock:
            for name, n in counts.items():
                self.stats.tokens_by_tier[name] = self.stats.tokens_by_tier.get(name, 0) + n

    # --------------------------------------------------------------------- step
    def bind(self, meta: ConnectorMetadata) -> None:
        """Take the step's plan. A step left unfinished (no ``wait_for_save``) is closed
        first, dropping its saves."""
        if self._meta is not None:
            self._finish(commit=False)
        self.forget(meta.forget)
        self._meta = meta
        self.stats.steps += 1
        self._step_load_seconds = 0.0
        self._step_waits = (self.stats.load_wait_seconds, 0.0)  # (waited at bind, start_load)
        self._clock.start()
        for spec in meta.async_loads:
            if self._async_thread is None:
                self._async_thread = threading.Thread(target=self._async_loop,
                                                      name="lmc-async-load", daemon=True)
                self._async_thread.start()
            with self._lock:
                self._async_active.add(spec.request_id)
            self._async_inbox.put(spec)

    def start_load(self) -> None:
        """Fetch every load's chunks (held until the step ends, so nothing stored later in
        the step can evict them) and queue the per-layer copies."""
        meta = self._meta
        if meta is None or not meta.loads or self._loads:
            return
        t_start = time.perf_counter()
        try:
            with self._clock.stall():  # the fetch (and a load that is not layer-wise)
                self._start_loads(meta)
        finally:
            self._step_waits = (self._step_waits[0], time.perf_counter() - t_start)

    def _start_loads(self, meta: ConnectorMetadata) -> None:
        for spec in meta.loads:
            self.stats.loads += 1
            self.stats.load_tokens += spec.num_tokens
            n = len(spec.token_ids)
            watch = self._watch(n)
            try:
                rt = self.engine.retrieve_layer(
                    spec.token_ids, self.kv_caches,
                    self._spec_slots(spec, n, spec.start, spec.end),
                    prefix_mask(n, spec.mask_start),
                    keys=self._request_keys(spec.request_id, spec.token_ids, spec.key_tag),
                    watch=watch, end=self._end(spec))
            except Exception as e:
                log.exception("lmc: preparing the load of request %s failed", spec.request_id)
                self._fail(spec, spec.start, f"{type(e).__name__}: {e}")
                self._loads.append(_ActiveLoad(spec, None, failed=True))
                continue
            covered = spec.mask_start + rt.num_tokens
            if watch is not None and watch.stopped_at is not None and covered < spec.end:
                self._stopped(spec, covered, watch)
            elif covered < spec.end:  # a chunk was evicted or lost since the lookup
                self._fail(spec, covered, "chunks missing from every tier")
            self._loads.append(_ActiveLoad(spec, rt, watch=watch, covered=covered))
        if self.layerwise:
            ex = self.engine.executor()
            self._layer_futures = [ex.submit(self._load_layer, i) for i in range(self.num_layers)]
        else:  # everything in place before the forward starts
            for i in range(self.num_layers):
                self._load_layer(i)
                self._wait_loads(i, None)

    def _load_layer(self, layer: int) -> None:
        """Issue ``layer``'s load for every request (I/O thread); nothing waits for it here."""
        t0 = time.perf_counter()
        for a in self._loads:
            if a.failed or a.retrieve is None:
                continue
            try:
                a.retrieve.issue(layer)
            except LoadError as e:
                a.failed = True
                self._fail(a.spec, a.spec.start, str(e))
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.load_seconds += dt
            self._step_load_seconds += dt

    def _wait_loads(self, layer: int, stream: object) -> None:
        """Order ``stream`` (the host when None) after every request's load of ``layer``."""
        for a in self._loads:
            if a.failed or a.retrieve is None:
                continue
            try:
                a.retrieve.wait(layer, stream)
            except LoadError as e:
                a.failed = True
                self._fail(a.spec, a.spec.start, str(e))

    def wait_for_layer(self, layer: int) -> None:
        """``layer``'s loads are in the cache before the engine's current stream reads it
        (the host blocks on the CPU, where it is the stream). Never raises for a failed load:
        that request's blocks are reported by :meth:`take_load_errors` instead."""
        if not self._layer_futures:
            return
        t0 = time.perf_counter()
        with self._clock.stall():
            try:
                self._layer_futures[layer].result()
            except Exception as e:  # _load_layer catches LoadError; anything else fails all
                log.exception("lmc: layer %d load task failed", layer)
                for a in self._loads:
                    if not a.failed:
                        a.failed = True
                        self._fail(a.spec, a.spec.start, f"{type(e).__name__}: {e}")
            self._wait_loads(layer, current_stream(self.device))
        self.stats.load_wait_seconds += time.perf_counter() - t0

    def save_layer(self, layer: int) -> None:
        """``layer``'s K/V for this step are in the cache: queue their gather."""
        if self._stores is None:
            self._stores = self._plan_stores()
        if not self._stores:
            return
        after = self._stores[0][1].tr.record_event()  # the forward has written this layer
        for spec, st in self._stores:
            try:
                st.save(layer, after=after)
            except Exception:
                log.exception("lmc: saving layer %d of request %s failed", layer,
                              spec.request_id)

    def _plan_stores(self) -> list[tuple[SaveSpec, LayerwiseStore]]:
        """Allocate the step's store buffers, after the loads hold their chunks."""
        out: list[tuple[SaveSpec, LayerwiseStore]] = []
        meta = self._meta
        if meta is None:
            return out
        for spec in meta.saves:
            n = len(spec.token_ids)
            try:
                st = self.engine.store_layer(
                    spec.token_ids, self.kv_caches, self._spec_slots(spec, n, spec.start, n),
                    prefix_mask(n, spec.start),
                    keys=self._request_keys(spec.request_id, spec.token_ids, spec.key_tag),
                    horizon=spec.horizon or None)
            except Exception:
                log.exception("lmc: planning the save of request %s failed", spec.request_id)
                self.stats.save_failures += 1
                continue
            out.append((spec, st))
        return out

    def wait_for_save(self) -> None:
        """End of the step: loads finished, saves committed (or dropped for requests whose
        load failed). After this the engine may reuse every block of the step."""
        self._observe_step()
        self._finish(commit=True)

    def _observe_step(self) -> None:
        """The forward just ended (its work is queued, on a GPU): record its time, less
        its waits for loads, as a prefill observation; on the CPU, a step whose loads all
        came from L1 records the copy's speed."""
        meta = self._meta
        speeds = getattr(self.engine, "speeds", None)
        if meta is None or speeds is None:
            return
        # a step that loaded: its compute is its time less the waits for loads and the
        # fetches before the forward (the host's on the CPU, the stream's on a GPU)
        cpu = self.device.type == "cpu"
        saved = sum(st.num_tokens for _, st in self._stores or ())  # saved beside it
        work = None if meta.compute_tokens <= 0 else \
            (meta.compute_tokens, meta.compute_attention, saved)
        minus = 0.0
        if meta.loads and cpu:
            waited0, fetch = self._step_waits
            minus = self.stats.load_wait_seconds - waited0 + fetch
        for tokens, attention, saved_tokens, seconds in self._clock.stop(work, minus):
            speeds.prefill.observe(tokens, attention, seconds, saved=saved_tokens)
            self.stats.steps_timed += 1
        if self.device.type != "cpu" or not self._loads or not speeds.tiers:
            return
        l1 = speeds.tiers[0].name
        rts = [a.retrieve for a in self._loads if a.retrieve is not None and not a.failed]
        nbytes = sum(rt.nbytes for rt in rts)
        if nbytes and all(set(rt.tiers) <= {l1} for rt in rts):
            for f in self._layer_futures:  # the copies are done when the step's are
                with contextlib.suppress(Exception):
                    f.result()
            speeds.tiers[0].observe(nbytes, self._step_load_seconds)

    def _finish(self, commit: bool) -> None:
        for f in self._layer_futures:
            # failures were reported by wait_for_layer (or the layer was never waited on)
            with contextlib.suppress(Exception):
                f.result()
        for a in self._loads:
            if a.retrieve is None:
                continue
            loaded = a.retrieve.close()
            self._count_tiers(a.spec, a.retrieve)
            end = a.spec.mask_start + a.retrieve.num_tokens
            if a.watch is not None and end < min(a.covered, a.spec.end) and not a.failed:
                # a read cut layer by layer while the load ran: the rest is recomputed (the
                # engine asks for the load errors after this step's wait_for_save)
                self._stopped(a.spec, end, a.watch)
            if not a.failed and loaded:
                self.stats.loaded_tokens += min(a.spec.end, a.spec.mask_start + loaded) \
                    - a.spec.start
        for spec, st in self._stores or ():
            if not commit or spec.request_id in self._failed:
                st.abort()
                self.stats.saves_dropped += 1
                continue
            try:
                self.stats.saved_tokens += st.commit()
                self.stats.saves += 1
            except Exception:
                log.exception("lmc: committing the save of request %s failed", spec.request_id)
                self.stats.save_failures += 1
                continue
            if spec.hints:
                self._keep_warm(spec)
        self._meta = None
        self._loads = []
        self._layer_futures = []
        self._stores = None
        self._failed = {}

    def _keep_warm(self, spec: SaveSpec) -> None:
        """A saved request's cache hints (:mod:`lmc.connectors.core.hints`): its chain so
        far (its full chunks) pinned for the TTL (owned by its session, else by the
        request) and given its priority. Never fails the step: a refusal is counted by the
        engine."""
        h = spec.hints
        assert h is not None
        try:
            keys = self._request_keys(spec.request_id, spec.token_ids, spec.key_tag)
            # full chunks only: a prompt's partial last chunk is not the next turn's (that
            # turn's chunk there is longer, another key), so holding it would waste room
            keys = keys[:len(spec.token_ids) // self.engine.config.chunk_size]
            owner = ("session", h.session) if h.session is not None else \
                ("request", spec.request_id)
            self.engine.control.keep_warm(keys, h.ttl, h.priority, owner)
            self.stats.kept_warm += 1
        except Exception as e:  # noqa: BLE001 - a hint, never the step's failure
            log.warning("lmc: applying request %s's cache hints failed: %s", spec.request_id,
                        e)

    # ------------------------------------------------------- asynchronous loads
    def _async_loop(self) -> None:
        """The asynchronous loads' thread: every pending load is checked in turn (each
        with its own backoff), so one whose producer never publishes does not hold up
        the others; a load runs as soon as all its chunks are findable, or with what is
        there once its ``remote_wait`` has passed."""
        pending: list[list] = []  # [spec, keys, started, next check, pause]
        while True:
            now = time.monotonic()
            wake = min((p[3] for p in pending), default=now + 3600.0)
            try:
                spec = self._async_inbox.get(timeout=max(0.0, wake - now) if pending
                                             else None)
            except queue.Empty:
                spec = None
            if spec is _STOP:
                for p in pending:
                    self._load_async(p[0], p[1], p[2], cancelled=True)
                return
            if spec is not None:
                try:
                    keys = self.engine.db.keys(  # (kept keys are the step's)
                        spec.token_ids, root=self._root(spec.key_tag))
                except Exception:
                    log.exception("lmc: hashing request %s failed", spec.request_id)
                    keys = None
                pending.append([spec, keys, time.monotonic(), 0.0, 0.002])
            now = time.monotonic()
            for p in list(pending):
                spec, keys, started, check, pause = p
                if check > now:
                    continue
                cancelled = self._closing.is_set() or spec.request_id in self._async_cancel
                try:
                    ready = cancelled or keys is None or \
                        self.engine.lookup(spec.token_ids, keys=keys) >= spec.end
                except Exception:
                    log.exception("lmc: lookup for request %s failed", spec.request_id)
                    ready = True  # the load then finds what it can
                if ready or now - started >= self.remote_wait:
                    pending.remove(p)
                    self._load_async(spec, keys, started, cancelled)
                else:
                    p[3], p[4] = now + pause, min(pause * 2, 0.05)

    def _load_async(self, spec: LoadSpec, keys: list | None, started: float,
                    cancelled: bool) -> None:
        """Load all layers of what is findable now, record the outcome. Never raises:
        whatever goes wrong is positions to recompute."""
        bad_from = spec.end
        waited = time.monotonic() - started
        try:
            if cancelled or keys is None:
                bad_from = spec.start
            else:
                n = len(spec.token_ids)
                rt = self.engine.retrieve_layer(
                    spec.token_ids, self.kv_caches,
                    self._spec_slots(spec, n, spec.start, spec.end),
                    prefix_mask(n, spec.mask_start), keys=keys, end=self._end(spec))
                try:
                    for layer in range(self.num_layers):
                        rt.load(layer)
                finally:
                    loaded = rt.close()
                bad_from = min(spec.end, spec.mask_start + loaded)
                self._count_tiers(spec, rt)
            with self._lock:
                self.stats.async_wait_seconds += waited
                self.stats.async_load_seconds += time.monotonic() - started - waited
        except Exception as e:
            log.exception("lmc: asynchronous load of request %s failed", spec.request_id)
            bad_from = spec.start
            why = f"{type(e).__name__}: {e}"
        else:
            why = ("stopped" if cancelled else "chunks not published in time") \
                if bad_from < spec.end else ""
        bs = self.block_size
        bad = set(spec.block_ids[max(bad_from, spec.start) // bs: -(-spec.end // bs)]) \
            if bad_from < spec.end else set()
        if bad and not cancelled:
            log.warning("lmc asynchronous load of request %s: positions from %d not loaded "
                        "(%s): %d block(s) will be recomputed", spec.request_id, bad_from,
                        why, len(bad))
        with self._lock:
            self.stats.async_loads += 1
            self.stats.load_tokens += spec.num_tokens
            self.stats.loaded_tokens += max(0, min(bad_from, spec.end) - spec.start)
            if bad:
                self.stats.async_load_failures += 1
                self._async_failed.add(spec.request_id)
            self._async_done[spec.request_id] = bad
            self._async_active.discard(spec.request_id)

    def get_finished(self, finished_ids: Iterable[str] = ()) -> set[str]:
        """Requests whose asynchronous load ended since the last call (their failed
        blocks move to :meth:`take_load_errors` in the same call, so a caller that asks
        for errors after this sees them). ``finished_ids``: requests the engine finished
        or aborted; a load still waiting for them stops."""
        with self._lock:
            self._async_cancel.update(i for i in finished_ids if i in self._async_active)
            done, self._async_done = self._async_done, {}
            for bad in done.values():
                self._error_blocks.update(bad)
            self._async_cancel.difference_update(done)
        return set(done)

    @property
    def num_async_loads(self) -> int:
        """Asynchronous loads queued or running (not yet finished)."""
        return len(self._async_active)

    def take_failed_loads(self) -> set[str]:
        """Requests whose asynchronous load finished short since the last call (then
        forgotten): for an engine that recomputes a failed load's request whole rather
        than its blocks (vLLM with several KV cache groups)."""
        with self._lock:
            out, self._async_failed = self._async_failed, set()
        return out

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (then forgotten)."""
        with self._lock:
            out, self._error_blocks = self._error_blocks, set()
        return out

    def close(self) -> None:
        self._closing.set()  # waiting asynchronous loads give up at once
        if self._async_thread is not None:
            self._async_inbox.put(_STOP)
            self._async_thread.join()
            self._async_thread = None
        if self._meta is not None:
            self._finish(commit=False)
