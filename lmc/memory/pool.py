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
its memory reclaimed). Invariant mode (:mod:`lmc.memory.invariants`, on in the test suite) also checks
every view's address and extent, that no two live blocks overlap, and that every reference is
released before ``close()``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lmc.lazy_import import LazyModule
from lmc.memory import invariants as _invariants
from lmc.memory.prefault import (
    HUGE,
    PIN_STEP,
    CudaRegistrar,
    PinError,
    Pinner,
    Prefaulter,
    advise_hugepages,
    host_alloc,
    host_limits,
    human_bytes,
    mem_available,
    round_huge,
)
from lmc.memory.tlsf import CheckedTLSFAllocator, TLSFAllocator

if TYPE_CHECKING:
    import torch
else:  # imported at the first tensor: `lmc config` reads backends' options without it
    torch = LazyModule("torch", globals())

NP_INT_VIEW = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
"""Item size -> the numpy integer dtype of that width: views that move bits."""

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

    @classmethod
    def batch(cls, pool: MemoryPool, offsets: Iterable[int], nbytes: int,
              shape: tuple[int, ...], dtype: torch.dtype, num_tokens: int,
              site: _invariants.Site | None) -> list[MemoryObj]:
        """``cls(pool, off, ...)`` for each offset, the same slots set, without a Python
        call per object (a store makes one per chunk: the call costs as much as the rest)."""
        new = object.__new__
        out: list[MemoryObj] = []
        append = out.append
        for off in offsets:
            o = new(cls)
            o.pool = pool
            o.offset = off
            o.nbytes = nbytes
            o.shape = shape
            o.dtype = dtype
            o.num_tokens = num_tokens
            o.meta = None
            o._refs = 1
            o._tensor = None
            o._array = None
            o._site = site
            append(o)
        return out

    @property
    def site(self) -> str | None:
        """Where this object was allocated (debug and invariant modes), as a stack excerpt."""
        return _invariants.format_site(self._site)

    @property
    def tensor(self) -> torch.Tensor:
        """The object's bytes as a tensor of its shape and dtype, made on first use and
        cached (a batch of objects: :meth:`MemoryPool.tensors`, one view for neighbours)."""
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
        """The same bytes as a numpy array of same-width integers (CPU pools), cached; made
        straight from the pool's buffer, never through a tensor (:meth:`MemoryPool.arrays`
        makes a batch's at once)."""
        a = self._array
        if a is None:
            if self._refs <= 0:
                raise RuntimeError("MemoryObj used after its last release")
            a = self._array = self.pool.array_view(self.offset, self.shape, self.dtype)
            if self.pool.invariants:
                self.pool.check_array(self, a)
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

    # The lock is taken by hand, not with ``with``: CPython builds a GC-tracked tuple for
    # each ``__exit__`` call, and one per chunk made a pinned 32k-token lookup pay a
    # garbage collection every few calls (2.6 ms each: 687 -> 426 Mtok/s).
    def acquire(self) -> MemoryObj:
        lock = self.pool.lock
        lock.acquire()
        try:
            if self._refs <= 0:
                raise RuntimeError("acquire() of a MemoryObj that was already freed")
            self._refs += 1
        finally:
            lock.release()
        return self

    def release(self) -> None:
        lock = self.pool.lock
        lock.acquire()
        try:
            if self._refs <= 0:
                raise RuntimeError("release() of a MemoryObj that was already freed "
                                   f"(allocated at {self.site or 'unknown; set debug_leaks'})")
            self._refs -= 1
            if self._refs == 0:
                self._tensor = self._array = None
                self.pool._free_locked(self)
        finally:
            lock.release()

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


class LazyTensors(Sequence["torch.Tensor"]):
    """The tensors of ``objs``, made only when first indexed, then all at once
    (:meth:`MemoryPool.tensors`). Why: a CPU copy reads the objects' numpy arrays and never
    needs them, and a tensor view costs several times what an array view costs."""

    __slots__ = ("_objs", "_tensors")

    def __init__(self, objs: Sequence[MemoryObj]) -> None:
        self._objs = objs
        self._tensors: list[torch.Tensor] | None = None

    def _made(self) -> list[torch.Tensor]:
        t = self._tensors
        if t is None:
            t = self._tensors = self._objs[0].pool.tensors(self._objs) if self._objs else []
        return t

    def __len__(self) -> int:
        return len(self._objs)

    def __getitem__(self, i):  # int or slice, as a list's
        return self._made()[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._made())


