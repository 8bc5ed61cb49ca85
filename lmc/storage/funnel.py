"""The hit-rate funnel: of a namespace's prompt tokens, how many the best possible cache would
have hit, how many lmc found (per tier), and why each of the rest was missed.

Every lookup is classified before it is answered (:meth:`Funnel.lookup`). *Best possible* is
what a cache that never dropped anything would have held: the longest prefix of the prompt
whose chunks were found now or stored before ("replaying what was seen": a storage listener
notes every chunk as it lands in a tier, and an unbounded cache would have kept it). A chunk
a lookup named that no tier has received yet is not in it: its request is still computing
it (a sub-agent forking a context whose turn is in flight), and no cache could have had it.
The tokens between what was found and that prefix are the avoidable misses, all put down to
the first missing chunk's fate, which the listener records as chunks leave:

* ``capacity``: evicted to make room (L1, the disk tier, a daemon namespace's quota);
* ``ttl``: stored in a tier with a time to live (Redis ``ttl``) longer ago than it;
* ``write_queue_full``: L1 evicted it after a full write-behind queue dropped its write to a
  lower tier (it would be there otherwise);
* ``deleted``: removed by a delete or a clear;
* ``unknown``: gone without lmc seeing why (another engine's store, Redis ``maxmemory``).

Past the best possible prefix the rest is ``other_salt`` where the same tokens were stored
under another key chain of this engine (another ``cache_salt`` or LoRA adapter: a chain of
the tokens alone, from a fixed root, tells), then ``in_flight`` for chunks an earlier lookup
named that were not stored yet (computing concurrently, or a save that never happened), else
``never_seen``. A lookup that a lower tier did not answer in time
(:mod:`lmc.storage.timed_contains`) puts every token past its hit down to ``unanswered``:
that tier may have held them. What happens after the lookup
is counted where it happens: ``recomputed_by_choice`` (the load policy, a load that stopped
itself), ``failed_to_load`` (the worker), what was loaded (per tier) and what the engine used
(its own prefix cache plus lmc's load): :func:`funnel_view` puts them together.

Memory is bounded: at most ``max_keys`` chunk keys remembered as seen (per chain kind) and as
fates, the oldest forgotten first (a chunk seen longer ago than that counts as never seen).
Runs under one lock; the listener only records.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmc.metrics import FUNNEL_FOUND, FUNNEL_MISSES, FUNNEL_TOKENS
from lmc.storage.tier import DELETED, EVICTED, Key, TierInfo, TierListener

MISS_REASONS = ("unanswered", "capacity", "ttl", "write_queue_full", "deleted", "unknown",
                "other_salt", "in_flight", "never_seen")
LATER_REASONS = ("recomputed_by_choice", "failed_to_load")
STAGES = ("prompt", "best", "found")


class _Bounded:
    """An insertion-ordered map of at most ``cap`` keys, the oldest forgotten first."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.d: OrderedDict[Key, Any] = OrderedDict()

    def put(self, k: Key, v: Any = None) -> None:
        d = self.d
        if k in d:
            d.move_to_end(k)
        d[k] = v
        if len(d) > self.cap:
            d.popitem(last=False)


