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
    """

    tokens: int
    chunk_size: int
    tiers: tuple[str, ...] = ()
    sources: bytes = b""

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
        if not self.sources:
            return
        chunks = -(-self.tokens // self.chunk_size)
        if len(self.sources) != chunks:
            raise ValueError(f"LookupResult: {len(self.sources)} sources for {self.tokens} "
                             f"tokens in chunks of {self.chunk_size} ({chunks} chunks)")
        if self.sources.translate(None, _INDICES[: len(self.tiers)]):  # some index left over
            bad = max(self.sources)
            raise ValueError(f"LookupResult: source {bad} names no tier of {self.tiers}")

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
        """The same result cut to its first ``tokens`` positions."""
        if tokens >= self.tokens:
            return self
        tokens = max(0, tokens)
        keep = -(-tokens // self.chunk_size) if self.sources else 0
        return LookupResult(tokens, self.chunk_size, self.tiers, self.sources[:keep])


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
    if any(r.tiers != first.tiers or not r.sources for r in results):
        return LookupResult(tokens, cs)
    n = -(-tokens // cs)
    sources = bytes(max(r.sources[i] for r in results) for i in range(n))
    return LookupResult(tokens, cs, first.tiers, sources)