class PoolArrays(Sequence[np.ndarray]):
    """Integer numpy views of a batch of objects for a CPU copy, made only as the copy asks.

    ``spans()`` cuts the batch into runs of objects evenly spaced in their pool (one shape
    and dtype: a batch allocated together), each run one strided array ``[m, *shape]``: a
    copy of many chunks then takes one numpy call per layer, and no view is made per object.
    The spans are made here, before the copy starts (a copy's time is its bytes'). Indexing
    gives one object's own ``array`` (made for the whole batch at first use,
    :meth:`MemoryPool.arrays`), for copies that go chunk by chunk."""

    __slots__ = ("_objs", "_arrays", "_spans")

    def __init__(self, objs: Sequence[MemoryObj]) -> None:
        self._objs = objs
        self._arrays: list[np.ndarray] | None = None
        self._spans = objs[0].pool.spans(objs) if objs else []

    def spans(self) -> list[tuple[int, int, np.ndarray]]:
        """``(i, j, a)`` covering the batch in order, ``a[k]`` exactly ``objs[i + k]``'s
        bytes (see :meth:`MemoryPool.spans`)."""
        return self._spans

    def __len__(self) -> int:
        return len(self._objs)

    def __getitem__(self, i):  # int or slice, as a list's
        a = self._arrays
        if a is None:
            a = self._arrays = self._objs[0].pool.arrays(self._objs) if self._objs else []
        return a[i]


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


def _want_pinned(pin: str | bool | None, registrar: Any = None) -> bool:
    if registrar is not None:  # a stand-in register call (tests): pinned unless refused
        return pin not in (False, "false")
    if pin in (None, "auto"):
        return torch.cuda.is_available()
    if pin in (True, "true"):
        if not torch.cuda.is_available():
            raise ValueError("pin_memory=true but CUDA is not available; use 'auto' or 'false'")
        return True
    return False


class PoolTooLarge(ValueError):
    """The pool asked for does not fit this host's memory: the message names both."""


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _too_large(size: int, why: str, setting: str = "local_cpu_size") -> str:
    """``setting``: what the user sets the size with where the pool is made (the daemon's
    ``--size``; the engine's and the demo's ``local_cpu_size``)."""
    total, avail = _mem_total(), mem_available()
    host = ", ".join(x for x in (
        f"{human_bytes(total)} of memory" if total is not None else "",
        f"{human_bytes(avail)} available now" if avail is not None else "") if x)
    return (f"a {human_bytes(size)} memory pool does not fit this host ({why}; the host has "
            f"{host or 'an unknown amount of memory'}): lower {setting}")


def check_fits(size: int, touched: bool = True, setting: str = "local_cpu_size") -> None:
    """Refuse a pool larger than the host's memory before allocating it; warn when (``touched``:
    it will be pre-faulted, every page made resident) it is larger than what is available
    now (other processes may yet free theirs; the kernel will reclaim or kill otherwise).
    Both messages name ``setting``, the size's key or flag where it was given."""
    total, avail = _mem_total(), mem_available()
    if total is not None and size > total:
        raise PoolTooLarge(_too_large(size, "more than all its memory", setting))
    if touched and avail is not None and size > avail:
        log.warning("a %s memory pool is more than this host has available now (%s); "
                    "pre-faulting it may make the kernel reclaim memory or kill a process: "
                    "lower %s", human_bytes(size), human_bytes(avail), setting)


