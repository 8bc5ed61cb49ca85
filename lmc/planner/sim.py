"""Replay a keyed trace through one tier configuration, request by request, with no KV bytes.

Each request goes through the calls the engine's connector makes (``lmc/connectors/core/scheduler.py``,
``lmc/connectors/core/worker.py``), in their order:

1. **lookup**: the longest prefix present in any tier (each tier asked once; nothing is
   refreshed), clamped so the engine computes the last token, rounded down to ``align``;
2. **load**: the chunks covering that prefix are fetched (L1 hits refreshed, lower-tier hits
   read into L1 memory and promoted) and *held* until the step ends;
3. **save**: the chunks from the one holding the load's end to the end of the prompt are
   stored (present ones refreshed and skipped, new ones allocated, evicting) and reach the
   lower tiers by the write policy; then the load's chunks are released.

With ``step_tokens`` (chunked prefill) steps 2 and 3 repeat per step: a step saves the
chunks it completed, the load is released after the first, the queues drain after each.

Requests run one at a time (an engine with ``max_num_seqs=1``):
the planner predicts the cache's answer to the traffic, not the scheduler's interleaving.
With concurrent requests a chunk can be evicted between a lookup and its load, or held
against eviction a little longer; docs/planner.md states how far that moves the figures.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from lmc.config import CacheConfig
from lmc.planner.keys import KeyedTrace
from lmc.planner.tiers import SimCache, SimTier, chain_tiers
from lmc.settings import parse_size

TIERS = ("L1", "disk", "remote")


@dataclass(frozen=True, order=True)
class GridPoint:
    """One configuration: tier sizes in bytes (0 = no such tier) and the write policy; or,
    with ``chain``, L1 and those lower tiers in that order (:func:`chain_point`)."""

    l1: int
    disk: int = 0
    remote: int = 0
    policy: str = "write_through"
    chain: tuple[SimTier, ...] = ()


def chain_point(config: CacheConfig, sizes: Mapping[str, int | str] | None = None, *,
                l1: int | str | None = None, policy: str | None = None) -> GridPoint:
    """The configuration ``config`` runs: its L1 (``local_cpu_size``, or ``l1``), its
    ``tiers:`` chain as built for the engine (:func:`lmc.planner.tiers.chain_tiers`; remote
    stores' sizes from ``sizes``) and its ``write_policy`` (or ``policy``)."""
    return GridPoint(parse_size(config.local_cpu_size if l1 is None else l1, "l1"),
                     policy=config.write_policy if policy is None else policy,
                     chain=tuple(chain_tiers(config, sizes)))


@dataclass
class SimResult:
    point: GridPoint
    requests: int
    prompt_tokens: int
    hit_tokens: dict[str, int]  # loaded positions by source tier (the worker's tokens_from_*)
    per_request: dict[str, array]  # the same per request, for TTFT
    tier_stats: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def hit_rate(self, tier: str | None = None) -> float:
        """Loaded prompt tokens over all prompt tokens (one tier's, or all tiers')."""
        n = self.hit_tokens.get(tier, 0) if tier else sum(self.hit_tokens.values())
        return n / self.prompt_tokens if self.prompt_tokens else 0.0


def simulate(trace: KeyedTrace, point: GridPoint, *, bytes_per_token: int, align: int = 1,
             eviction_policy: str = "lru", queue_bytes: int = 1 << 30,
             step_tokens: int = 0) -> SimResult:
    """Replay ``trace`` through ``point``'s tiers (see the module doc). The write-behind
    queues drain at the end of each request: a writer slower than one allocation.
    ``step_tokens`` (chunked prefill, 0: none): a prompt is computed at most that many
    tokens a step and saved a step at a time, the queues draining after each step, as the
    engine's writer threads catch up while the next step computes."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if step_tokens < 0:
        raise ValueError(f"step_tokens must be >= 0, got {step_tokens}")
    t0 = time.perf_counter()
    cache = SimCache(point.l1, point.disk, point.remote, point.policy,
                     bytes_per_token=bytes_per_token, eviction_policy=eviction_policy,
                     queue_bytes=queue_bytes, chain=point.chain or None)
    levels = cache.levels
    cs = trace.chunk_size
    per = [array("l", bytes(8 * len(trace))) for _ in levels]
    totals = [0] * len(levels)
    key_ids, offsets, ntok = trace.key_ids, trace.offsets, trace.num_tokens
    full = [cs] * 64
    prefix_sources, fetch, store, drain = (cache.prefix_sources, cache.fetch_prefix, cache.store,
                                           cache.drain)
    for i in range(len(trace)):
        keys = key_ids[offsets[i]: offsets[i + 1]].tolist()
        n = ntok[i]
        nk = len(keys)
        if nk > len(full):
            full = [cs] * nk
        sizes = full[:nk]
        if nk and nk * cs > n:
            sizes[-1] = n - (nk - 1) * cs
        hit = min(len(prefix_sources(keys)) * cs, n)
        usable = min(hit, n - 1)
        usable -= usable % align
        held: Sequence = ()
        end = 0
        if usable > 0:
            m = -(-usable // cs)
            held, where = fetch(keys[:m], sizes[:m])
            end = min(len(held) * cs, usable)
            for j, lvl in enumerate(where):
                got = min((j + 1) * cs, end) - j * cs
                if got > 0:
                    per[lvl][i] += got
                    totals[lvl] += got
        # the prompt's steps (one without step_tokens): each saves the chunks it completed
        # (the scheduler's plan_save; the partial tail with the last step), the load's
        # chunks are held through the first step only, the queues drain after each step
        # (the writer catches up while the next step computes)
        computed = end
        while True:
            top = n if step_tokens <= 0 else min(n, computed + step_tokens)
            stop = n if top == n else top - top % cs
            a, b = computed // cs, -(-stop // cs)
            if b > a:
                store(keys[a:b], sizes[a:b])
            for o in held:
                o.release()
            held = ()
            drain()
            computed = top
            if computed >= n:
                break
    return SimResult(point, len(trace), trace.prompt_tokens,
                     {lvl: totals[j] for j, lvl in enumerate(levels)},
                     {lvl: per[j] for j, lvl in enumerate(levels)},
                     cache.tier_stats(), time.perf_counter() - t0)


# ---------------------------------------------------------------------- the grid
_SHARED: tuple[KeyedTrace, dict] | None = None  # what forked workers read (copy-on-write)


def _run_one(point: GridPoint) -> SimResult:
    assert _SHARED is not None
    trace, kw = _SHARED
    return simulate(trace, point, **kw)


def grid(l1: Iterable[int], disk: Iterable[int] = (0,), remote: Iterable[int] = (0,),
         policies: Iterable[str] = ("write_through",)) -> list[GridPoint]:
    """Every combination; the policy matters only with a lower tier, so L1-only points are
    not repeated per policy."""
    out: set[GridPoint] = set()
    pols = list(policies)
    for a in l1:
        for d in disk:
            for r in remote:
                for p in (pols if (d or r) else pols[:1]):
                    out.add(GridPoint(a, d, r, p))
    return sorted(out, key=lambda g: (g.policy, g.disk, g.remote, g.l1))


def run_grid(trace: KeyedTrace, points: Sequence[GridPoint], *, bytes_per_token: int,
             align: int = 1, eviction_policy: str = "lru", jobs: int | None = None,
             step_tokens: int = 0) -> list[SimResult]:
    """:func:`simulate` for each point; ``jobs`` > 1 forks workers that share the keyed
    trace copy-on-write (the keys are computed once, before the fork)."""
    global _SHARED
    kw = {"bytes_per_token": bytes_per_token, "align": align,
          "eviction_policy": eviction_policy, "step_tokens": step_tokens}
    jobs = min(len(points), jobs if jobs else (os.cpu_count() or 1))
    if jobs <= 1 or len(points) <= 1:
        return [simulate(trace, p, **kw) for p in points]  # type: ignore[arg-type]
    import multiprocessing as mp

    _SHARED = (trace, kw)
    try:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as ex:
            return list(ex.map(_run_one, points))
    finally:
        _SHARED = None
