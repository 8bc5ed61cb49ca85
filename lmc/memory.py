"""The process's KV memory: one buffer allocated once, carved by TLSF into ``MemoryObj`` views.

Why one buffer: pinned (page-locked) memory is expensive to allocate and register, and an
allocation per chunk from the OS would fragment the heap and stall the engine. Every chunk of
every tier passes through this pool.

Ownership is explicit. ``pool.allocate`` returns an object holding one reference, owned by the
caller. Whoever keeps the object (a tier, a pending transfer) calls ``acquire()``; whoever is
done calls ``release()``; the memory returns to the pool at zero. A tier evicts only objects
it alone references, so nothing in use is ever evicted or reused. ``with obj:`` and
:class:`Lease` release on exit. In debug mode every object records where it was allocated and
an object garbage-collected while still referenced is reported as a leak with that site (and
its memory reclaimed). Invariant mode (:mod:`lmc.invariants`, on in the test suite) also checks
every view's address and extent, that no two live blocks overlap, and that every reference is
released before ``close()``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from lmc import invariants as _invariants
from lmc.allocator import CheckedTLSFAllocator, TLSFAllocator
from lmc.prefault import Prefaulter, advise_hugepages
from lmc.transfer import int_view

log = logging.getLogger(__name__)
POISON = 0xFF  # invariant mode: the byte freed blocks are filled with


class MemoryObj:
    """A contiguous tensor view into the pool plus a reference count and metadata."""

    __slots__ = ("pool", "offset", "nbytes", "shape", "dtype", "num_tokens", "meta",
                 "_refs", "_tensor", "_array", "_site", "__weakref__")

    def __init__(self, pool: MemoryPool, offset: int, nbytes: int, shape: tuple[int, ...],
                 dtype: torch.dtype, num_tokens: int, site: _invariants.Site | None) -> None:
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.shape = shape
        self.dtype = dtype
        self.num_tokens = num_tokens
        self.meta: Any = None
        self._refs = 1
        self._tensor: torch.Tensor | None = None
        self._array: np.ndarray | None = None
        self._site = site

    @property
    def site(self) -> str | None:
        """Where this object was allocated (debug and invariant modes), as a stack excerpt."""
        return _invariants.format_site(self._site)

    @property
    def tensor(self) -> torch.Tensor:
        t = self._tensor
        if t is None:
            if self._refs <= 0:
                raise RuntimeError("MemoryObj used after its last release")
            t = self._tensor = self.pool.view(self.offset, self.shape, self.dtype)
            if self.pool.invariants:
                self.pool.check_view(self, t)
        return t

    @property
    def array(self) -> np.ndarray:
        """The same bytes as a numpy array of same-width integers (CPU pools), cached."""
        a = self._array
        if a is None:
            a = self._array = int_view(self.tensor)
        return a

    def byte_view(self, extent: int | None = None) -> memoryview:
        """The object's bytes (``extent`` of them, up to its block: O_DIRECT pads) as a
        writable slice of one cached memoryview of a CPU pool's buffer: zero-copy, no tensor
        made per call (tier I/O hot paths). Refuses an object already freed: a read from a
        tier into a released block would corrupt whatever the pool reuses it for."""
        if self._refs <= 0:
            raise RuntimeError(f"byte_view() of {self!r} after its last release")
        n = self.nbytes if extent is None else extent
        if n > self.nbytes and n > self.pool.allocator.block_size(self.offset):
            raise ValueError(f"byte_view({extent}) of {self!r} runs past its "
                             f"{self.pool.allocator.block_size(self.offset)} B block")
        return self.pool.byte_buffer()[self.offset: self.offset + n]

    def io_spans(self, align: int = 4096) -> tuple[memoryview, memoryview] | None:
        """The object's bytes cut for direct (O_DIRECT) I/O: ``(head, tail)``, ``head`` its
        leading whole ``align``-byte units starting at an ``align``-aligned address, ``tail``
        the rest (under ``align`` bytes, maybe empty), both slices of :meth:`byte_view`.
        ``None`` when the object does not start aligned (the tier then does buffered I/O).

        Why: a tier moves ``head`` between the device and pool memory with no copy and pads
        ``tail`` in a buffer of its own, so it never reads or writes past ``nbytes`` and never
        needs to know how big the allocator's block is."""
        if align <= 0 or align & (align - 1):
            raise ValueError(f"io_spans: align must be a power of two, got {align}")
        view = self.byte_view()
        if (self.pool.buffer.data_ptr() + self.offset) % align:
            return None
        cut = self.nbytes - self.nbytes % align
        return view[:cut], view[cut:]

    @property
    def ref_count(self) -> int:
        return self._refs

    def acquire(self) -> MemoryObj:
        with self.pool.lock:
            if self._refs <= 0:
                raise RuntimeError("acquire() of a MemoryObj that was already freed")
            self._refs += 1
        return self

    def release(self) -> None:
        with self.pool.lock:
            if self._refs <= 0:
                raise RuntimeError("release() of a MemoryObj that was already freed "
                                   f"(allocated at {self.site or 'unknown; set debug_leaks'})")
            self._refs -= 1
            if self._refs == 0:
                self._tensor = self._array = None
                self.pool._free_locked(self)

    def __enter__(self) -> MemoryObj:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if self._refs > 0:
            with contextlib.suppress(Exception):  # interpreter shutdown: nowhere to report
                self.pool._leaked(self)

    def __repr__(self) -> str:
        return (f"MemoryObj(offset={self.offset}, shape={self.shape}, dtype={self.dtype}, "
                f"tokens={self.num_tokens}, refs={self._refs})")


