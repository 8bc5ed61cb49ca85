"""Load or recompute: how many of a request's hit tokens to load, from measured speeds.

A hit is not always worth loading. On a GPU a disk hit of a long prompt took 2.5x the time
of recomputing it (issue 23). A layer-wise load of the prefix ``[p, N)`` overlaps the
computation of ``[N, S)`` layer by layer, so with ``L`` layers

    TTFT(N) = serial(N) + max(O(N), C(N)) + min(O(N), C(N)) / L

``O(N)``: the loads that run under the compute (L1's copy into the engine's KV for every
loaded token, plus the reads of tiers that fill chunks layer by layer); ``serial(N)``: reads
of tiers that return whole chunks, which finish before the forward starts; ``C(N)``: the
compute of ``[N, S)``; ``min(...) / L`` is the pipeline's one layer (the first layer's load
before any compute, or the last layer's compute after the last load). A connector that does
not load layer-wise has ``L = 1``: load then compute. Each tier touched adds its latency
once. Under chunked prefill (a per-step budget of ``B`` tokens) only the first step's
compute, ``C`` of ``[N, N + B)``, hides the load; the later steps follow it, each with the
step's fixed cost.

:func:`choose_split` evaluates that at every chunk boundary of the hit (a prefix: chunk
``i`` cannot be loaded without the chunks before it; each chunk from the fastest tier
holding it, as the lookup said) where a lower tier's chunk begins -- a chunk in L1 is never
recomputed for its own sake: its copy is the least any hit costs, it runs on the copy
engine rather than taking compute from the batch, and a cut there would stake the
request on the compute estimate for a few percent at best (16k tokens on an H200 over
PCIe: 3.5%) -- and answers the largest ``N`` whose predicted TTFT is within
``margin`` (3%) plus ``slack_s`` (1 ms) of the best: near-ties go to loading, which spends
no compute another request could use, and a prediction is not trusted to a millisecond. With L1 much faster than compute, ``N`` is the whole hit and nothing changes; with a
tier much slower, ``N`` stops before its chunks and lmc is never worse than no cache.

A hybrid model (:mod:`lmc.hybrid`) prices each KV group's bytes (:class:`KVBytes`): full
attention's for every loaded position, a sliding window's for at most its window, a state's
once; and only ends every group can serve are candidates (the lookup's ``points``).

One rule for everyone: the connectors' scheduler half (:class:`LoadPolicy`, from a cache
engine's live :class:`lmc.storage.speeds.Speeds`) and ``lmc plan``
(:mod:`lmc.planner.costmodel`, from a calibration profile) both call :func:`choose_split`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmc.storage.lookup import LookupResult
from lmc.storage.speeds import KVBytes, PrefillRate, SpeedSnapshot, TierRate

log = logging.getLogger(__name__)
POLICIES = ("auto", "load_all")
_COUNTER: Any = None
_COUNTER_LOCK = threading.Lock()


def _counter() -> Any:
    """``lmc_load_policy_tokens_total{outcome, tier}``: loaded (by tier), recomputed_by_choice,
    recomputed_by_miss; registered with the first policy."""
    global _COUNTER
    with _COUNTER_LOCK:
        if _COUNTER is None:
            from prometheus_client import Counter

            _COUNTER = Counter("lmc_load_policy_tokens",
                               "Prompt tokens by what the load policy did with them",
                               ["outcome", "tier"])
        return _COUNTER
DEFAULT_MARGIN = 0.03
DEFAULT_SLACK_S = 1e-3


@dataclass(frozen=True)
class Costs:
    """What the rule knows: per tier (indexed as a ``LookupResult``'s ``tiers``, L1 first)
    its rate, the engine's compute, the KV bytes of one token and the layers a layer-wise
    load pipelines over (1: not layer-wise). ``kv``: a hybrid model's bytes per KV group
    kind (``None``: ``bytes_per_token`` for every position)."""

    tiers: tuple[TierRate, ...]
    prefill: PrefillRate
    bytes_per_token: float
    num_layers: int = 1
    kv: KVBytes | None = None

    def load_bytes(self, n: int) -> float:
        """Bytes a load of ``n`` positions moves."""
        return self.kv.load(n) if self.kv is not None else n * self.bytes_per_token

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("Costs needs at least L1's rate")
        if self.bytes_per_token <= 0 or self.num_layers < 1:
            raise ValueError(f"bytes_per_token must be > 0 and num_layers >= 1, got "
                             f"{self.bytes_per_token}, {self.num_layers}")

    @classmethod
    def from_snapshot(cls, snap: SpeedSnapshot, bytes_per_token: float, num_layers: int,
                      kv: KVBytes | None = None) -> Costs | None:
        """``None`` while the engine's compute is unknown (then the whole hit is loaded)."""
        if snap.prefill is None or not snap.tiers:
            return None
        return cls(snap.tiers, snap.prefill, bytes_per_token, num_layers,
                   kv if kv is not None and kv.hybrid else None)


@dataclass(frozen=True)
class Split:
    """The decision for one request: load ``[start, end)``, compute from ``end``.

    ``by_tier``: loaded positions per tier index; ``ttft_s`` its predicted TTFT,
    ``load_all_s`` and ``load_none_s`` those of the two ends (same model)."""

    start: int
    end: int
    hit_end: int
    by_tier: tuple[int, ...]
    ttft_s: float
    load_all_s: float
    load_none_s: float

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def recomputed_by_choice(self) -> int:
        return self.hit_end - self.end


def ttft_s(costs: Costs, by_tier: Sequence[int], start: int, end: int, total: int,
           step_tokens: int = 0) -> float:
    """Predicted TTFT of loading ``[start, end)`` (``by_tier[t]`` positions from tier
    ``t``) and computing ``[end, total)`` (see the module doc). ``step_tokens``: the most
    positions one step computes for a request (chunked prefill; 0: the rest in one step)."""
    copy = costs.tiers[0]
    loaded = sum(n for n in by_tier if n > 0)
    # bytes per loaded position: the load's bytes spread over its positions (a hybrid
    # model's windows and states are not linear in them)
    bpt = costs.load_bytes(loaded) / loaded if loaded else costs.bytes_per_token
    overlapped = serial = 0.0
    for t, n in enumerate(by_tier):
        if n <= 0 or t == 0:
            continue  # L1: the copy below is all it costs
        rate = costs.tiers[t]
        s = rate.latency_s + n * bpt / rate.bytes_per_s
        if rate.overlaps:
            overlapped += s
        else:
            serial += s
    if loaded:
        overlapped += copy.latency_s + loaded * bpt / copy.bytes_per_s
    first = total if step_tokens <= 0 else min(total, end + step_tokens)
    compute = costs.prefill.seconds(end, first)
    # chunked prefill: the steps after the first start once every load is done; k steps
    # over [first, total) cost one step's fixed cost k times (the other terms telescope)
    later = 0.0
    if first < total:
        steps = -(-(total - first) // step_tokens)
        later = costs.prefill.seconds(first, total) + (steps - 1) * costs.prefill.c0
    lo, hi = sorted((overlapped, compute))
    return serial + hi + lo / costs.num_layers + later


def choose_split(costs: Costs, sources: bytes | Sequence[int], chunk_size: int, start: int,
                 hit_end: int, total: int, *, align: int = 1, step_tokens: int = 0,
                 margin: float = DEFAULT_MARGIN, slack_s: float = DEFAULT_SLACK_S,
                 servable: Callable[[int], int] | None = None) -> Split:
    """The rule (module doc): positions ``[start, hit_end)`` can be loaded, chunk ``i`` of
    the prompt from tier ``sources[i]``; the engine has ``[0, start)`` and must compute up
    to ``total``. Candidates are ``hit_end`` and every position from ``start`` on where a
    lower-tier chunk begins (chunk boundaries rounded down to ``align``). ``load_none_s`` is
    predicted whatever the candidates. ``step_tokens``: the engine's per-step token budget
    under chunked prefill (0: none) -- a load overlaps only the first step's compute.
    ``servable(end)``: the largest end ``<= end`` that can be served (a hybrid model's
    lookup, ``LookupResult.servable_end``); only ends it keeps are candidates."""
    if not 0 <= start <= hit_end <= total:
        raise ValueError(f"choose_split: need 0 <= start <= hit_end <= total, got {start}, "
                         f"{hit_end}, {total}")
    cs = chunk_size
    if hit_end > start and len(sources) * cs < hit_end:
        raise ValueError(f"choose_split: {len(sources)} sources cannot cover {hit_end} "
                         f"positions in chunks of {cs}")
    ntiers = len(costs.tiers)
    # a cut only before a lower-tier chunk: an L1 chunk is never recomputed for itself
    first = [start] if start == hit_end or sources[start // cs] != 0 else []
    cands = sorted({*first, hit_end, *(b - b % align for b in range(cs * (start // cs + 1),
                                                                    hit_end, cs)
                                       if b - b % align > start and sources[b // cs] != 0)})
    if servable is not None:  # a hybrid model: ends every KV group can serve
        cands = [c for c in cands if c in (start, hit_end) or servable(c) == c]
    counts = [0] * ntiers
    pos = start
    best: list[tuple[int, tuple[int, ...], float]] = []
    for n in cands:
        while pos < n:  # positions [pos, n) added chunk by chunk
            i = pos // cs
            step = min((i + 1) * cs, n) - pos
            t = sources[i]
            if t >= ntiers:
                raise ValueError(f"choose_split: source {t} names no tier of {ntiers}")
            counts[t] += step
            pos += step
        best.append((n, tuple(counts), ttft_s(costs, counts, start, n, total, step_tokens)))
    least = min(x[2] for x in best)
    none = best[0][2] if cands[0] == start else ttft_s(costs, [0] * ntiers, start, start, total,
                                                     step_tokens)
    end, by_tier, predicted = max((x for x in best if x[2] <= least * (1 + margin) + slack_s),
                                  key=lambda x: x[0])
    return Split(start, end, hit_end, by_tier, predicted, best[-1][2], none)


# Lookup socket path -> the speeds of the engine serving it, for engines in this process
# (vLLM's uni-process executor runs the worker beside the scheduler; lmc.connectors.vllm).
LOCAL_COSTS: dict[str, Callable[[], Costs | None]] = {}
_LOCAL_LOCK = threading.Lock()


def register_local(path: str, costs: Callable[[], Costs | None] | None) -> None:
    """Offer (``None``: withdraw) the speeds of the engine answering lookups at ``path``."""
    with _LOCAL_LOCK:
        if costs is None:
            LOCAL_COSTS.pop(path, None)
        else:
            LOCAL_COSTS[path] = costs


def local_costs(paths: Sequence[str], remote: Callable[[], Costs | None] | None = None
                ) -> Callable[[], Costs | None]:
    """The costs a scheduler whose ranks answer at ``paths`` decides with: rank 0's
    engine's when every rank lives in this process, else ``remote()`` (rank 0's speeds over
    its lookup socket: ``LookupClient.costs``), else ``None`` (the whole hit is loaded)."""
    paths = list(paths)

    def costs() -> Costs | None:
        fns = [LOCAL_COSTS.get(p) for p in paths]
        if not fns or any(f is None for f in fns):
            return remote() if remote is not None else None
        return fns[0]()  # type: ignore[misc]

    return costs


class LoadPolicy:
    """The scheduler half's decision, from live estimates (``costs()``, ``None`` while
    unknown: the whole hit is loaded). ``enabled=False`` (config ``load_policy:
    load_all``) always loads the whole hit; counters are kept either way."""

    def __init__(self, costs: Callable[[], Costs | None], *, enabled: bool = True,
                 margin: float = DEFAULT_MARGIN, slack_s: float = DEFAULT_SLACK_S,
                 step_tokens: int = 0) -> None:
        """``step_tokens``: the engine's token budget per step when it chunks long prefills
        (vLLM's ``max_num_batched_tokens``; 0: a prompt's rest is computed in one step)."""
        if not (margin >= 0 and slack_s >= 0 and step_tokens >= 0):
            raise ValueError(f"margin, slack_s and step_tokens must be >= 0, got {margin}, "
                             f"{slack_s}, {step_tokens}")
        self._costs = costs
        self.enabled = enabled
        self.step_tokens = step_tokens
        self.margin = margin
        self.slack_s = slack_s
        self._lock = threading.Lock()
        self.decisions = 0
        self.decided_unknown = 0  # decisions taken before the compute was known: load all
        self.loaded_by_tier: dict[str, int] = {}
        self.recomputed_by_choice = 0
        self.recomputed_by_miss = 0  # prompt positions no tier held (computed anyway)
        self.redecisions = 0  # decisions made again after a waiting request's prefetch
        self._prom = _counter()

    def decide(self, request_id: str, found: LookupResult, start: int, hit_end: int,
               total: int, align: int = 1) -> int:
        """The end of the load (``hit_end`` when loading all of it): what the connector
        reports as the hit is that minus ``start``."""
        split = None
        if self.enabled and hit_end > start and found.sources:
            try:
                costs = self._costs()
                if costs is not None and len(costs.tiers) == len(found.tiers):
                    split = choose_split(costs, found.sources, found.chunk_size, start,
                                         hit_end, total, align=align, margin=self.margin,
                                         slack_s=self.slack_s, step_tokens=self.step_tokens,
                                         servable=found.servable_end if found.hybrid
                                         else None)
            except Exception as e:  # the decision never fails a request: load all
                log.warning("lmc load policy failed for request %s (%s: %s): loading the "
                            "whole hit", request_id, type(e).__name__, e)
        end = hit_end if split is None else split.end
        loaded = found.tokens_by_tier(start, end) if end > start else {}
        with self._lock:
            self.decisions += 1
            self.decided_unknown += split is None and self.enabled and hit_end > start
            for name, n in loaded.items():
                self.loaded_by_tier[name] = self.loaded_by_tier.get(name, 0) + n
            self.recomputed_by_choice += hit_end - end
            miss = max(0, total - max(hit_end, start) - 1)
            self.recomputed_by_miss += miss
        for name, n in loaded.items():
            if n:
                self._prom.labels("loaded", name).inc(n)
        if hit_end > end:
            self._prom.labels("recomputed_by_choice", "").inc(hit_end - end)
        if miss:
            self._prom.labels("recomputed_by_miss", "").inc(miss)
        if log.isEnabledFor(logging.DEBUG):
            held = ", ".join(f"{k} {v}" for k, v in found.tokens_by_tier(start, hit_end).items()
                             if v)
            if split is None:
                log.debug("lmc load policy: request %s: %d tokens, engine has %d, hit to %d "
                          "(%s): load all (%s)", request_id, total, start, hit_end,
                          held or "-", "off" if not self.enabled else "speeds not known yet"
                          if hit_end > start else "nothing to load")
            else:
                log.debug("lmc load policy: request %s: %d tokens, engine has %d, hit to %d "
                          "(%s): load to %d, recompute %d by choice; predicted TTFT %.1f ms "
                          "(load all %.1f ms, none %.1f ms)", request_id, total, start,
                          hit_end, held or "-", end, hit_end - end, split.ttft_s * 1e3,
                          split.load_all_s * 1e3, split.load_none_s * 1e3)
        return end

    def retract(self, found: LookupResult, start: int, end: int, hit_end: int,
                total: int) -> None:
        """Take back the token counts of a decision :meth:`decide` answered ``end`` to: it is
        being made again (the chunks it recomputed by choice were prefetched into L1 while
        the request waited). The Prometheus counters keep both: they count decisions."""
        loaded = found.tokens_by_tier(start, end) if end > start else {}
        with self._lock:
            self.redecisions += 1
            for name, n in loaded.items():
                self.loaded_by_tier[name] = self.loaded_by_tier.get(name, 0) - n
            self.recomputed_by_choice -= hit_end - end
            self.recomputed_by_miss -= max(0, total - max(hit_end, start) - 1)

    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {
                "policy.enabled": float(self.enabled), "policy.decisions": self.decisions,
                "policy.redecisions": self.redecisions,
                "policy.decided_unknown": self.decided_unknown,
                "policy.recomputed_by_choice": self.recomputed_by_choice,
                "policy.recomputed_by_miss": self.recomputed_by_miss}
            out.update({f"policy.loaded_from_{k}": v for k, v in self.loaded_by_tier.items()})
        return out
