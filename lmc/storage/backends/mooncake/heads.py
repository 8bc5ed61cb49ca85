"""Registered memory for values' heads (the :mod:`lmc.storage.framing` header and tag).

Why: a value is ``[head][payload]``, written in one call from two spans (the head from
here, the payload straight from the pool object) and read in two steps (the heads first, to
learn each value's shape before allocating, then the payloads straight into pool objects).
Transfers over RDMA need registered memory on both ends, so the heads get a region of their
own, registered once, cut into slabs of ``per_slab`` heads; a call takes a slab per group of
keys and gives it back when the library returned (an abandoned call's worker gives it back).
Bounded: ``slabs`` slabs in all, a call waiting for one at most until its deadline.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time


class HeadArena:
    """``slabs`` slabs of ``per_slab`` heads of ``head_size`` bytes each, one mapping."""

    def __init__(self, head_size: int, per_slab: int = 512, slabs: int = 16) -> None:
        if head_size <= 0 or per_slab <= 0 or slabs <= 0:
            raise ValueError(f"HeadArena: sizes must be > 0, got {head_size}, {per_slab}, "
                             f"{slabs}")
        self.head_size = head_size
        self.per_slab = per_slab
        self.slab_bytes = head_size * per_slab
        self.size = self.slab_bytes * slabs
        self._mem = mmap.mmap(-1, self.size)
        self._view = memoryview(self._mem)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mem))
        self._free = list(range(slabs))
        self._cond = threading.Condition()

    def take(self, deadline: float) -> int | None:
        """A free slab's index, waiting at most until ``deadline`` (``time.monotonic()``)."""
        with self._cond:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._free.pop()

    def give(self, slab: int) -> None:
        with self._cond:
            self._free.append(slab)
            self._cond.notify()

    def ptr(self, slab: int, i: int = 0) -> int:
        """Address of head ``i`` of ``slab``."""
        return self.base + slab * self.slab_bytes + i * self.head_size

    def view(self, slab: int, count: int) -> memoryview:
        """The first ``count`` heads of ``slab`` as one writable byte view."""
        start = slab * self.slab_bytes
        return self._view[start: start + count * self.head_size]

    @property
    def free_slabs(self) -> int:
        with self._cond:
            return len(self._free)