class Lease:
    """Releases a batch of objects on exit: ``with Lease(objs): ...``."""

    def __init__(self, objs: Iterable[MemoryObj | None]) -> None:
        self.objs = [o for o in objs if o is not None]

    def __enter__(self) -> list[MemoryObj]:
        return self.objs

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        objs, self.objs = self.objs, []
        if objs:
            objs[0].pool.release_many(objs)


def _want_pinned(pin: str | bool | None) -> bool:
    if pin in (None, "auto"):
        return torch.cuda.is_available()
    if pin in (True, "true"):
        if not torch.cuda.is_available():
            raise ValueError("pin_memory=true but CUDA is not available; use 'auto' or 'false'")
        return True
    return False


class MemoryPool:
    """A fixed buffer of ``size`` bytes: pinned where CUDA is present, plain otherwise."""

    def __init__(self, size: int, pin_memory: str | bool | None = "auto", align: int = 4096,
                 debug: bool = False, invariants: bool | None = None,
                 prefault: str = "background", hugepages: bool = True) -> None:
        """``invariants``: check views, overlaps and reference balance (see
        :mod:`lmc.invariants`); ``None`` follows ``LMC_DEBUG_INVARIANTS``. ``prefault``
        (unpinned pools; pinning faults every page already): ``background`` populates the
        pages from the front while the caller goes on, ``now`` before returning, ``off``
        leaves the first write of each page to fault (see :mod:`lmc.prefault`)."""
        if size < align:
            raise ValueError(f"pool size {size} B is smaller than its alignment {align} B")
        if prefault not in ("background", "now", "off"):
            raise ValueError(f"prefault must be 'background', 'now' or 'off', got {prefault!r}")
        self.pinned = _want_pinned(pin_memory)
        raw = torch.empty(size + align, dtype=torch.uint8, pin_memory=self.pinned)
        # 2 MiB pages: fewer faults and TLB misses on chunk copies
        huge = hugepages and not self.pinned and advise_hugepages(raw)
        skew = (-raw.data_ptr()) % align  # start on an aligned address (O_DIRECT-ready)
        self.buffer = raw[skew: skew + size]
        self._prefault: Prefaulter | None = None
        if prefault != "off" and not self.pinned:
            self._prefault = Prefaulter(self.buffer, huge=huge)
            if prefault == "now":  # nothing handed out yet: zeroing is a safe fallback
                self._prefault.run(fallback_touch=True)
            else:
                self._prefault.start()
        self.invariants = _invariants.enabled_by_env() if invariants is None else invariants
        self.allocator = (CheckedTLSFAllocator if self.invariants else TLSFAllocator)(size, align)
        if self.invariants:
            _invariants.note_pool()
        self.size = self.allocator.capacity
        self.lock = threading.RLock()
        self.debug = debug
        self._sites = debug or self.invariants  # record allocation sites, track live objects
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._bytes: memoryview | None = None
        self._live: weakref.WeakSet[MemoryObj] = weakref.WeakSet()
        self.leaks: list[str] = []
        self._lost: list[str] = []  # invariant mode: collected while referenced, not yet judged
        self.closed = False

    # ---------------------------------------------------------------- memory
    def view(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        typed = self._typed.get(dtype)
        if typed is None:
            item = dtype.itemsize
            typed = self._typed[dtype] = self.buffer[: self.size // item * item].view(dtype)
        item = typed.element_size()
        strides, acc = [], 1
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        # as_strided's offset counts from the storage's start, not from this view's
        return typed.as_strided(tuple(shape), tuple(reversed(strides)),
                                typed.storage_offset() + offset // item)

    def byte_buffer(self) -> memoryview:
        """The whole buffer as one writable byte memoryview (CPU memory, pinned or not)."""
        mv = self._bytes
        if mv is None:
            mv = self._bytes = memoryview(self.buffer.numpy()).cast("B")
        return mv

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, num_tokens: int = 0
                 ) -> MemoryObj | None:
        """An object of ``shape``/``dtype`` holding one reference, or None if nothing fits."""
        objs = self.allocate_many(shape, dtype, 1, num_tokens)
        return objs[0] if objs else None

    def allocate_many(self, shape: Sequence[int], dtype: torch.dtype, count: int,
                      num_tokens: int = 0) -> list[MemoryObj]:
        """Up to ``count`` objects of one shape (fewer when the pool runs out), one lock.

        Neighbouring objects (the usual case) get their tensor views from one ``unbind``.
        """
        shape = tuple(shape)
        n = dtype.itemsize
        for d in shape:
            n *= d
        if n <= 0:
            raise ValueError(f"cannot allocate an empty object of shape {shape}")
        with self.lock:
            if self.closed:
                raise RuntimeError("allocate() on a closed MemoryPool")
            offs = self.allocator.allocate_many(n, count)
            if not offs:
                return []
            site = _invariants.capture_site(1) if self._sites else None
            objs = [MemoryObj(self, off, n, shape, dtype, num_tokens, site) for off in offs]
            if self._sites:
                for o in objs:
                    self._live.add(o)
        pf = self._prefault
        if pf is not None and pf.front < pf.size and max(offs) + n > pf.front:
            for off in offs:  # past the pre-fault's front: populate here, not in the copy
                pf.ensure(off, n)
        step = self.allocator.block_size(offs[0])
        if len(offs) > 1 and step == n and all(
                b - a == step for a, b in zip(offs, offs[1:])):
            # one block carved into neighbours, every one right after the previous (a
            # fragmented pool can return e.g. [0, 10, 2]: first and last alone prove nothing):
            # all views from one call
            for o, t in zip(objs, self.view(offs[0], (len(offs), *shape), dtype).unbind(0)):
                o._tensor = t
                if self.invariants:
                    self.check_view(o, t)
        return objs

    def check_view(self, obj: MemoryObj, t: torch.Tensor) -> None:
        """Invariant mode: ``t`` is exactly ``obj``'s bytes of this pool, inside its block."""
        want = self.buffer.data_ptr() + obj.offset
        nbytes = t.numel() * t.element_size()
        if t.data_ptr() != want or nbytes != obj.nbytes or not t.is_contiguous():
            raise _invariants.fail(
                f"view of {obj!r} starts at pool+{t.data_ptr() - self.buffer.data_ptr()} "
                f"(want pool+{obj.offset}), spans {nbytes} B (want {obj.nbytes}), "
                f"contiguous={t.is_contiguous()}; allocated at:\n{obj.site}")
        block = self.allocator.block_size(obj.offset)
        if obj.offset + obj.nbytes > self.size or obj.nbytes > block:
            raise _invariants.fail(f"{obj!r} of {obj.nbytes} B overruns its {block} B block "
                                   f"or the {self.size} B pool")

    def acquire_many(self, objs: Iterable[MemoryObj]) -> None:
        with self.lock:
            for o in objs:
                if o._refs <= 0:
                    raise RuntimeError("acquire() of a MemoryObj that was already freed")
                o._refs += 1

    def release_many(self, objs: Iterable[MemoryObj]) -> None:
        """``release()`` each object under one lock."""
        with self.lock:
            for o in objs:
                o.release()

    def _free_locked(self, obj: MemoryObj) -> None:
        if not self.closed:
            if self.invariants:
                self._poison(obj.offset)
            self.allocator.free(obj.offset)

    def _poison(self, offset: int) -> None:
        """Invariant mode: fill a block being freed with 0xFF bytes (NaN in every float
        dtype), so a copy that reads an object after its last release moves garbage that a
        bit-exact check sees, never the stale but still correct KV that would hide it."""
        self.buffer[offset: offset + self.allocator.block_size(offset)].fill_(POISON)

    def _leaked(self, obj: MemoryObj) -> None:
        """Called from ``MemoryObj.__del__``: report, then reclaim the memory."""
        with self.lock:
            if self.closed:
                return
            msg = (f"leaked {obj!r}: garbage-collected with {obj._refs} reference(s) held; "
                   f"allocated at:\n{obj.site or '(enable debug_leaks to record the site)'}")
            self.leaks.append(msg)
            if self.debug:
                log.warning(msg)
            if self.invariants:  # a leak only if the pool lives on (see lost_references)
                self._lost.append(msg)
                _invariants.watch(self)
            obj._refs = 0
            if self.invariants:
                self._poison(obj.offset)
            self.allocator.free(obj.offset)

    def lost_references(self) -> list[str]:
        """Invariant mode: objects collected while still referenced, since the last call.

        Judged when the pool closes, or when the test harness asks while the pool is alive:
        then the pool lost that memory for good. A pool dropped whole (an engine garbage-
        collected without ``close()``, its tier's references with it) lost nothing.
        """
        with self.lock:
            out, self._lost = self._lost, []
        return out

    def outstanding(self) -> list[tuple[MemoryObj, str | None]]:
        """Live objects and their allocation sites (debug and invariant modes only)."""
        with self.lock:
            return [(o, o.site) for o in list(self._live) if o._refs > 0]

    # ----------------------------------------------------------------- stats
    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.allocator.free_bytes

    def stats(self) -> dict[str, float]:
        with self.lock:
            return {
                "capacity": self.size,
                "used": self.allocator.used_bytes,
                "objects": self.allocator.num_allocations,
                "fragmentation": self.allocator.fragmentation(),
                "pinned": float(self.pinned),
                **(self._prefault.stats() if self._prefault is not None
                   else {"prefaulted": self.size if self.pinned else 0}),
            }

    def close(self) -> None:
        """Refuse further allocations. Objects still referenced are reported (``leaks``;
        a violation in invariant mode): every reference must be released before this."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        if self._prefault is not None:
            self._prefault.stop()
        with self.lock:
            live = self.outstanding()
            blocks = self.allocator.num_allocations
        for msg in self.lost_references():
            _invariants.report(msg)
        if blocks and not self._sites:  # untracked: the count, without sites
            msg = (f"MemoryPool closed with {blocks} block(s) still referenced "
                   f"(set debug_leaks to record where they were allocated)")
            self.leaks.append(msg)
            log.warning(msg)
        elif live:
            sites = "\n".join(f"{o!r} allocated at:\n{site}" for o, site in live[:8])
            msg = (f"MemoryPool closed with {len(live)} object(s) still referenced "
                   f"(first {min(len(live), 8)}):\n{sites}")
            self.leaks.append(msg)
            log.warning(msg)
            if self.invariants:
                _invariants.report(msg)