class MemoryPool:
    """A fixed buffer of ``size`` bytes: pinned where CUDA is present, plain otherwise."""

    def __init__(self, size: int, pin_memory: str | bool | None = "auto", align: int = 4096,
                 debug: bool = False, invariants: bool | None = None,
                 prefault: str = "background", hugepages: bool = True,
                 registrar: Any = None, pin_step: int = PIN_STEP) -> None:
        """``invariants``: check views, overlaps and reference balance (see
        :mod:`lmc.memory.invariants`); ``None`` follows ``LMC_DEBUG_INVARIANTS``. ``prefault``:
        ``background`` populates (unpinned) or page-locks (pinned) the pages from the front
        while the caller goes on, ``now`` before returning; ``off`` leaves an unpinned pool's
        first write of each page to fault (a pinned pool is page-locked now). Pinned pools
        are mapped here and registered with ``registrar`` (default: cudaHostRegister through
        torch or CuPy; tests pass a stand-in) in ``pin_step`` steps: the bytes pinned are
        ``size`` rounded up to 2 MiB (see :mod:`lmc.memory.prefault`)."""
        if size < align:
            raise ValueError(f"pool size {size} B is smaller than its alignment {align} B")
        if prefault not in ("background", "now", "off"):
            raise ValueError(f"prefault must be 'background', 'now' or 'off', got {prefault!r}")
        self.pinned = _want_pinned(pin_memory, registrar)
        self._prefault: Prefaulter | None = None
        if self.pinned:
            self.buffer, self._prefault = self._pinned_buffer(
                size, align, hugepages, registrar, pin_step, prefault)
        else:
            check_fits(size, prefault != "off")
            # a mapping of its own, not the allocator's heap: untouched until a prefault or a
            # store writes it (a heap block can come back resident from an earlier owner),
            # 2 MiB-aligned for huge pages, returned to the host when the pool goes
            try:
                if HUGE % align == 0:
                    raw, pages = host_alloc(size, huge=hugepages)
                    huge = pages != "4k"
                else:
                    raw = torch.empty(size + align, dtype=torch.uint8)
                    huge = hugepages and advise_hugepages(raw)
            except (RuntimeError, OSError) as e:  # the host's refusal: a line, not 24
                raise PoolTooLarge(_too_large(size, "the allocator refused it")) from e
            skew = (-raw.data_ptr()) % align  # start on an aligned address (O_DIRECT-ready)
            self.buffer = raw[skew: skew + size]
            if prefault != "off":
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
        self._typed_np: dict[int, np.ndarray] = {}  # itemsize -> the buffer as integers
        self._bytes: memoryview | None = None
        self._live: weakref.WeakSet[MemoryObj] = weakref.WeakSet()
        self.leaks: list[str] = []
        self._lost: list[str] = []  # invariant mode: collected while referenced, not yet judged
        # objects a close() handed to a thread it stopped waiting for (a writer still inside a
        # slow tier's put): referenced, but not leaked -- that thread releases them when its
        # call returns, into this pool even if closed (the buffer lives while they do)
        self._left: weakref.WeakSet[MemoryObj] = weakref.WeakSet()
        self.closed = False

    @staticmethod
    def _pinned_buffer(size: int, align: int, hugepages: bool, registrar: Any, step: int,
                       prefault: str) -> tuple[torch.Tensor, Pinner]:
        """The pool's memory, mapped here and page-locked (in the background or now)."""
        if align > HUGE or HUGE % align:
            raise ValueError(f"a pinned pool's alignment must divide 2 MiB, got {align} B")
        avail = mem_available()
        if avail is not None and round_huge(size) > avail:
            raise PinError(f"cannot page-lock a {human_bytes(size)} pool: more than the host "
                           f"has available ({host_limits()}); lower local_cpu_size or set "
                           "pin_memory=false")
        raw, pages = host_alloc(size, huge=hugepages)
        pinner = Pinner(raw, registrar if registrar is not None else CudaRegistrar(),
                        step=step, huge=pages != "4k", asked=size)
        try:
            if prefault == "background":
                pinner.start()
            else:
                pinner.run()
                pinner.wait(0)
        except BaseException:
            pinner.stop()
            raise
        return raw[:size], pinner

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

    def _typed_array(self, itemsize: int) -> np.ndarray:
        a = self._typed_np.get(itemsize)
        if a is None:
            a = self._typed_np[itemsize] = (
                self.buffer[: self.size // itemsize * itemsize].numpy().view(
                    NP_INT_VIEW[itemsize]))
        return a

    def array_view(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> np.ndarray:
        """``offset``'s bytes as a C-contiguous numpy array of ``shape``, in integers as wide
        as ``dtype`` (moving bits never converts a value): what CPU copies index."""
        item = dtype.itemsize
        n = item
        for d in shape:
            n *= d
        start = offset // item
        return self._typed_array(item)[start: start + n // item].reshape(shape)

    def tensors(self, objs: Sequence[MemoryObj]) -> list[torch.Tensor]:
        """Each object's ``tensor`` (made and cached where missing): a run of objects evenly
        spaced in the pool, of one shape, gets its views from one ``unbind``."""
        return self._batch_views(objs, True)

    def arrays(self, objs: Sequence[MemoryObj]) -> list[np.ndarray]:
        """Each object's ``array`` (made and cached where missing), a run of evenly spaced
        objects' from one reshaped slice: ~0.1 us an object against ~1 us for a tensor."""
        return self._batch_views(objs, False)

    def _batch_views(self, objs: Sequence[MemoryObj], tensor: bool) -> list[Any]:
        views: list[Any] = ([o._tensor for o in objs] if tensor else [o._array for o in objs])
        if all(v is not None for v in views):  # ``None in views`` would compare arrays
            return views
        n = len(objs)
        i = 0
        while i < n:
            if views[i] is not None:
                i += 1
                continue
            o = objs[i]
            if o.pool is not self:
                views[i] = o.tensor if tensor else o.array
                i += 1
                continue
            if o._refs <= 0:
                raise RuntimeError("MemoryObj used after its last release")
            j, step = i + 1, 0
            if j < n and views[j] is None:
                step = objs[j].offset - o.offset
                if step < o.nbytes:
                    step = 0
            if step:
                shape, dtype, prev = o.shape, o.dtype, o.offset
                while j < n and views[j] is None:
                    nxt = objs[j]
                    if (nxt.offset - prev != step or nxt.dtype is not dtype or nxt._refs <= 0
                            or nxt.pool is not self
                            or (nxt.shape is not shape and nxt.shape != shape)):
                        break
                    prev = nxt.offset
                    j += 1
            if tensor:
                ts = self._run_tensors(o.offset, j - i, step, o.shape, o.dtype)
                views[i:j] = ts
                if self.invariants:
                    for k in range(i, j):
                        self.check_view(objs[k], ts[k - i])
                for k in range(i, j):
                    objs[k]._tensor = ts[k - i]
            else:
                arrs = self._run_arrays(o.offset, j - i, step, o.shape, o.dtype)
                views[i:j] = arrs
                if self.invariants:
                    for k in range(i, j):
                        self.check_array(objs[k], arrs[k - i])
                for k in range(i, j):
                    objs[k]._array = arrs[k - i]
            i = j
        return views

    def _run_tensors(self, offset: int, count: int, step: int, shape: tuple[int, ...],
                     dtype: torch.dtype) -> list[torch.Tensor]:
        if count == 1:
            return [self.view(offset, shape, dtype)]
        item = dtype.itemsize
        inner = self.view(offset, shape, dtype)
        typed = self._typed[dtype]  # made by the view above
        return list(typed.as_strided((count, *shape), (step // item, *inner.stride()),
                                     inner.storage_offset()).unbind(0))

    def _run_arrays(self, offset: int, count: int, step: int, shape: tuple[int, ...],
                    dtype: torch.dtype) -> list[np.ndarray]:
        if count == 1:
            return [self.array_view(offset, shape, dtype)]
        return list(self._run_array(offset, count, step, shape, dtype))

    def _run_array(self, offset: int, count: int, step: int, shape: tuple[int, ...],
                   dtype: torch.dtype) -> np.ndarray:
        """``count`` objects of ``shape``, ``step`` bytes apart from ``offset``, as one
        strided integer array ``[count, *shape]`` (each object's part C-contiguous)."""
        typed = self._typed_array(dtype.itemsize)
        strides = [step]
        acc = dtype.itemsize
        for d in reversed(shape):
            strides.insert(1, acc)
            acc *= d
        if count == 1:
            strides[0] = acc  # any stride will do; a whole one keeps the view contiguous
        # one strided view over the run (numpy checks it lies inside the buffer)
        return np.ndarray((count, *shape), typed.dtype, typed, offset, tuple(strides))

    def spans(self, objs: Sequence[MemoryObj]) -> list[tuple[int, int, np.ndarray]]:
        """``(i, j, a)`` covering ``objs`` in order: ``a`` an integer array ``[j - i, *shape]``
        whose ``a[k]`` is exactly ``objs[i + k]``'s bytes (what its ``array`` holds). A run
        of objects of this pool, of one shape and dtype and evenly spaced (a batch allocated
        together: the usual case, recognised with no loop per object) is one strided view;
        nothing is cached on the objects. Refuses an object already released."""
        n = len(objs)
        if not n:
            return []
        o = objs[0]
        shape, dtype = o.shape, o.dtype
        offs = [x.offset for x in objs]
        step = offs[1] - offs[0] if n > 1 else o.nbytes
        if (step >= o.nbytes and min([x._refs for x in objs]) > 0
                and [x.pool for x in objs].count(self) == n
                and [x.shape for x in objs].count(shape) == n
                and [x.dtype for x in objs].count(dtype) == n
                and offs == list(range(offs[0], offs[0] + n * step, step))):
            out = [(0, n, self._run_array(offs[0], n, step, shape, dtype))]
        else:
            out = self._spans_slow(objs)
        if self.invariants:
            for i, j, a in out:
                for k in range(i, j):
                    if objs[k].pool is self:
                        self.check_array(objs[k], a[k - i])
        return out

    def _spans_slow(self, objs: Sequence[MemoryObj]) -> list[tuple[int, int, np.ndarray]]:
        """:meth:`spans` of a batch that is not one run: each run found in turn."""
        out: list[tuple[int, int, np.ndarray]] = []
        n, i = len(objs), 0
        while i < n:
            o = objs[i]
            if o.pool is not self:  # another pool's: its own view
                out.append((i, i + 1, o.array[None]))
                i += 1
                continue
            if o._refs <= 0:
                raise RuntimeError("MemoryObj used after its last release")
            shape, dtype, prev = o.shape, o.dtype, o.offset
            j, step = i + 1, 0
            if j < n:
                step = objs[j].offset - prev
                if step < o.nbytes:
                    step = 0
            while step and j < n:
                q = objs[j]
                if (q.offset - prev != step or q.dtype is not dtype or q._refs <= 0
                        or q.pool is not self or (q.shape is not shape and q.shape != shape)):
                    break
                prev = q.offset
                j += 1
            out.append((i, j, self._run_array(o.offset, j - i, step, shape, dtype)))
            i = j
        return out

    def byte_buffer(self) -> memoryview:
        """The whole buffer as one writable byte memoryview (CPU memory, pinned or not)."""
        mv = self._bytes
        if mv is None:
            mv = self._bytes = self.buffer.numpy().data.cast("B")
        return mv

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, num_tokens: int = 0
                 ) -> MemoryObj | None:
        """An object of ``shape``/``dtype`` holding one reference, or None if nothing fits."""
        objs = self.allocate_many(shape, dtype, 1, num_tokens)
        return objs[0] if objs else None

    def allocate_many(self, shape: Sequence[int], dtype: torch.dtype, count: int,
                      num_tokens: int = 0) -> list[MemoryObj]:
        """Up to ``count`` objects of one shape (fewer when the pool runs out), one lock.
        Their views are made on first use (:meth:`tensors` / :meth:`arrays` for a batch)."""
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
            objs = MemoryObj.batch(self, offs, n, shape, dtype, num_tokens, site)
            if self._sites:
                for o in objs:
                    self._live.add(o)
        pf = self._prefault
        if pf is not None and pf.front < pf.size and max(offs) + n > pf.front:
            try:
                for off in offs:  # past the front: populate (or page-lock) here, not later
                    pf.ensure(off, n)
            except BaseException:  # a pinned pool whose registration failed: nothing leaks
                self.release_many(objs)
                raise
        # No views here: whoever copies makes them in one batch (tensors() / arrays())
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

    def check_array(self, obj: MemoryObj, a: np.ndarray) -> None:
        """Invariant mode: ``a`` is exactly ``obj``'s bytes of this pool, contiguous."""
        want = self.buffer.data_ptr() + obj.offset
        got = a.__array_interface__["data"][0]
        if got != want or a.nbytes != obj.nbytes or not a.flags.c_contiguous:
            raise _invariants.fail(
                f"array of {obj!r} starts at pool+{got - self.buffer.data_ptr()} (want "
                f"pool+{obj.offset}), spans {a.nbytes} B (want {obj.nbytes}), contiguous="
                f"{a.flags.c_contiguous}; allocated at:\n{obj.site}")

    def acquire_many(self, objs: Iterable[MemoryObj]) -> None:
        with self.lock:
            for o in objs:
                if o._refs <= 0:
                    raise RuntimeError("acquire() of a MemoryObj that was already freed")
                o._refs += 1

    def release_many(self, objs: Iterable[MemoryObj]) -> None:
        """``release()`` each object under one lock (inlined: no call or re-entered lock per
        object, a store or retrieve releases every chunk it moved)."""
        dead: list[MemoryObj] = []  # last references: their blocks are freed together
        with self.lock:
            try:
                for o in objs:
                    r = o._refs
                    if o.pool is not self or r <= 0:  # another pool's; or raises (freed)
                        o.release()
                    elif r > 1:
                        o._refs = r - 1
                    else:
                        o._refs = 0
                        o._tensor = o._array = None
                        dead.append(o)
            finally:
                if dead:
                    self._free_many_locked(dead)

    def _free_locked(self, obj: MemoryObj) -> None:
        if not self.closed:
            if self.invariants:
                self._poison(obj.offset)
            self.allocator.free(obj.offset)

    def _free_many_locked(self, objs: list[MemoryObj]) -> None:
        if not self.closed:
            if self.invariants:
                for o in objs:
                    self._poison(o.offset)
            self.allocator.free_many([o.offset for o in objs])

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

    def leave_to_thread(self, objs: list[MemoryObj]) -> None:
        """Declare ``objs`` held by a thread that a bounded close() stopped waiting for: they
        are not reported as leaks when the pool closes (the thread releases them later)."""
        with self.lock:
            for o in objs:
                self._left.add(o)

    def outstanding(self) -> list[tuple[MemoryObj, str | None]]:
        """Live objects and their allocation sites (debug and invariant modes only), less
        those left to a thread at close (``leave_to_thread``)."""
        with self.lock:
            return [(o, o.site) for o in list(self._live) if o._refs > 0 and o not in self._left]

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
                   else {"prefaulted": 0}),
            }

    def prefault_progress(self) -> tuple[int, int]:
        """(bytes pre-faulted or page-locked so far, the pool's size), for a person watching
        start-up; the size both ways when there is nothing to wait for."""
        pf = self._prefault
        if pf is None:
            return self.size, self.size
        return min(pf.front, self.size), self.size

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the whole pool is pre-faulted (unpinned: this thread helps the
        pre-fault thread) or page-locked (pinned), at most ``timeout`` seconds; whether it
        is, i.e. whether stores run at full speed. A failed page-lock raises its PinError."""
        pf = self._prefault
        if pf is None:
            return True
        if isinstance(pf, Pinner):
            return pf.wait(timeout) >= pf.size
        if timeout is not None and timeout <= 0:
            return pf.front >= pf.size
        return pf.finish(timeout)

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
            left = sum(1 for o in list(self._left) if o._refs > 0)
            blocks = self.allocator.num_allocations - left
        if left:
            log.info("memory pool closed with %d object(s) still held by a writer that close "
                     "stopped waiting for; they are freed when its call returns", left)
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
