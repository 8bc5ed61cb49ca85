"""``LookupResult``: what a lookup found, and where, from one pass over the tiers.

Why a type and not an int: a scheduler wants more than "how many tokens" -- it reports how
many of the tokens it loads come from host memory and how many from disk or a remote store
(vLLM's cache-hit sources), and the worker counts loaded tokens by tier. Computing that
after the fact meant hashing the prompt again and asking every tier again (a remote round
trip) only for statistics. The storage manager already learns which tier holds each chunk
while it answers, so the answer carries it: ``sources[i]`` is the index into ``tiers`` of
the fastest tier holding hit chunk ``i`` (a chunk waiting in a write-behind queue is in
memory and counts as L1).

A result may carry no attribution (``sources`` empty: an adapter's lookup that only knows a
count); ``tokens_by_tier`` is then empty too.

A hybrid model's hit cannot end anywhere below its length: each KV group must be servable
where the load ends (:mod:`lmc.hybrid.rules`). Its result carries the ``points`` where one
may end, and the ``slack`` below each point a load may still end at;
:meth:`LookupResult.servable_end` is what a scheduler cuts a hit to. A plain result has no
points: every end up to ``tokens`` is servable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_TIERS = 16  # bounds the wire format (lmc.connectors.core.lookup_service) and any sane tier stack
_INDICES = bytes(range(MAX_TIERS))


@dataclass(frozen=True)
class LookupResult:
    """Leading tokens some tier can supply, and which tier holds each hit chunk.

    Attributes:
        tokens: prefix tokens available (the last hit chunk may be a partial one).
        chunk_size: tokens per chunk (``sources`` counts chunks).
        tiers: tier names, fastest (L1) first.
        sources: per hit chunk, the index into ``tiers`` of the tier that holds it, one
            byte each (any sequence of ints is converted); empty when the lookup did not
            attribute its hits.
        points: a hybrid model's servable load ends, ascending (empty: plain, every end
            up to ``tokens``); a load may end at a point or up to ``slack`` below one.
    """

    tokens: int
    chunk_size: int
    tiers: tuple[str, ...] = ()
    sources: bytes = b""
    points: tuple[int, ...] = ()
    slack: int = 0

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"LookupResult: chunk_size must be >= 1, got {self.chunk_size}")
        if self.tokens < 0:
            raise ValueError(f"LookupResult: tokens must be >= 0, got {self.tokens}")
        if len(self.tiers) > MAX_TIERS:
            raise ValueError(f"LookupResult: {len(self.tiers)} tiers, at most {MAX_TIERS}")
        if not isinstance(self.sources, bytes):
            try:  # bytes: converted and range-checked in C (a lookup's hot path)
                object.__setattr__(self, "sources", bytes(self.sources))
            except (ValueError, TypeError):
                raise ValueError(f"LookupResult: sources must be tier indices, got "
                                 f"{self.sources!r:.80}") from None
        if self.points or self.slack:
            self._check_points()
        if not self.sources:
            return
        chunks = -(-self.tokens // self.chunk_size)
        if len(self.sources) != chunks:
            raise ValueError(f"LookupResult: {len(self.sources)} sources for {self.tokens} "
                             f"tokens in chunks of {self.chunk_size} ({chunks} chunks)")
        if self.sources.translate(None, _INDICES[: len(self.tiers)]):  # some index left over
            bad = max(self.sources)
            raise ValueError(f"LookupResult: source {bad} names no tier of {self.tiers}")

    def _check_points(self) -> None:
        pts = tuple(int(p) for p in self.points)
        object.__setattr__(self, "points", pts)
        if self.slack < 0 or any(p < 1 for p in pts) or list(pts) != sorted(set(pts)):
            raise ValueError(f"LookupResult: points {list(pts)[:8]} must be distinct positive "
                             f"ends, ascending, with slack >= 0 (got {self.slack})")
        if self.tokens and servable_end(pts, self.slack, self.tokens) != self.tokens:
            raise ValueError(f"LookupResult: {self.tokens} hit tokens is no servable end of "
                             f"points {list(pts)[:8]} (slack {self.slack})")

    @property
    def hybrid(self) -> bool:
        """Whether only some ends are servable (a hybrid model's hit: ``points``)."""
        return bool(self.points)

    def servable_end(self, limit: int) -> int:
        """The largest load end ``<= limit`` (and ``<= tokens``) that can be served."""
        limit = min(limit, self.tokens)
        if not self.points or limit <= 0:
            return max(0, limit)
        return servable_end(self.points, self.slack, limit)

    @classmethod
    def miss(cls, chunk_size: int = 1, tiers: Sequence[str] = ()) -> LookupResult:
        return cls(0, chunk_size, tuple(tiers))

    @property
    def attributed(self) -> bool:
        """Whether the hits carry their tiers (a miss trivially does)."""
        return bool(self.sources) or self.tokens == 0

    def tokens_by_tier(self, start: int = 0, end: int | None = None) -> dict[str, int]:
        """Hit positions in ``[start, end)`` per tier, every tier listed in order (L1 first,
        zeros included); empty if the result is not attributed."""
        if not self.sources:
            return {t: 0 for t in self.tiers} if self.tokens == 0 else {}
        start = max(0, start)
        end = self.tokens if end is None else min(end, self.tokens)
        counts = [0] * len(self.tiers)
        cs = self.chunk_size
        if end > start:  # whole chunks counted in C, then the two cut edges taken off
            first, last = start // cs, -(-end // cs)
            seg = self.sources[first:last]
            counts = [seg.count(t) * cs for t in range(len(self.tiers))]
            counts[seg[0]] -= start - first * cs
            counts[seg[-1]] -= last * cs - end
        return dict(zip(self.tiers, counts))

    def clipped(self, tokens: int) -> LookupResult:
        """The same result cut to its first ``tokens`` positions (a hybrid one to its
        largest servable end within them)."""
        if tokens >= self.tokens:
            return self
        tokens = self.servable_end(max(0, tokens))
        keep = -(-tokens // self.chunk_size) if self.sources else 0
        points = tuple(p for p in self.points if p - self.slack <= tokens) if tokens else ()
        return LookupResult(tokens, self.chunk_size, self.tiers, self.sources[:keep], points,
                            self.slack if points else 0)


def servable_end(points: Iterable[int], slack: int, limit: int) -> int:
    """The largest load end ``<= limit`` that ``points`` allow: a point, or ``limit`` itself
    where it lies within ``slack`` below one (0: none)."""
    best = 0
    for p in points:
        if p <= limit:
            best = max(best, p)
        elif p - slack <= limit:
            best = max(best, limit)
    return best


def minimum(results: Iterable[LookupResult]) -> LookupResult:
    """What every one of several ranks can supply: the shortest prefix, each chunk counted
    in the slowest tier any rank holds it in (a load waits for its slowest rank).

    Ranks of one engine share a configuration, so their tier lists agree; if they do not,
    attribution is dropped rather than guessed."""
    results = list(results)
    if not results:
        raise ValueError("minimum() of no lookup results")
    least = min(results, key=lambda r: r.tokens)
    if least.tokens == 0:  # a miss (possibly from a rank that knows no chunk size yet)
        return least
    first = results[0]
    cs = first.chunk_size
    if any(r.chunk_size != cs for r in results):
        raise ValueError(f"lookup results disagree on chunk_size: "
                         f"{sorted({r.chunk_size for r in results})}")
    tokens = least.tokens
    points: tuple[int, ...] = ()
    slack = 0
    if any(r.points for r in results):  # hybrid: ends every rank can serve
        # a point of every rank is served within the least slack of any
        points = tuple(sorted(set.intersection(*(set(r.points) for r in results))))
        slack = min(r.slack for r in results)
        tokens = servable_end(points, slack, tokens)
        points = tuple(p for p in points if p - slack <= tokens) if tokens else ()
        if not tokens:
            return LookupResult(0, cs)
    if any(r.tiers != first.tiers or not r.sources for r in results):
        return LookupResult(tokens, cs, points=points, slack=slack if points else 0)
    n = -(-tokens // cs)
    sources = bytes(max(r.sources[i] for r in results) for i in range(n))
    return LookupResult(tokens, cs, first.tiers, sources, points, slack if points else 0)
