"""The engine-agnostic connector core: what every engine adapter (reference, vLLM, SGLang)
shares.

It is split the way vLLM splits its connector, because vLLM runs the two halves in
different processes:

* :class:`SchedulerConnector` (scheduler process) answers "how many prompt tokens can lmc
  supply?" with one lookup per request, remembers what each admitted request must load,
  and once per step turns the engine's schedule into a :class:`ConnectorMetadata`.
  It holds no tensors and no ``CacheEngine``: it reaches the cache only through a
  ``lookup(token_ids)`` callable answering a :class:`~lmc.storage.lookup.LookupResult` (or a
  plain token count), which an adapter may back by the cross-process lookup service
  (:mod:`lmc.connectors.core.lookup_service`). Each request's result is kept with the request, so the
  tiers its admitted load comes from (:meth:`SchedulerConnector.load_sources`) need no
  second lookup.
* :class:`~lmc.connectors.core.worker.WorkerConnector` (worker process) owns the
  ``CacheEngine`` and the engine's KV tensors and executes the metadata: layer-wise loads
  overlapped with compute, layer-wise saves committed at the end of the step, and load
  failures reported as block ids.

The metadata (``lmc.connectors.core.metadata``) is the only thing that crosses between them.

Two decisions shape every adapter:

* **Full-prompt hits** leave the last token to the engine. The answer is clamped to
  ``num_tokens - 1`` and the last chunk is still loaded whole from the store, with the slot
  of every position from the clamp on set to -1, so those positions are never written
  (lmc skips negative slots). The engine then computes exactly one token. Where an engine
  needs block-aligned answers (``align``), the answer is rounded down the same way.
* **Saves are planned statelessly** from each step's schedule: a step saves the chunks that
  *become complete* in it, i.e. whose end lies in ``(num_computed_tokens, end of step]``,
  using the store mask for the already-saved prefix. Chunked prefill therefore saves each
  chunk once, when complete, and a request rolled back after a failed load saves its
  recomputed chunks again without any bookkeeping. The partial last chunk of a prompt is
  saved in the step that finishes the prompt's prefill (when ``save_unfull_chunk``).
* **Lookups do not pin.** A chunk evicted between the lookup and the load (the request waited
  for blocks, another process stored a lot) makes the load come up short: the worker reports
  the blocks from the first missing position, and the engine recomputes them. That keeps the
  lookup a pure function of the cache (no per-request state to leak on the worker, which is
  what a cross-process lookup needs) at the cost of a rare recompute.
* **Load or recompute.** With a :class:`~lmc.connectors.core.load_policy.LoadPolicy`, the
  answer is the part of the hit worth loading at the measured speeds (the rest is
  recomputed by the engine; :mod:`lmc.connectors.core.load_policy`). The decision is taken
  once per admission, with the lookup, and only ever lowers the answer: never a hit lmc
  cannot serve. Chunks the engine recomputes although a tier holds them are not saved
  again (their saves start past the request's lookup hit).
* **Hashing once per request.** A request is looked up once per admission (the answer is
  cached while the engine re-asks), and the worker keeps each request's chunk keys across
  steps (:class:`~lmc.token_database.RequestKeys`), so chunked prefill and decode saves
  hash only the chunks each step completes.
* **Tagged requests.** A request whose KV depends on more than its tokens in a way lmc can
  name (a LoRA adapter, a ``cache_salt``) carries a key tag
  (:func:`lmc.token_database.request_tag`) through its lookup, its load and save specs:
  every key of it chains from the tag's root, apart from every other tag's and the plain
  chain; its prefetch too (the tag goes to ``prefetch``, each rank pulls its own root's
  chain). Adapters that cannot carry one leave such requests to the engine.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmc.config import CacheConfig
from lmc.connectors.core.hints import CacheHints
from lmc.connectors.core.load_policy import LoadPolicy
from lmc.connectors.core.metadata import (
    ConnectorMetadata,
    LoadSpec,
    SaveSpec,
    ScheduledView,
    StepRequest,
)
from lmc.connectors.core.worker import WorkerConnector
from lmc.metrics import FUNNEL_MISSES, FUNNEL_TOKENS
from lmc.storage.lookup import LookupResult

log = logging.getLogger(__name__)

# token ids -> what the cache holds (a count where the backend cannot attribute tiers);
# None: not known yet (a backend answering asynchronously)
LookupFn = Callable[[Sequence[int]], "LookupResult | int | None"]
# (token ids, key tag) -> the same, for a tagged request (LoRA, cache_salt: its keys chain
# from a root of its own, lmc.token_database.request_tag)
TaggedLookupFn = Callable[[Sequence[int], bytes], "LookupResult | int | None"]
# (tokens, first position, key tag or None) -> a future of the prefetch (``done()``,
# ``cancel()``), or None; a tagged request's (the tag) pulls its own chain, never the plain one
PrefetchFn = Callable[[Sequence[int], int, "bytes | None"], Any]

__all__ = [
    "ConnectorConfig",
    "ConnectorMetadata",
    "LoadSpec",
    "LookupFn",
    "LookupResult",
    "SaveSpec",
    "SchedulerConnector",
    "StepRequest",
    "TaggedLookupFn",
    "WorkerConnector",
]


@dataclass(frozen=True)
class ConnectorConfig:
    """Connector behaviour (the cache itself is configured by ``CacheConfig``).

    Attributes:
        chunk_size: tokens per stored chunk; must equal the cache's ``chunk_size``.
        save_unfull_chunk: save the prompt's partial last chunk when its prefill ends.
        load: look up and load (vLLM ``kv_role`` consumer/both).
        save: save new chunks (vLLM ``kv_role`` producer/both).
        save_decode: also save chunks completed by generated tokens (off: prompts only,
            which is what later requests can share).
        align: round the answer down to a multiple of this many tokens (an engine that
            needs block-aligned external tokens passes its block size).
        layerwise: overlap each layer's load with the previous layer's compute; False loads
            every layer before the forward starts (simpler, and a baseline for benchmarks).
        async_loads: every load is asynchronous (loaded in the background before the
            request is scheduled; a failure fails the request's whole load, never blocks):
            for an engine that cannot take a synchronous load's failed blocks (vLLM with
            several KV cache groups refuses block-level errors).
    """

    chunk_size: int
    save_unfull_chunk: bool = True
    load: bool = True
    save: bool = True
    save_decode: bool = False
    align: int = 1
    layerwise: bool = True
    async_loads: bool = False

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.align < 1:
            raise ValueError(f"align must be >= 1, got {self.align}")

    @classmethod
    def from_cache_config(cls, config: CacheConfig, **overrides: Any) -> ConnectorConfig:
        return cls(chunk_size=config.chunk_size, save_unfull_chunk=config.save_unfull_chunk,
                   **overrides)


@dataclass
class _PendingLoad:
    token_ids: tuple[int, ...]
    start: int
    end: int
    mask_start: int
    sources: dict[str, int]  # positions of [start, end) by tier, L1 first ({}: unknown)
    key_tag: bytes | None = None  # the request's key tag (LoRA, cache_salt), None: plain


@dataclass
class SchedulerStats:
    """Cumulative counters of the scheduler half (``extra``: room for an adapter's own)."""

    lookups: int = 0
    lookup_errors: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0  # what the cache holds, before clamping/alignment
    loads: int = 0
    load_tokens: int = 0  # what was actually scheduled for loading
    saves: int = 0
    save_tokens: int = 0  # tokens of chunks planned for saving (present ones are skipped later)
    prefetches: int = 0  # recomputed-by-choice chunks pulled into L1 while a request waited
    redecisions: int = 0  # decisions made again once such a prefetch landed
    # the hit-rate funnel's later stages (lmc.storage.funnel.funnel_view), at admission:
    admitted: int = 0
    admitted_prompt_tokens: int = 0
    engine_local_tokens: int = 0  # the engine's own prefix cache had them
    used_tokens: int = 0  # the engine did not compute them: its own hits plus lmc's load
    recomputed_by_choice_tokens: int = 0  # lmc had them; the load policy chose to recompute
    extra: dict[str, float] = field(default_factory=dict)


def _group_ids(req: ScheduledView | StepRequest) -> tuple[tuple[int, ...], ...]:
    """A scheduled request's block table per KV group (a hybrid model's), if it has them."""
    return tuple(tuple(g) for g in getattr(req, "group_block_ids", ()) or ())


class SchedulerConnector:
    """Scheduler-side half: lookups, admitted loads, per-step metadata. Engine-neutral:
    adapters pass request ids, token ids and counts, never engine objects."""

    def __init__(self, config: ConnectorConfig, lookup: LookupFn,
                 policy: LoadPolicy | None = None, prefetch: PrefetchFn | None = None,
                 max_redecisions: int = 2, tagged_lookup: TaggedLookupFn | None = None
                 ) -> None:
        """``tagged_lookup(tokens, tag)``: the lookup of a tagged request (a LoRA adapter, a
        ``cache_salt``: :func:`lmc.token_database.request_tag`); without it such a request
        is a miss (never the plain chain's hit). ``prefetch(tokens, start, key_tag)``: pull
        the prompt's chunks from position ``start`` on into L1 in the background, in the
        chain of the request's ``key_tag`` (``None``: the plain chain), answering something
        with ``done()`` (a future), or ``None`` where it cannot; given, the chunks a policy
        recomputes by choice are prefetched while the request waits, and its decision is
        made again (at most ``max_redecisions`` times) once they are in."""
        self.config = config
        self._lookup = lookup
        self._tagged_lookup = tagged_lookup
        self.policy = policy
        self._prefetch = prefetch
        self.max_redecisions = max_redecisions
        # request id -> (prefetch future, the decision's inputs); -> re-decisions so far
        self._prefetching: dict[str, tuple[Any, tuple[LookupResult, int, int, int, int]]] = {}
        self._redone: dict[str, int] = {}
        self._hits: dict[str, LookupResult] = {}  # request id -> its lookup, until admitted
        self._ends: dict[str, int] = {}  # request id -> its decided load end, until admitted
        self._held: dict[str, int] = {}  # request id -> hit end, where the policy cut it
        self._pending: dict[str, _PendingLoad] = {}  # admitted, load not yet in a step
        self._finished: list[str] = []  # for the worker's forget, until a step carries work
        self._remote: set[str] = set()  # matched as asynchronous loads, not yet admitted
        self._hints: dict[str, CacheHints] = {}  # request id -> its cache hints, till it ends
        self._chosen: dict[str, int] = {}  # request id -> tokens its decision recomputes
        self.namespace = "default"  # the funnel's label (an adapter sets its engine's)
        self._async_ready: list[LoadSpec] = []  # admitted asynchronous loads, for the next step
        self._step = 0
        self.stats = SchedulerStats()

    def set_hints(self, request_id: str, hints: CacheHints | None) -> None:
        """The request's cache hints (:mod:`lmc.connectors.core.hints`): they travel with
        each of its saves to the worker, which pins and prioritises its chain."""
        if hints:
            self._hints[request_id] = hints

    # ------------------------------------------------------------------ lookups
    def get_num_new_matched_tokens(self, request_id: str, token_ids: Sequence[int],
                                   num_computed_tokens: int, key_tag: bytes | None = None
                                   ) -> int | None:
        """Tokens past ``num_computed_tokens`` that lmc can supply, clamped so the last
        token is computed by the engine and rounded down to ``align``. The lookup runs once
        per admission and is cached until ``update_state_after_alloc`` (an engine may ask
        again while the request waits for blocks). ``None`` means "not known yet" (a
        lookup backend that answers asynchronously). With a load policy the answer ends
        where loading stops paying (decided once, with the lookup). ``key_tag``: the
        request's (LoRA, ``cache_salt``), looked up and prefetched in its own chain."""
        if not self.config.load:
            return 0
        self._redecide_if_prefetched(request_id)
        found = self._hits.get(request_id)
        if found is None:
            found = self._do_lookup(token_ids, key_tag)
            if found is None:
                return None
            self._hits[request_id] = found
        n = len(token_ids)
        usable = min(found.tokens, n - 1)
        usable -= usable % self.config.align
        if found.hybrid:  # a hybrid model's hit ends only where every KV group is served
            usable = found.servable_end(usable)
        if self.policy is not None:
            end = self._ends.get(request_id)
            if end is None:
                start = min(num_computed_tokens, n)
                end = self.policy.decide(request_id, found, start, max(usable, start), n,
                                         self.config.align)
                end = self._ends[request_id] = min(end, usable)  # never more than the hit
                self._chosen[request_id] = usable - end
                if end < usable:  # recomputed by choice: already stored, not saved again
                    self._held[request_id] = found.tokens
                    self._start_prefetch(request_id, token_ids, found,
                                         (found, start, end, max(usable, start), n), key_tag)
            usable = end
        return max(0, usable - num_computed_tokens)

    def _start_prefetch(self, request_id: str, token_ids: Sequence[int], found: LookupResult,
                        decision: tuple[LookupResult, int, int, int, int],
                        key_tag: bytes | None = None) -> None:
        """Pull what the policy recomputes by choice into L1 while the request waits (once
        per decision; at most ``max_redecisions`` decisions are remade), from the chain of
        the request's ``key_tag`` (the one its lookup found the hit in)."""
        if self._prefetch is None:
            return
        if self._redone.get(request_id, 0) >= self.max_redecisions:
            return
        end = decision[2]
        try:
            fut = self._prefetch(list(token_ids[: found.tokens]), end, key_tag)
        except Exception as e:  # a prefetch never fails a request
            log.warning("lmc prefetch for request %s failed (%s: %s)", request_id,
                        type(e).__name__, e)
            return
        if fut is not None:
            self.stats.prefetches += 1
            self._prefetching[request_id] = (fut, decision)

    def _cancel_prefetch(self, request_id: str) -> None:
        """The request no longer waits: the rest of its prefetch would only take the tier's
        bandwidth from other loads (what it already pulled stays in L1)."""
        entry = self._prefetching.pop(request_id, None)
        if entry is not None:
            with contextlib.suppress(Exception):
                entry[0].cancel()

    def _redecide_if_prefetched(self, request_id: str) -> None:
        """A waiting request whose prefetch has landed is looked up and decided afresh: the
        chunks it would have recomputed may now be in L1."""
        entry = self._prefetching.get(request_id)
        if entry is None or not entry[0].done():
            return
        del self._prefetching[request_id]
        self._redone[request_id] = self._redone.get(request_id, 0) + 1
        decision = entry[1]
        self._hits.pop(request_id, None)
        self._ends.pop(request_id, None)
        self._held.pop(request_id, None)
        if self.policy is not None:
            self.policy.retract(*decision)
        self.stats.redecisions += 1

    def match_remote(self, request_id: str, token_ids: Sequence[int],
                     num_computed_tokens: int, remote_tokens: int) -> int:
        """A prefill/decode consumer's answer for a request another instance prefilled:
        its first ``remote_tokens`` positions will be pulled *asynchronously* (the worker
        waits for them in the background, the engine schedules the request once they are
        in). Clamped like a lookup (the last token is computed here, ``align``); no lookup
        is made, since the producer may still be publishing its chunks: the worker's load
        waits for them and reports what never came as load errors (recomputed)."""
        if not self.config.load:
            return 0
        usable = min(max(0, remote_tokens), len(token_ids) - 1)
        usable -= usable % self.config.align
        n = max(0, usable - num_computed_tokens)
        if n:
            self._remote.add(request_id)
        else:
            self._remote.discard(request_id)
        return n

    def _do_lookup(self, token_ids: Sequence[int], key_tag: bytes | None = None
                   ) -> LookupResult | None:
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(token_ids)
        cs = self.config.chunk_size
        tagged = self._tagged_lookup
        if key_tag is not None and tagged is None:
            return LookupResult.miss(cs)  # the adapter cannot look a tagged chain up
        try:
            found = self._lookup(token_ids) if key_tag is None or tagged is None else \
                tagged(token_ids, key_tag)
        except Exception as e:  # a failing cache is a miss, never an engine error
            self.stats.lookup_errors += 1
            log.warning("lmc lookup failed (%s: %s): treated as a miss", type(e).__name__, e)
            return LookupResult.miss(cs)
        if found is None:
            return None
        if not isinstance(found, LookupResult):
            found = LookupResult(max(0, int(found)), cs)
        elif found.tokens and found.chunk_size != cs:
            self.stats.lookup_errors += 1
            log.warning("lmc lookup answered in chunks of %d, the connector uses %d: treated "
                        "as a miss", found.chunk_size, cs)
            return LookupResult.miss(cs)
        found = found.clipped(len(token_ids))
        self.stats.hit_tokens += found.tokens
        return found

    def update_state_after_alloc(self, request_id: str, token_ids: Sequence[int],
                                 num_computed_tokens: int, num_external_tokens: int,
                                 block_ids: Sequence[int] | None = None,
                                 key_tag: bytes | None = None,
                                 group_block_ids: Sequence[Sequence[int]] = ()) -> None:
        """The engine admitted the request and will have lmc load ``num_external_tokens``
        positions from ``num_computed_tokens`` on (the engine's clamped answer).
        ``block_ids``: the request's blocks, needed now for an asynchronous load (it is
        not scheduled until the load is in, so no step would carry its blocks).
        ``key_tag``: the request's, as it was looked up (the load's keys chain from it).
        ``group_block_ids``: a hybrid model's blocks per KV group, for an asynchronous load."""
        found = self._hits.pop(request_id, None)
        self._ends.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._count_admission(request_id, len(token_ids), num_computed_tokens,
                              num_external_tokens)
        self._cancel_prefetch(request_id)  # admitted: its decision stands
        self._redone.pop(request_id, None)
        remote = request_id in self._remote or self.config.async_loads
        self._remote.discard(request_id)
        if num_external_tokens <= 0 or not self.config.load:
            return
        if remote:
            if block_ids is None:
                raise ValueError(f"request {request_id}: an asynchronous load needs the "
                                 "request's block ids at admission")
            cs = self.config.chunk_size
            start, end = num_computed_tokens, num_computed_tokens + num_external_tokens
            stop = min(-(-end // cs) * cs, len(token_ids))
            self.stats.loads += 1
            self.stats.load_tokens += end - start
            self._async_ready.append(LoadSpec(request_id, tuple(token_ids[:stop]),
                                              tuple(block_ids), start, end, start - start % cs,
                                              key_tag,
                                              tuple(tuple(g) for g in group_block_ids)))
            return
        cs = self.config.chunk_size
        start, end = num_computed_tokens, num_computed_tokens + num_external_tokens
        if end > len(token_ids):
            raise ValueError(f"request {request_id}: load of [{start}, {end}) runs past its "
                             f"{len(token_ids)} tokens")
        stop = min(-(-end // cs) * cs, len(token_ids))  # end of the chunk holding end - 1
        sources = found.tokens_by_tier(start, end) if found is not None else {}
        if sum(sources.values()) != end - start:  # not attributed, or not what was looked up
            sources = {}
        self._pending[request_id] = _PendingLoad(tuple(token_ids[:stop]), start, end,
                                                 start - start % cs, sources, key_tag)

    def _count_admission(self, request_id: str, n: int, local: int, external: int) -> None:
        """The funnel's view of an admission: what the engine will not compute (its own
        prefix hits and lmc's load) and what the load policy chose to recompute."""
        st = self.stats
        st.admitted += 1
        st.admitted_prompt_tokens += n
        st.engine_local_tokens += local
        st.used_tokens += local + max(0, external)
        chosen = self._chosen.pop(request_id, 0)
        st.recomputed_by_choice_tokens += chosen
        ns = self.namespace
        if local:
            FUNNEL_TOKENS.labels(ns, "local").inc(local)
        if local + external > 0:
            FUNNEL_TOKENS.labels(ns, "used").inc(local + max(0, external))
        if chosen:
            FUNNEL_MISSES.labels(ns, "recomputed_by_choice").inc(chosen)

    def load_sources(self, request_id: str) -> dict[str, int]:
        """The admitted load's positions by the tier holding them (L1 first), from the
        request's own lookup; ``{}`` if there is no pending load or its lookup did not
        attribute tiers. Valid from ``update_state_after_alloc`` until the load is in a
        step's metadata."""
        pending = self._pending.get(request_id)
        return dict(pending.sources) if pending is not None else {}

    # ------------------------------------------------------------------ metadata
    def build_metadata(self, scheduled: Iterable[ScheduledView | StepRequest],
                       finished_ids: Iterable[str] = (),
                       preempted_ids: Iterable[str] = ()) -> ConnectorMetadata:
        """This step's loads (admitted requests with a hit) and saves (chunks completed)."""
        finished_ids = list(finished_ids)
        for rid in (*finished_ids, *preempted_ids):
            self._forget(rid)
        self._finished += finished_ids
        self._step += 1
        meta = ConnectorMetadata(step_id=self._step, forget=list(self._finished),
                                 async_loads=self._async_ready)
        self._async_ready = []  # never dropped: the engine waits for each one's completion
        for req in scheduled:
            # the step's compute, for the worker's prefill-speed estimate
            a = req.num_computed_tokens
            b = a + req.num_scheduled_tokens
            meta.compute_tokens += b - a
            meta.compute_attention += float(b * b - a * a)
            pending = self._pending.pop(req.request_id, None)
            if pending is not None:
                meta.loads.append(self._load_spec(req, pending))
            save = self.plan_save(req)
            if save is not None:
                meta.saves.append(save)
        if not meta.is_empty:  # adapters bind every step with work: delivered
            self._finished = []
        return meta

    def _load_spec(self, req: ScheduledView | StepRequest, p: _PendingLoad) -> LoadSpec:
        if req.num_computed_tokens != p.end:
            log.warning("request %s: scheduled from position %d but its load ends at %d",
                        req.request_id, req.num_computed_tokens, p.end)
        self.stats.loads += 1
        self.stats.load_tokens += p.end - p.start
        return LoadSpec(req.request_id, p.token_ids, tuple(req.block_ids), p.start, p.end,
                        p.mask_start, p.key_tag, _group_ids(req))

    def plan_save(self, req: ScheduledView | StepRequest) -> SaveSpec | None:
        """The chunks that become complete in this step, or None."""
        cfg = self.config
        if not cfg.save:
            return None
        cs = cfg.chunk_size
        computed = req.num_computed_tokens
        end = computed + req.num_scheduled_tokens
        prompt = req.num_prompt_tokens
        limit = len(req.token_ids) if cfg.save_decode else prompt
        top = min(end, limit)
        if top <= computed:
            return None
        stop = top - top % cs
        if cfg.save_unfull_chunk and stop < top == prompt:
            stop = prompt  # the prompt's prefill ends in this step: its partial chunk too
        start = computed - computed % cs
        held = self._held.get(req.request_id)
        if held is not None:  # recomputed by choice: a tier has these chunks already
            if top <= held:
                return None
            start = max(start, held - held % cs)
        if stop <= start:
            return None
        self.stats.saves += 1
        self.stats.save_tokens += stop - start
        return SaveSpec(req.request_id, tuple(req.token_ids[:stop]), tuple(req.block_ids),
                        start, getattr(req, "key_tag", None), _group_ids(req),
                        max(prompt, stop), self._hints.get(req.request_id))

    # ------------------------------------------------------------------ lifecycle
    def request_finished(self, request_id: str) -> None:
        """Finished or aborted: forget it. Saves are committed within their step, so the
        engine may free the request's blocks at once."""
        self._forget(request_id)

    def request_preempted(self, request_id: str) -> None:
        """Its blocks are gone; on resumption it is looked up afresh and may be reloaded."""
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._cancel_prefetch(request_id)
        self._redone.pop(request_id, None)
        self._hits.pop(request_id, None)
        self._ends.pop(request_id, None)
        self._held.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._remote.discard(request_id)
        self._hints.pop(request_id, None)
        self._chosen.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        """Requests this side holds any state for (each counted once, whatever it holds): 0
        once every request has finished or been forgotten, else a leak."""
        held: set[str] = set()
        for d in (self._hits, self._ends, self._held, self._pending, self._prefetching,
                  self._redone, self._hints, self._chosen):
            held.update(d)
        return len(held | self._remote)

    def policy_stats(self) -> dict[str, float]:
        """The load policy's counters (``policy.*``), empty without a policy."""
        return self.policy.stats() if self.policy is not None else {}
