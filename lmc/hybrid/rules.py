"""What a hybrid model stores per KV group, and at which positions a hit can be served.

Keys stay per chunk (:mod:`lmc.token_database`); a chunk's data is split into one *part*
per KV group (:mod:`lmc.transfer.kv_groups`), each stored under its own key derived from
the chunk's (:func:`part_key`), so each kind keeps only what it needs:

* a **full** group's part of every chunk (a hit at N needs all N positions);
* a **sliding** group's part only near a *checkpoint*: a continuation at N needs positions
  ``[N - W + 1, N)``, so for each checkpoint p the parts of the chunks overlapping
  ``[p - slack - W + 1, p)`` are kept, where ``slack`` (one chunk) lets a load end a little
  below p (the engine computes a prompt's last token; block alignment) and still find its
  window. Parts far behind every checkpoint are never stored;
* a **state** group's part only for a chunk that ends exactly at a checkpoint (the state
  after that position), and only when the engine's state then was that position's.

Checkpoints of a sequence: every ``interval`` tokens, the end of its last whole chunk, and
its end (the points a later request sharing the sequence's prefix, repeating it or
continuing it, will ask for). A hit is reported only at a point where every group can be
served -- all or nothing per point, never some groups' KV for one length and another's for
another: :meth:`HitRule.points` from which parts are present. A stored chunk missing one
group's part is a miss at every point that needs it.

Pure arithmetic (no tensors, no storage): the engine (:mod:`lmc.hybrid.engine`), the
scheduler's lookup answers and the planner apply the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from lmc.storage.lookup import servable_end
from lmc.transfer.kv_groups import FULL, SLIDING, STATE, KVGroup

_PART = b"lmc-kv-group-part"  # never a chain input's length: prev (16) + 4 * tokens bytes


def part_key(chunk_key: bytes, group: int) -> bytes:
    """The key of group ``group``'s part of the chunk keyed ``chunk_key`` (same size)."""
    return xxhash.xxh3_128_digest(chunk_key + _PART + bytes((group,)))


def part_keys(chunk_keys: Sequence[bytes], group: int) -> list[bytes]:
    return [part_key(k, group) for k in chunk_keys]


