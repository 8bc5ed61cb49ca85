"""Two-level segregated-fit (TLSF) allocator over an address range: O(1) allocate and free.

Why TLSF: chunk sizes vary (full chunks, partial tails, different models in one daemon), so a
slab allocator would waste memory, and a buddy allocator rounds to powers of two (a 14 MiB
Qwen2-7B chunk would take 16 MiB). TLSF keeps free blocks in size classes -- a power-of-two
first level split into ``2**SL_BITS`` linear second-level classes -- found with two bitmap
scans, and coalesces physical neighbours on free, so external fragmentation stays low
(measured by ``tests/memory/test_allocator.py``) and every operation is constant time.

The allocator hands out offsets only; it does not own memory. Sizes are in bytes, rounded up
to ``align`` (4 KiB by default so that pool memory can feed O_DIRECT I/O unchanged).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

from lmc.memory import invariants

SL_BITS = 4
SL_COUNT = 1 << SL_BITS


def _msb(x: int) -> int:
    return x.bit_length() - 1


def _lsb(x: int) -> int:
    return (x & -x).bit_length() - 1


class TLSFAllocator:
    """Not thread-safe by itself; the memory pool serialises calls."""

    def __init__(self, size: int, align: int = 4096) -> None:
        if align < 1 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.align = align
        self.units = size // align  # capacity in allocation units
        if self.units < 1:
            raise ValueError(f"allocator of {size} bytes is smaller than one unit ({align} B)")
        self.capacity = self.units * align
        self._fl_bitmap = 0
        self._sl_bitmap: dict[int, int] = {}
        # Per size class, its free blocks in insertion order (the first is handed out). An
        # OrderedDict, not a dict: a dict's first item is found by scanning past the holes its
        # deletions leave, O(blocks ever freed there) once a class held many (seen: ~0.1 ms
        # per allocation in a store that evicts); the OrderedDict's is O(1).
        self._lists: dict[tuple[int, int], OrderedDict[int, None]] = {}
        self._free_by_start: dict[int, int] = {}   # unit offset -> units
        self._free_by_end: dict[int, int] = {}     # unit end -> unit offset
        self._used: dict[int, int] = {}            # unit offset -> units
        self.used_bytes = 0
        self._insert(0, self.units)

    # ------------------------------------------------------------ size classes
    @staticmethod
    def _mapping(units: int) -> tuple[int, int]:
        if units < SL_COUNT:
            return 0, units
        m = _msb(units)
        return m - SL_BITS + 1, (units >> (m - SL_BITS)) - SL_COUNT

    @classmethod
    def _search_class(cls, units: int) -> tuple[int, int]:
        """The smallest class whose every block is >= ``units`` (round up, then map)."""
        if units >= SL_COUNT:
            units += (1 << (_msb(units) - SL_BITS)) - 1
        return cls._mapping(units)

    def _insert(self, off: int, units: int) -> None:
        fl, sl = self._mapping(units)
        lst = self._lists.get((fl, sl))
        if lst is None:
            lst = self._lists[(fl, sl)] = OrderedDict()
        lst[off] = None
        self._fl_bitmap |= 1 << fl
        self._sl_bitmap[fl] = self._sl_bitmap.get(fl, 0) | (1 << sl)
        self._free_by_start[off] = units
        self._free_by_end[off + units] = off

    def _remove(self, off: int, units: int) -> None:
        fl, sl = self._mapping(units)
        lst = self._lists[(fl, sl)]
        del lst[off]
        if not lst:
            bits = self._sl_bitmap[fl] & ~(1 << sl)
            self._sl_bitmap[fl] = bits
            if not bits:
                self._fl_bitmap &= ~(1 << fl)
        del self._free_by_start[off]
        del self._free_by_end[off + units]

    # ----------------------------------------------------------------- public
    def allocate(self, nbytes: int) -> int | None:
        """Byte offset of a block of at least ``nbytes``, or None when no free block fits."""
        if nbytes <= 0:
            raise ValueError(f"allocation size must be > 0, got {nbytes}")
        units = -(-nbytes // self.align)
        if units > self.units:
            return None
        fl, sl = self._search_class(units)
        bits = self._sl_bitmap.get(fl, 0) & (-1 << sl)
        if not bits:
            upper = self._fl_bitmap & (-1 << (fl + 1))
            if not upper:
                return None
            fl = _lsb(upper)
            bits = self._sl_bitmap[fl]
        sl = _lsb(bits)
        off = next(iter(self._lists[(fl, sl)]))
        size = self._free_by_start[off]
        self._remove(off, size)
        if size > units:
            self._insert(off + units, size - units)
        self._used[off] = units
        self.used_bytes += units * self.align
        return off * self.align

    def allocate_many(self, nbytes: int, count: int) -> list[int]:
        """Offsets of up to ``count`` blocks of ``nbytes``; fewer when the space runs out.

        Tries one free block large enough for all of them first (one search, neighbouring
        blocks: a batch of chunks then moves with fewer, larger copies), else allocates one by
        one. Each block is freed on its own, exactly as if allocated singly.
        """
        if count <= 0:
            return []
        units = -(-nbytes // self.align)
        whole = self.allocate(units * count * self.align) if count > 1 else None
        if whole is None:
            out = []
            for _ in range(count):
                off = self.allocate(nbytes)
                if off is None:
                    break
                out.append(off)
            return out
        base = whole // self.align
        del self._used[base]
        used = self._used
        for i in range(count):
            used[base + i * units] = units
        return [(base + i * units) * self.align for i in range(count)]

    def free(self, offset: int) -> None:
        """Return a block; it merges with free physical neighbours."""
        off = offset // self.align
        units = self._used.pop(off, None)
        if units is None or offset % self.align:
            raise ValueError(f"free of offset {offset}, which is not an allocated block")
        self._release_run(off, units)

    def _release_run(self, off: int, units: int) -> None:
        """Put ``units`` used units at ``off`` back, merged with free physical neighbours."""
        self.used_bytes -= units * self.align
        nxt = self._free_by_start.get(off + units)
        if nxt is not None:
            self._remove(off + units, nxt)
            units += nxt
        prev = self._free_by_end.get(off)
        if prev is not None:
            prev_units = self._free_by_start[prev]
            self._remove(prev, prev_units)
            off, units = prev, units + prev_units
        self._insert(off, units)

    def free_many(self, offsets: list[int]) -> None:
        """``free`` each block; neighbouring ones (a batch allocated together, evicted or
        released together) are merged first and enter the free lists once per run, not once
        per block. Every offset is checked before anything is freed."""
        align, used = self.align, self._used
        units_of: dict[int, int] = {}
        for offset in offsets:
            off = offset // align
            if offset % align or off not in used or off in units_of:
                raise ValueError(f"free of offset {offset}, which is not an allocated block")
            units_of[off] = used[off]
        runs: list[list[int]] = []  # [start, units] of runs of adjacent blocks
        for off in sorted(units_of):
            units = units_of[off]
            del used[off]
            if runs and runs[-1][0] + runs[-1][1] == off:
                runs[-1][1] += units
            else:
                runs.append([off, units])
        for off, units in runs:
            self._release_run(off, units)

    def block_size(self, offset: int) -> int:
        return self._used[offset // self.align] * self.align

    # ------------------------------------------------------------------ stats
    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def largest_free(self) -> int:
        """Bytes of the largest free block (scans one size class, for stats only)."""
        if not self._fl_bitmap:
            return 0
        fl = _msb(self._fl_bitmap)
        sl = _msb(self._sl_bitmap[fl])
        return max(self._free_by_start[o] for o in self._lists[(fl, sl)]) * self.align

    def fragmentation(self) -> float:
        """1 - largest free block / all free bytes: 0 when free space is one block."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free() / free

    @property
    def num_allocations(self) -> int:
        return len(self._used)