class Funnel(TierListener):
    """One namespace's funnel (module doc). ``tiers``: the chain's tier names, L1 first;
    ``ttls``: seconds each tier keeps a value (0: until evicted), by level."""

    def __init__(self, namespace: str, tiers: Sequence[str], chunk_size: int,
                 ttls: Sequence[float] = (), max_keys: int = 1 << 18,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.namespace = namespace
        self.tiers = list(tiers)
        self.cs = chunk_size
        self.ttls = list(ttls) + [0.0] * (len(self.tiers) - len(ttls))
        self.clock = clock
        self.seen = _Bounded(max_keys)       # chunk keys stored before (this chain)
        self.seen_any = _Bounded(max_keys)   # the same chunks' keys from a fixed root
        self.pending = _Bounded(max_keys)    # looked up, not stored yet: key -> its any-key
        self.fates = _Bounded(max_keys)      # key -> why it last left a tier
        self.dropped = _Bounded(max_keys)    # keys a full write-behind queue dropped
        self.expiry = _Bounded(max_keys)     # key -> when a TTL tier lets it go
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {"lookups": 0, **{s: 0 for s in STAGES},
                                       **{f"miss.{r}": 0 for r in MISS_REASONS},
                                       **{f"found.{t}": 0 for t in self.tiers}}
        ns = namespace
        self._stage = {s: FUNNEL_TOKENS.labels(ns, s) for s in STAGES}
        self._found = [FUNNEL_FOUND.labels(ns, t) for t in self.tiers]
        self._miss = {r: FUNNEL_MISSES.labels(ns, r) for r in MISS_REASONS}

    # ------------------------------------------------------------ the listener
    def on_removed(self, keys: Sequence[Key], tier: TierInfo, reason: str,
                   objs: Any = None) -> None:
        why = "deleted" if reason == DELETED else "capacity"  # evicted, or a quota's
        with self._lock:
            dropped = self.dropped.d
            for k in keys:
                if tier.level == 0 and reason == EVICTED and k in dropped:
                    self.fates.put(k, "write_queue_full")
                else:
                    self.fates.put(k, why)

    def on_stored(self, keys: Sequence[Key], tier: TierInfo, reason: str) -> None:
        ttl = self.ttls[tier.level] if tier.level < len(self.ttls) else 0.0
        until = self.clock() + ttl if ttl > 0 else None
        with self._lock:
            seen, pending = self.seen.put, self.pending.d
            for k in keys:
                seen(k)
                a = pending.pop(k, None)
                if a is not None:
                    self.seen_any.put(a)
                if until is not None:
                    self.expiry.put(k, until)

    def note_dropped(self, keys: Sequence[Key]) -> None:
        """A full write-behind queue dropped these keys' writes to a lower tier."""
        with self._lock:
            for k in keys:
                self.dropped.put(k)

    # ------------------------------------------------------------ classifying
    def _fate(self, k: Key) -> str:
        until = self.expiry.d.get(k)
        if until is not None and until <= self.clock():
            return "ttl"
        return self.fates.d.get(k) or "unknown"

    def _tokens(self, a: int, b: int, n: int) -> int:
        """Tokens of chunks ``[a, b)`` of an ``n``-token prompt."""
        return max(0, min(b * self.cs, n) - min(a * self.cs, n))

    def lookup(self, n: int, keys: Sequence[Key], any_keys: Sequence[Key],
               sources: Sequence[int], unanswered: bool = False) -> dict[str, int]:
        """Classify one lookup of an ``n``-token prompt (``keys``: its chain, ``any_keys``:
        the tokens' chain from the fixed root, ``sources``: the tier of each hit chunk;
        ``unanswered``: the hit ended where a lower tier did not answer in time); the chunks
        found count as seen, the others as pending until a tier stores them. Returns this
        lookup's counts."""
        hit = len(sources)
        out: dict[str, int] = {}
        with self._lock:
            seen, seen_any, pending = self.seen.d, self.seen_any.d, self.pending.d
            best = hit
            while best < len(keys) and keys[best] in seen:
                best += 1
            best_any = 0
            while best_any < len(any_keys) and (any_keys[best_any] in seen_any):
                best_any += 1
            if unanswered:
                if hit < len(keys):
                    out["miss.unanswered"] = self._tokens(hit, len(keys), n)
            else:
                if best > hit:
                    out[f"miss.{self._fate(keys[hit])}"] = self._tokens(hit, best, n)
                if best_any > best:
                    out["miss.other_salt"] = self._tokens(best, best_any, n)
                first = waiting = max(best, best_any)
                while waiting < len(keys) and keys[waiting] in pending:
                    waiting += 1
                if waiting > first:
                    out["miss.in_flight"] = self._tokens(first, waiting, n)
                never = self._tokens(waiting, len(keys), n)
                if never:
                    out["miss.never_seen"] = never
            for i, k in enumerate(keys):
                if i < hit:  # found: stored somewhere, whoever stored it
                    self.seen.put(k)
                    if i < len(any_keys):
                        self.seen_any.put(any_keys[i])
                elif k not in seen:
                    self.pending.put(k, any_keys[i] if i < len(any_keys) else None)
            out.update(prompt=n, best=self._tokens(0, best, n), found=self._tokens(0, hit, n))
            for i, level in enumerate(sources):
                name = f"found.{self.tiers[level]}"
                out[name] = out.get(name, 0) + self._tokens(i, i + 1, n)
            self.counts["lookups"] += 1
            for name, v in out.items():
                self.counts[name] = self.counts.get(name, 0) + v
        self._export(out)
        return out

    def _export(self, out: Mapping[str, int]) -> None:
        for s in STAGES:
            if out.get(s):
                self._stage[s].inc(out[s])
        for i, t in enumerate(self.tiers):
            v = out.get(f"found.{t}")
            if v:
                self._found[i].inc(v)
        for r in MISS_REASONS:
            v = out.get(f"miss.{r}")
            if v:
                self._miss[r].inc(v)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {f"funnel.{k}": v for k, v in self.counts.items()}


def funnel_view(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The funnel's rows from a connector's flat stats (``cache.funnel.*`` of the engine,
    ``scheduler.*`` and ``worker.*``), in order: prompt, best possible, found (by tier),
    loaded (by tier), used by the engine; and the misses by reason. Missing parts are left
    out (a front without lmc, a process that only looks up)."""
    def get(name: str) -> float:
        for p in ("", "cache."):
            v = stats.get(p + name)
            if isinstance(v, (int, float)):
                return v
        return 0

    rows: dict[str, Any] = {
        "prompt_tokens": get("funnel.prompt"), "best_possible": get("funnel.best"),
        "lmc_found": get("funnel.found"),
        "found_by_tier": {k.split("funnel.found.", 1)[1]: v for k, v in stats.items()
                          if "funnel.found." in k and v},
        "loaded": get("worker.loaded_tokens"),
        "loaded_by_tier": {k.split("worker.tokens_from_", 1)[1]: v for k, v in stats.items()
                           if k.startswith("worker.tokens_from_") and v},
        "engine_used": get("scheduler.used_tokens"),
        "engine_local": get("scheduler.engine_local_tokens"),
    }
    misses = {r: get(f"funnel.miss.{r}") for r in MISS_REASONS}
    misses["recomputed_by_choice"] = get("scheduler.recomputed_by_choice_tokens") + \
        get("worker.stopped_tokens")
    misses["failed_to_load"] = get("worker.recomputed_after_failure")
    rows["misses"] = {k: v for k, v in misses.items() if v}
    return rows