def default_interval(chunk_size: int, groups: Sequence[KVGroup]) -> int:
    """Checkpoint spacing when the configuration leaves it to lmc: 8 chunks, or two windows
    (and their slack) of the widest sliding group if that is more, in whole chunks. Wider
    spacing stores fewer sliding/state parts; a prefix shared at a point that is not a
    checkpoint then hits at the checkpoint before it."""
    widest = max((g.window for g in groups if g.kind == SLIDING), default=0)
    want = max(8 * chunk_size, 2 * (widest + chunk_size))
    return -(-want // chunk_size) * chunk_size


@dataclass(frozen=True)
class HitRule:
    """The rule for one engine: its groups, chunk size and checkpoint ``interval`` (a
    multiple of the chunk size)."""

    groups: tuple[KVGroup, ...]
    chunk_size: int
    interval: int

    def __post_init__(self) -> None:
        cs = self.chunk_size
        if cs < 1 or self.interval < cs or self.interval % cs:
            raise ValueError(f"checkpoint interval {self.interval} must be a positive "
                             f"multiple of the chunk size {cs}")

    @property
    def slack(self) -> int:
        """How far below a reported point a load may end and still be served: one chunk
        with sliding groups' margins, none with a state group (its state is at the point)."""
        return 0 if any(g.kind == STATE for g in self.groups) else self.chunk_size

    # ------------------------------------------------------------- what is stored
    def checkpoints(self, horizon: int) -> list[int]:
        """The hit points a sequence of ``horizon`` tokens keeps parts for (ascending)."""
        cs = self.chunk_size
        pts = set(range(self.interval, horizon + 1, self.interval))
        pts.add(horizon - horizon % cs)
        pts.add(horizon)
        pts.discard(0)
        return sorted(pts)

    def keeps(self, group: KVGroup, start: int, end: int, checkpoints: Sequence[int]) -> bool:
        """Whether ``group``'s part of the chunk ``[start, end)`` is stored."""
        if group.kind == FULL:
            return True
        if group.kind == STATE:
            return end in checkpoints
        reach = self.slack + group.window - 1  # positions before a checkpoint its part covers
        return any(start < p and end > p - reach for p in checkpoints)

    # --------------------------------------------------------- what a load needs
    def needed(self, group: KVGroup, end: int, first: int = 0) -> range:
        """Chunk indices whose ``group`` part a load ending at ``end`` needs, from chunk
        ``first`` on (the engine has the chunks before it). A state group's is the chunk
        holding ``end - 1``, valid only if that chunk ends at ``end`` (the caller checks)."""
        cs = self.chunk_size
        last = -(-end // cs)
        if end <= 0:
            return range(0)
        if group.kind == FULL:
            return range(first, last)
        if group.kind == STATE:
            return range(max(first, last - 1), last)
        return range(max(first, max(0, end - group.window + 1) // cs), last)

    def margin(self, group: KVGroup, point: int) -> range:
        """Chunk indices of ``group``'s parts a reported point needs: what a load ending
        anywhere in ``[point - slack, point]`` needs."""
        if group.kind != SLIDING:
            return self.needed(group, point)
        cs = self.chunk_size
        lo = max(0, point - self.slack - group.window + 1)
        return range(lo // cs, -(-point // cs))

    # ------------------------------------------------------------- what is served
    def points(self, present: Sequence[Sequence[bool]], ends: Sequence[int],
               first: int = 0, exact: bool = False) -> list[int]:
        """The hit points (ascending) every group can serve: ``present[g][k]`` says whether
        group ``g``'s part of chunk ``k`` is held, ``ends[k]`` is where chunk ``k`` ends.
        Chunks before ``first`` count as held (the engine has them). A point needs its
        sliding groups' slack margin too, unless ``exact`` (a load ending at the point
        itself needs only its windows)."""
        n = len(ends)
        full = n
        for g, have in zip(self.groups, present):
            if g.kind == FULL:
                k = first
                while k < n and have[k]:
                    k += 1
                full = min(full, k)
        out = []
        for k in range(first, full):
            p = ends[k]
            if all(self._served(g, have, p, ends, k, first, exact)
                   for g, have in zip(self.groups, present) if g.kind != FULL):
                out.append(p)
        return out

    def _served(self, g: KVGroup, have: Sequence[bool], point: int, ends: Sequence[int],
                k: int, first: int, exact: bool) -> bool:
        if g.kind == STATE:
            return ends[k] == point and (k < first or bool(have[k]))
        need = self.needed(g, point) if exact else self.margin(g, point)
        return all(i < first or have[i] for i in need)

    def best_end(self, present: Sequence[Sequence[bool]], ends: Sequence[int], limit: int,
                 first: int = 0) -> int:
        """The largest load end ``<= limit`` every group can serve (0: none)."""
        return servable_end(self.points(present, ends, first), self.slack, limit)


def chunk_ends(num_tokens: int, chunk_size: int, num_chunks: int) -> list[int]:
    """Where each of a sequence's first ``num_chunks`` chunks ends (its last may be partial)."""
    return [min((k + 1) * chunk_size, num_tokens) for k in range(num_chunks)]


def kept_positions(rule: HitRule, group: KVGroup, num_tokens: int) -> int:
    """Positions of a ``num_tokens`` prompt whose ``group`` part is stored (saved whole,
    with its own checkpoints): what the group costs in bytes, per position of its rows."""
    cs = rule.chunk_size
    cps = rule.checkpoints(num_tokens)
    return sum(min(s + cs, num_tokens) - s for s in range(0, num_tokens, cs)
               if rule.keeps(group, s, min(s + cs, num_tokens), cps))