class CheckedTLSFAllocator(TLSFAllocator):
    """TLSF that proves every block it hands out overlaps no live block (invariant mode).

    Keeps the live blocks' starts sorted, so each check is two neighbour comparisons; the
    plain allocator pays nothing for it.
    """

    def __init__(self, size: int, align: int = 4096) -> None:
        super().__init__(size, align)
        self._starts: list[int] = []  # unit offsets of live blocks, sorted
        self._batch = False  # inside allocate_many: its pieces are checked once, at the end

    def _track(self, off: int) -> None:
        starts, used = self._starts, self._used
        i = bisect.bisect_left(starts, off)
        end = off + used[off]
        if i < len(starts) and starts[i] == off:
            raise invariants.fail(f"allocator handed out units [{off}, {end}), whose start is "
                                  f"already a live block's")
        if end > self.units:
            raise invariants.fail(f"allocator handed out units [{off}, {end}) past its "
                                  f"capacity of {self.units}")
        if i > 0 and starts[i - 1] + used[starts[i - 1]] > off:
            p = starts[i - 1]
            raise invariants.fail(f"allocator handed out units [{off}, {end}), overlapping "
                                  f"the live block [{p}, {p + used[p]})")
        if i < len(starts) and starts[i] < end:
            n = starts[i]
            raise invariants.fail(f"allocator handed out units [{off}, {end}), overlapping "
                                  f"the live block [{n}, {n + used[n]})")
        starts.insert(i, off)

    def allocate(self, nbytes: int) -> int | None:
        off = super().allocate(nbytes)
        if off is not None and not self._batch:
            self._track(off // self.align)
        return off

    def allocate_many(self, nbytes: int, count: int) -> list[int]:
        self._batch = True
        try:
            offs = super().allocate_many(nbytes, count)
        finally:
            self._batch = False
        for off in offs:  # each piece against its live neighbours (and the one before it)
            self._track(off // self.align)
        return offs

    def free(self, offset: int) -> None:
        super().free(offset)
        self._untrack(offset)

    def free_many(self, offsets: list[int]) -> None:
        super().free_many(offsets)
        for offset in offsets:
            self._untrack(offset)

    def _untrack(self, offset: int) -> None:
        off = offset // self.align
        i = bisect.bisect_left(self._starts, off)
        if i == len(self._starts) or self._starts[i] != off:
            raise invariants.fail(f"freed units at {off}, which the check never saw handed out")
        del self._starts[i]
