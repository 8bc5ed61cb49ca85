"""Ordered tiers behind one interface: L1 (the pool) first, lower tiers after it.

Lookups are batched per tier and answer the longest contiguous prefix present in *any* tier:
each tier is asked once, only about the keys no earlier tier had. Stores land in L1
synchronously; objects become visible only after the caller has finished writing them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lmc.memory import MemoryObj
from lmc.storage_backend import Key, StorageBackend

log = logging.getLogger(__name__)


class StorageManager:
    """``tiers[0]`` must offer ``allocate`` (the L1 tier over the pool)."""

    def __init__(self, tiers: Sequence[StorageBackend]) -> None:
        if not tiers:
            raise ValueError("StorageManager needs at least one tier")
        if not hasattr(tiers[0], "allocate"):
            raise TypeError(f"the first tier must be a memory tier with allocate(); "
                            f"got {type(tiers[0]).__name__}")
        self.tiers = list(tiers)
        self.l1 = tiers[0]

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, num_tokens: int
                 ) -> MemoryObj | None:
        return self.l1.allocate(shape, dtype, num_tokens)

    def allocate_many(self, shape: Sequence[int], dtype: torch.dtype, count: int,
                      num_tokens: int) -> list[MemoryObj]:
        return self.l1.allocate_many(shape, dtype, count, num_tokens)

    def l1_contains(self, keys: Sequence[Key]) -> list[bool]:
        return self.l1.contains(keys)

    def prefix_hits(self, keys: Sequence[Key]) -> int:
        """Leading keys present in some tier (each tier asked once, batched)."""
        if not keys:
            return 0
        if len(self.tiers) == 1:
            return self.l1.prefix_hits(keys)
        present = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            try:
                found = tier.contains([keys[i] for i in todo])
            except Exception as e:  # a failing tier is a miss, never an error to the engine
                log.warning("tier %s failed contains(): %s", tier.name, e)
                continue
            for i, f in zip(todo, found):
                if f:
                    present[i] = True
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def get_prefix(self, keys: Sequence[Key]) -> list[MemoryObj]:
        """Objects for the longest present prefix of ``keys``, each acquired for the caller."""
        found: list[MemoryObj | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, o in enumerate(found) if o is None]
            if not todo:
                break
            try:
                objs = tier.get([keys[i] for i in todo])
            except Exception as e:
                log.warning("tier %s failed get(): %s", tier.name, e)
                continue
            for i, o in zip(todo, objs):
                found[i] = o
        out: list[MemoryObj] = []
        for o in found:
            if o is None:
                break
            out.append(o)
        for o in found[len(out):]:
            if o is not None:
                o.release()
        return out

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        """Store fully written chunks in L1 (lower tiers: see the write policy)."""
        return self.l1.put(keys, objs)

    def delete(self, keys: Sequence[Key]) -> int:
        n = 0
        for tier in self.tiers:
            try:
                n += tier.delete(keys)
            except Exception as e:
                log.warning("tier %s failed delete(): %s", tier.name, e)
        return n

    def close(self) -> None:
        for tier in reversed(self.tiers):
            try:
                tier.close()
            except Exception as e:
                log.warning("tier %s failed to close: %s", tier.name, e)
