"""Which instance gets a request: the longest cached prefix, weighed by medium, against load.

For each healthy instance whose events are fresh, the prompt's cached prefix is read from its
:class:`~lmc.router.index.PrefixIndex` per tier union (GPU; GPU or CPU; anywhere, as Dynamo's
indexer reports ``gpu``/``cpu``/``disk``). A block found only in CPU memory is worth less
than one in the engine's own cache (it must still be copied in), one on storage less again:

    credit = block_size * (w_gpu * gpu + w_cpu * (cpu - gpu) + w_storage * (all - cpu))
    cost   = (prompt tokens - credit) + load_weight * requests in flight

The lowest cost wins; ties go to the fewest in flight, then in turn. An instance whose events
are stale (not synced, or silent past ``stale_after``) is credited nothing; when no instance
is fresh, or the prompt's tokens are unknown (text without ``--tokenizer``, chat), the least
loaded wins (in turn among equals). ``round_robin`` ignores all of it: the baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmc.router.index import Match, block_keys, root_key

POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True)
class Weights:
    gpu: float = 1.0
    cpu: float = 0.8
    storage: float = 0.5
    load: float = 64.0
    """Tokens of prefill one request in flight is worth."""

    def __post_init__(self) -> None:
        for k in ("gpu", "cpu", "storage"):
            v = getattr(self, k)
            if not 0 <= v <= 1:
                raise ValueError(f"weight {k} must be in [0, 1], got {v}")
        if not 0 <= self.load <= 1 << 24:
            raise ValueError(f"load weight must be in [0, 2**24] tokens, got {self.load}")

    def credit(self, m: Match) -> float:
        return m.block_size * (self.gpu * m.gpu + self.cpu * (m.cpu - m.gpu)
                               + self.storage * (m.storage - m.cpu))


@dataclass
class Candidate:
    """What the policy needs of an instance."""

    in_flight: int
    match: Match | None  # None: events stale (or none)


@dataclass
class Choice:
    index: int
    reason: str  # prefix | load | stale | no_tokens | round_robin
    match: Match


class PromptKeys:
    """A prompt's block keys, computed once per block size (instances may differ)."""

    def __init__(self, tokens: Sequence[int], lora_name: str | None = None,
                 cache_salt: str | None = None) -> None:
        self.tokens = tokens
        self.root = root_key(lora_name, cache_salt)
        self._by_size: dict[int, list[int]] = {}

    def at(self, block_size: int) -> list[int]:
        keys = self._by_size.get(block_size)
        if keys is None:
            keys = self._by_size[block_size] = block_keys(self.tokens, block_size, self.root)
        return keys


def choose(cands: Sequence[Candidate], n_tokens: int | None, weights: Weights, turn: int,
           policy: str) -> Choice:
    """``cands`` are the healthy instances (at least one); ``turn`` rotates ties."""
    n = len(cands)
    order = [(turn + i) % n for i in range(n)]
    if policy == "round_robin":
        return Choice(order[0], "round_robin", Match())
    if n_tokens is None or all(c.match is None for c in cands):
        best = min(order, key=lambda i: cands[i].in_flight)
        return Choice(best, "no_tokens" if n_tokens is None else "stale", Match())

    def cost(i: int) -> tuple[float, int]:
        c = cands[i]
        credit = weights.credit(c.match) if c.match is not None else 0.0
        return (n_tokens - credit + weights.load * c.in_flight, c.in_flight)

    best = min(order, key=cost)
    m = cands[best].match or Match()
    return Choice(best, "prefix" if m.storage else "load", m)
