"""A memory pool of addresses only: lmc's TLSF allocator and ``MemoryObj`` references, no buffer.

Why: the planner must run lmc's real L1 tier (``lmc/storage/backends/cpu.py``: its LRU order, its
"only evict what nobody else references" rule, its allocate-evict-retry loop) for pools of
many GiB, thousands of times faster than moving KV. Everything that decides *which* chunk is
evicted lives in the tier and in the allocator, and neither touches bytes; only the buffer
does. This pool keeps the allocator and the reference counting of
:class:`lmc.memory.pool.MemoryPool` and drops the buffer, so an object's ``tensor`` is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.memory.tlsf import TLSFAllocator


class AddressPool:
    """``MemoryPool``'s allocation and reference API over ``size`` bytes of address space."""

    invariants = False
    pinned = False

    def __init__(self, size: int, align: int = 4096) -> None:
        self.allocator = TLSFAllocator(size, align)
        self.size = self.allocator.capacity
        self.lock = threading.RLock()
        self.closed = False
        self.leaks: list[str] = []

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, num_tokens: int = 0
                 ) -> MemoryObj | None:
        objs = self.allocate_many(shape, dtype, 1, num_tokens)
        return objs[0] if objs else None

    def allocate_many(self, shape: Sequence[int], dtype: torch.dtype, count: int,
                      num_tokens: int = 0) -> list[MemoryObj]:
        """Up to ``count`` objects (fewer when the address space runs out), as the real pool."""
        shape = tuple(shape)
        n = dtype.itemsize
        for d in shape:
            n *= d
        if n <= 0:
            raise ValueError(f"cannot allocate an empty object of shape {shape}")
        alloc = self.allocator
        if alloc.used_bytes + n > alloc.capacity:  # exact shortcut: not even one fits
            return []
        offs = alloc.allocate_many(n, count)
        return [MemoryObj(self, off, n, shape, dtype, num_tokens, None) for off in offs]  # type: ignore[arg-type]

    def view(self, *_: object) -> torch.Tensor:
        raise RuntimeError("an AddressPool holds no bytes: the planner never reads KV")

    # MemoryPool's own batch acquire (one lock, every object checked alive)
    acquire_many = MemoryPool.acquire_many

    # MemoryPool's own batch release (one lock, last references freed with one free_many):
    # the order of the free lists decides which blocks later allocations get, so the planner
    # must free exactly as the engine does (one by one, its L1 evicted other chunks)
    release_many = MemoryPool.release_many

    def _free_locked(self, obj: MemoryObj) -> None:
        if not self.closed:
            self.allocator.free(obj.offset)

    def _free_many_locked(self, objs: list[MemoryObj]) -> None:
        if not self.closed:
            self.allocator.free_many([o.offset for o in objs])

    def _leaked(self, obj: MemoryObj) -> None:
        self.leaks.append(repr(obj))
        if not self.closed:
            self.allocator.free(obj.offset)

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.allocator.free_bytes

    def stats(self) -> dict[str, float]:
        return {"capacity": self.size, "used": self.allocator.used_bytes,
                "objects": self.allocator.num_allocations}

    def close(self) -> None:
        self.closed = True
