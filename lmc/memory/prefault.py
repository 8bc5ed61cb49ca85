"""Pre-faulting a memory pool: paying each page's first-touch cost before a store does.

Why: a fresh pool is untouched virtual memory, so the first write into every page takes a page
fault, and a store into a fresh 4 GiB pool ran at 0.02-0.23 of a copy into faulted memory.

How: the pages are faulted in from offset 0 upwards in 64 MiB steps by a background thread
(nice +5) while the engine loads its model, and whoever reports the engine ready waits for
it (``MemoryPool.wait_ready``: the reference server's ``/health`` says 503 with the progress
until then), so "ready" means full speed. Which way of faulting is fastest differs by host,
so it is measured on the pool's first 128 MiB at start (:class:`FaultRates`):
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+; keeps contents, so safe on memory in use),
or zeroing with ``memset`` (only steps nobody was handed: an allocation past the front claims
its steps and waits for one being zeroed under it). A store that arrives before the front
reaches it populates its own block only where populating and then copying is faster than
letting its copy fault the pages (measured: on one VM madvise ran at 0.5-3.4 GiB/s, a copy
into fresh pages at 5.2-6.9; on another madvise at 15-20, the copy at 0.5-1.6).

The daemon runs the same code synchronously before it serves (``run()``). Progress: log lines
(sizes and durations in human units; "stores run at full speed from now" when done),
``front`` / ``stats()`` for pool stats, and the process-wide Prometheus gauge
``lmc_pool_prefaulted_bytes``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge

from lmc.lazy_import import LazyModule
from lmc.memory import pinned_ranges
from lmc.metrics import pool_gauge
from lmc.priority import lower_thread_priority

if TYPE_CHECKING:
    import torch
else:  # imported at the first buffer (lmc.lazy_import says why)
    torch = LazyModule("torch", globals())

log = logging.getLogger(__name__)
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
PAGE = 4096
STEP = 64 << 20
_libc: Any = None
_populate_ok: bool | None = None  # None: not tried yet; False: the kernel refused it


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: for log lines a person reads."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    """``0.0123`` -> ``'12 ms'``, ``75`` -> ``'1 min 15 s'``."""
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 60:
        return f"{s:.2f} s"
    return f"{int(s // 60)} min {s % 60:.0f} s"


def _c() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
        _libc.memset.restype = ctypes.c_void_p
        _libc.memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        _libc.memmove.restype = ctypes.c_void_p
    return _libc


def advise_hugepages(buf: torch.Tensor) -> bool:
    """Ask for transparent huge pages over ``buf`` (Linux; a no-op elsewhere).

    2 MiB pages: 512 times fewer faults and fewer TLB misses on chunk copies (refilling a
    touched pool measured ~20% faster here). The kernel may compact memory to find them,
    which can make populating slower (0.2-3.4 s per GiB measured here against ~0.7 s with
    4 KiB pages under load), hence a switch."""
    try:
        addr = buf.data_ptr()
        start = -(-addr // PAGE) * PAGE
        length = (addr + buf.numel() * buf.element_size() - start) // PAGE * PAGE
        if length <= 0:
            return False
        return _c().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length),
                            MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def populate(addr: int, nbytes: int) -> bool:
    """Fault in ``[addr, addr + nbytes)`` (widened to whole pages) for writing, contents kept.
    False when the kernel lacks ``MADV_POPULATE_WRITE`` (or this is not Linux)."""
    global _populate_ok
    if _populate_ok is False or nbytes <= 0:
        return bool(_populate_ok) or nbytes <= 0
    try:
        libc = _c()
    except (OSError, AttributeError):
        _populate_ok = False
        return False
    start = addr // PAGE * PAGE
    end = -(-(addr + nbytes) // PAGE) * PAGE
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                     MADV_POPULATE_WRITE) == 0:
        _populate_ok = True
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):  # kernel < 5.14, or a sandbox
        _populate_ok = False
        return False
    # ENOMEM (no memory now) or EFAULT: this range stays unfaulted; a copy faults it later
    log.debug("madvise(MADV_POPULATE_WRITE) of %s at %#x failed: %s", human_bytes(nbytes),
              addr, errno.errorcode.get(err, err))
    return False


@dataclasses.dataclass(frozen=True)
class FaultRates:
    """Bytes per second of the ways to fault fresh pages in, measured on the pool itself at
    start (:meth:`Prefaulter.calibrate`): which is faster differs by host. Measured: one VM
    populated at 0.5-3.4 GiB/s while zeroing ran at 3-9.6 and a copy into fresh pages at
    5.2-6.9; another (transparent huge pages) populated at 15-20 GiB/s while a copy into
    fresh pages ran at 0.5-1.6."""

    populate: float    # madvise(MADV_POPULATE_WRITE)
    zero: float        # memset of fresh pages
    copy_fresh: float  # memcpy into fresh pages (what a store does without a pre-fault)
    copy_warm: float   # memcpy into faulted pages (the store's own cost)

    @property
    def method(self) -> str:
        """How the pre-fault thread faults pages: the faster of populate and zeroing."""
        return "populate" if self.populate >= self.zero else "zero"

    @property
    def ensure_populates(self) -> bool:
        """Should a store's block past the front be populated before its copy? Only when
        populating and then copying beats letting the copy fault the pages itself."""
        return 1 / self.populate + 1 / self.copy_warm < 1 / self.copy_fresh

    def describe(self) -> str:
        return (f"populate {human_bytes(self.populate)}/s, zeroing {human_bytes(self.zero)}/s, "
                f"a copy into fresh pages {human_bytes(self.copy_fresh)}/s (into faulted "
                f"pages {human_bytes(self.copy_warm)}/s)")


CALIBRATE = 32 << 20  # bytes per measurement of calibrate(): ~4x this, a few ms to ~0.2 s


class Prefaulter:
    """Faults ``buf`` in from its start: in the background (``start()``) or now (``run()``).

    ``front``: bytes ``[0, front)`` are done (faulted in, or left to the copy of the block
    that claimed them). Work is handed out in ``step``s from a cursor. How pages are faulted
    is measured at start (:class:`FaultRates`): by ``madvise(MADV_POPULATE_WRITE)``, which
    keeps contents, or by zeroing, which may only touch steps nobody was handed out -- so
    an allocation past the front (``ensure``) claims the steps up to its end for its own copy
    and waits for a step the thread is zeroing under it. A block inside the front costs one
    comparison.
    """

    def __init__(self, buf: torch.Tensor, name: str = "memory pool", step: int = STEP,
                 huge: bool = False, rates: FaultRates | None = None) -> None:
        if step < PAGE or step % PAGE:
            raise ValueError(f"pre-fault step must be a multiple of {PAGE} B, got {step}")
        self.name = name
        self.addr = buf.data_ptr()
        self.size = buf.numel() * buf.element_size()
        self.step = step
        self.huge = huge
        self.rates = rates
        self.method = rates.method if rates is not None else "populate"
        self.ensure_populates = rates.ensure_populates if rates is not None else True
        self.front = 0  # [0, front) done
        self.faulted = 0  # bytes this pre-fault faulted in (steps left to a copy excluded)
        self.seconds = 0.0  # from the start until the front's last advance
        self.done = threading.Event()  # the front reached the end, or the pre-fault stopped
        self._cursor = 0  # [0, cursor) handed out to some thread
        self._finished: dict[int, int] = {}  # steps done beyond the front: start -> n
        self._busy: dict[int, int] = {}  # steps being worked on now: start -> n
        self._mu = threading.Lock()
        self._advanced = threading.Condition(self._mu)  # the front moved
        self._stop = threading.Event()
        self._stop_counted = False
        self._thread: threading.Thread | None = None
        self._keep = buf  # the memory must outlive the thread
        self._t0 = time.perf_counter()
        self._last_log = self._t0
        self._next_log = self.size / 10

    # ------------------------------------------------------------------ paths
    gauge_name = "lmc_pool_prefaulted_bytes"

    @property
    def gauge(self) -> Gauge:
        return pool_gauge(self.gauge_name)

    def calibrate(self) -> FaultRates | None:
        """Measure :class:`FaultRates` on the first ``4 * CALIBRATE`` bytes (which it faults
        in) and choose the method; None (defaults kept) for a small buffer or when the
        kernel cannot populate. Only before anything is handed out of the buffer."""
        if self.rates is not None or self.size < 8 * CALIBRATE or self._cursor:
            return self.rates
        c = CALIBRATE
        libc = _c()
        t0 = time.perf_counter()
        if not populate(self.addr, c):
            return None
        t1 = time.perf_counter()
        libc.memmove(self.addr + c, self.addr, c)  # into fresh pages: faults as a store does
        t2 = time.perf_counter()
        libc.memmove(self.addr + c, self.addr, c)  # again: the copy alone
        t3 = time.perf_counter()
        libc.memset(self.addr + 2 * c, 0, 2 * c)
        t4 = time.perf_counter()
        tiny = 1e-9
        self.rates = FaultRates(c / max(t1 - t0, tiny), 2 * c / max(t4 - t3, tiny),
                                c / max(t2 - t1, tiny), c / max(t3 - t2, tiny))
        self.method = self.rates.method
        self.ensure_populates = self.rates.ensure_populates
        with self._mu:
            self._cursor = self.front = self.faulted = 4 * c
            self.gauge.inc(4 * c)
        log.info("%s: measured %s: pre-faulting by %s; a store past the pre-fault %s",
                 self.name, self.rates.describe(),
                 "madvise" if self.method == "populate" else "zeroing",
                 "populates its block first" if self.ensure_populates
                 else "lets its copy fault the pages")
        return self.rates

    def ensure(self, offset: int, nbytes: int) -> None:
        """Make ``[offset, offset + nbytes)`` ready for a store's copy, unless the front
        already covers it.

        Zeroing thread: claim the steps up to the block's end for the copy (the thread
        skips them) and wait for a step it is zeroing under the block. Then populate the
        block only where that beats letting the copy fault it (``ensure_populates``):
        never the steps around it, so a store does no more than its own bytes."""
        end = offset + nbytes
        if end <= self.front:
            return
        if self.method == "zero":
            self._claim_for_copy(offset, end)
        if self.ensure_populates and end > self.front and _populate_ok is not False:
            populate(self.addr + offset, nbytes)

    def _claim_for_copy(self, offset: int, end: int) -> None:
        with self._mu:
            while self._cursor < end:
                n = min(self.step, self.size - self._cursor)
                self._finished[self._cursor] = n
                self._cursor += n
            self._advance()
            while (any(s < end and offset < s + n for s, n in self._busy.items())
                   and not self._stop.is_set()):
                self._advanced.wait(0.05)

    def _help(self, offset: int, end: int) -> None:
        """Claim and do the steps up to ``end`` in the calling thread (the pinner's)."""
        while self._cursor < end and not self._stop.is_set():
            if not self._step(fallback_touch=False):
                break

    def _work(self, start: int, n: int, fallback_touch: bool) -> bool:
        """Do one claimed step ``[start, start + n)``; False when it could not be done.
        ``fallback_touch`` (``run()`` before anything is handed out): a step the kernel
        would not populate now (ENOMEM) is zeroed instead, so "now" means every page."""
        if self.method == "populate":
            if populate(self.addr + start, n):
                return True
            if _populate_ok is False:
                self.method = "zero"  # the kernel cannot populate: zeroing is as safe (ensure)
            elif not fallback_touch:
                return False  # ENOMEM/EFAULT: this step is left to the copies
        _c().memset(self.addr + start, 0, n)
        return True

    def _verb(self) -> str:
        return "pre-fault"

    def run(self, fallback_touch: bool = False) -> float:
        """Fault the whole buffer in now (the daemon's start-up); returns seconds taken.
        Only for a buffer nothing has been handed out of yet (it may zero it)."""
        log.info("%s: %sing %s%s", self.name, self._verb(), human_bytes(self.size),
                 self._pages())
        self._t0 = self._last_log = time.perf_counter()
        self.calibrate()
        while self._step(fallback_touch):
            pass
        self._stopped()
        return self.seconds

    def start(self) -> None:
        """Measure the fault rates, then fault in a background thread; returns at once."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: pre-fault already started")
        log.info("%s: %sing %s in the background%s", self.name, self._verb(),
                 human_bytes(self.size), self._pages())
        self._t0 = self._last_log = time.perf_counter()
        self.calibrate()
        self._thread = threading.Thread(target=_background, args=(weakref.ref(self),),
                                        daemon=True, name=f"lmc-prefault-{id(self):x}")
        self._thread.start()

    def finish(self, timeout: float | None = None) -> bool:
        """Help the thread until the whole buffer is done (or ``timeout`` seconds): whoever
        waits for "ready" has nothing better to do, and on a busy host the low-priority
        thread alone is slow. True when done."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.done.is_set() and (end is None or time.monotonic() < end):
            if not self._step(fallback_touch=False):
                break  # every step is claimed (or the kernel refused): wait for the rest
        left = None if end is None else max(0.0, end - time.monotonic())
        return self.done.wait(left) and self.front >= self.size

    def stop(self, wait: float | None = 5.0) -> None:
        """Stop advancing (the pool is closing); pages already faulted stay."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(wait)
        with self._mu:  # the gauge counts live pools: this one's pages go with it
            if not self._stop_counted:
                self._stop_counted = True
                self.gauge.dec(self.faulted)
            self._advanced.notify_all()
        self.done.set()

    def stats(self) -> dict[str, float]:
        return {"prefaulted": self.faulted, "prefault_front": self.front,
                "prefault_seconds": self.seconds}

    # -------------------------------------------------------------- internals
    def _pages(self) -> str:
        return " (transparent huge pages)" if self.huge else ""

    def _advance(self) -> None:
        """Move the front over finished steps (``_mu`` held)."""
        front = self.front
        while front in self._finished:
            front += self._finished.pop(front)
        self.front = front
        self._advanced.notify_all()

    def _step(self, fallback_touch: bool) -> bool:
        """Claim the next step and fault it in; False when none is left, on stop, or when
        the kernel cannot populate (then the claimed step faults on first use)."""
        if self._stop.is_set():
            return False
        with self._mu:
            start = self._cursor
            if start >= self.size:
                return False
            n = min(self.step, self.size - start)
            self._cursor = start + n
            self._busy[start] = n
        try:
            ok = self._work(start, n, fallback_touch)
        finally:
            with self._mu:
                del self._busy[start]
                self._advanced.notify_all()
        if not ok:
            return False
        with self._mu:
            if not self._stop_counted:
                self.gauge.inc(n)
            self.faulted += n
            self._finished[start] = n
            self._advance()
            front = self.front
            now = time.perf_counter()
            self.seconds = now - self._t0
            report = front >= self._next_log and now - self._last_log >= 1.0
            if report:
                self._last_log = now
            while self._next_log <= front:
                self._next_log += self.size / 10
        if front >= self.size:
            if not self.done.is_set():
                self.done.set()
                rate = self.size / self.seconds if self.seconds > 0 else float("inf")
                log.info("%s: %sed %s in %s (%s/s): stores run at full speed from now",
                         self.name, self._verb(), human_bytes(self.size),
                         human_seconds(self.seconds), human_bytes(rate))
        elif report:
            log.info("%s: %sed %s of %s (%.0f%%) in %s", self.name, self._verb(),
                     human_bytes(front), human_bytes(self.size), 100 * front / self.size,
                     human_seconds(self.seconds))
        return True

    def _stopped(self) -> None:
        """The background thread (or ``run``) ran out of steps: say so if the front did not
        reach the end (a helping ``ensure`` may still finish the last steps)."""
        if self.front < self.size and self._cursor < self.size and not self._stop.is_set():
            log.info("%s: pre-fault stopped at %s of %s: the kernel did not populate this "
                     "memory ahead of use (pages fault on first write)", self.name,
                     human_bytes(self.front), human_bytes(self.size))
            self.done.set()
        elif self.front >= self.size:
            self.done.set()


def _background(ref: weakref.ref[Prefaulter]) -> None:
    """Thread body holding only a weak reference between steps: a pool garbage-collected
    without ``close()`` stops its pre-fault instead of being kept alive by it. The thread runs
    at a lower priority (nice +5: about a third of a busy core), so an engine loading its
    model meanwhile is hardly slowed; a store that needs pages sooner populates them in its
    own thread (``ensure``)."""
    lower_thread_priority()  # yield the CPU to the engine's work (lmc.priority)
    while True:
        p = ref()
        if p is None:
            return
        try:
            if not p._step(fallback_touch=False):
                p._stopped()
                return
        except PinError as e:  # kept on the pinner: the next allocation raises it
            log.error("%s", e)
            p.done.set()
            return
        except Exception:  # never let a pre-fault failure reach the engine: stores fault
            log.exception("%s: background pre-fault failed", p.name)
            p.done.set()
            return
        del p


# --------------------------------------------------------------------------- pinned pools
# A pinned pool's memory is mapped here and page-locked with cudaHostRegister, not taken from
# torch's pinned host allocator: that one rounds every allocation up to a power of two (a
# 65 GiB pool pinned 128 GiB). The mapping is the size asked rounded up to 2 MiB, at a
# 2 MiB-aligned address (huge pages: hugetlbfs where the host reserved them, else THP), and
# it is registered in steps from the front, in the background as the pre-fault above runs,
# an allocation past the front registering the steps up to it first (``ensure``). A failed
# registration is an error naming the size and the host's limits, never pageable memory.
HUGE = 2 << 20
PIN_STEP = 512 << 20
MAP_HUGETLB = getattr(__import__("mmap"), "MAP_HUGETLB", 0x40000)
CUDA_HOST_REGISTER_PORTABLE, CUDA_HOST_REGISTER_MAPPED = 1, 2


class PinError(RuntimeError):
    """Page-locking a pool's memory failed: the message names the size and the limits."""


def host_limits() -> str:
    """The host's limits on page-locked memory, for an error a person reads."""
    parts = []
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        def fmt(v: int) -> str:
            return "unlimited" if v == resource.RLIM_INFINITY else human_bytes(v)

        parts.append(f"RLIMIT_MEMLOCK {fmt(soft)} (hard {fmt(hard)})")
    except (ImportError, OSError, ValueError):
        parts.append("RLIMIT_MEMLOCK unknown")
    avail = mem_available()
    parts.append(f"MemAvailable {human_bytes(avail)}" if avail is not None
                 else "MemAvailable unknown")
    return ", ".join(parts)


def mem_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def round_huge(nbytes: int) -> int:
    return -(-nbytes // HUGE) * HUGE


def host_alloc(nbytes: int, huge: bool = True) -> tuple[torch.Tensor, str]:
    """``nbytes`` rounded up to 2 MiB of fresh anonymous memory at a 2 MiB-aligned address,
    as a uint8 tensor that keeps the mapping alive, and the kind of pages: "hugetlb" (the
    host reserved huge pages), "thp" (transparent huge pages advised) or "4k"."""
    import mmap

    size = round_huge(max(nbytes, 1))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if huge:
        try:  # reserved huge pages: refused at once (ENOMEM) when the host has too few
            mm = mmap.mmap(-1, size, flags=flags | MAP_HUGETLB)
            t = torch.frombuffer(mm, dtype=torch.uint8)
            if t.data_ptr() % HUGE == 0:
                return t, "hugetlb"
        except (OSError, ValueError):
            pass
    mm = mmap.mmap(-1, size + HUGE, flags=flags)  # + slack to start on a 2 MiB boundary
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    skew = (-raw.data_ptr()) % HUGE
    t = raw[skew: skew + size]
    return t, "thp" if huge and advise_hugepages(t) else "4k"


class CudaRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's CUDA runtime bindings,
    else CuPy's: what page-locks a pool. Tests pass a stand-in with the same two methods."""

    def __init__(self) -> None:
        self._torch = None
        self._cupy = None
        cudart = getattr(torch.cuda, "cudart", None)
        try:
            rt = cudart() if cudart is not None else None
            if rt is not None and hasattr(rt, "cudaHostRegister"):
                self._torch = rt
        except Exception:  # noqa: BLE001 - a torch without CUDA: try CuPy
            self._torch = None
        if self._torch is None:
            import cupy  # raises ImportError naming the package when neither is there

            self._cupy = cupy.cuda.runtime
        self.name = "torch.cuda.cudart()" if self._torch is not None else "cupy.cuda.runtime"

    def register(self, addr: int, nbytes: int) -> None:
        flags = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
        if self._torch is not None:
            err = self._torch.cudaHostRegister(addr, nbytes, flags)
            code = int(getattr(err, "value", err))
            if code != 0:
                raise OSError(f"cudaHostRegister returned {err} ({code})")
            return
        assert self._cupy is not None  # __init__ took CuPy's where torch's is missing
        self._cupy.hostRegister(addr, nbytes, flags)

    def unregister(self, addr: int) -> None:
        if self._torch is not None:
            self._torch.cudaHostUnregister(addr)
        else:
            assert self._cupy is not None
            self._cupy.hostUnregister(addr)


class _Registered:
    """What a pinner has registered, and the memory under it (kept mapped until every range
    is unregistered): shared with the finalizer that unregisters a pool dropped unclosed."""

    def __init__(self, registrar: Any, memory: torch.Tensor) -> None:
        self.registrar = registrar
        self.memory: torch.Tensor | None = memory
        self.ranges: list[tuple[int, int]] = []
        self.closed = False
        self.lock = threading.Lock()

    def add(self, addr: int, n: int) -> bool:
        """Record a registered range; False (and unregistered at once) once closed."""
        with self.lock:
            if not self.closed:
                self.ranges.append((addr, n))
                pinned_ranges.add(addr, n)
                return True
        with contextlib.suppress(Exception):
            self.registrar.unregister(addr)
        return False


def _unregister_all(state: _Registered) -> None:
    with state.lock:
        state.closed = True
        ranges, state.ranges = state.ranges, []
    for addr, n in ranges:
        pinned_ranges.remove(addr)  # no copy is cut by it from now on
        try:
            state.registrar.unregister(addr)
        except Exception as e:  # noqa: BLE001 - interpreter exit, a torn-down driver
            log.debug("cudaHostUnregister of %s at %#x failed: %s", human_bytes(n), addr, e)
    state.memory = None  # the mapping may go now


class Pinner(Prefaulter):
    """Page-locks ``buf`` with ``registrar`` in ``step``s from its start: in the background
    (``start()``, the first step done before it returns so a broken driver fails at once) or
    now (``run()``). ``front``: bytes ``[0, front)`` are pinned. ``ensure`` (every allocation
    past the front) registers the steps up to the block's end, or waits for the thread doing
    them: a block handed out is pinned. A failure stops it; ``error`` keeps the
    :class:`PinError`, which ``ensure`` and ``wait`` raise. ``stop()`` unregisters all."""

    gauge_name = "lmc_pool_pinned_bytes"

    def __init__(self, buf: torch.Tensor, registrar: Any, name: str = "memory pool",
                 step: int = PIN_STEP, huge: bool = False, asked: int | None = None) -> None:
        if step % HUGE:
            raise ValueError(f"pinning step must be a multiple of 2 MiB, got {step}")
        super().__init__(buf, name, step, huge)
        self.asked = self.size if asked is None else asked
        self.error: PinError | None = None
        self._state = _Registered(registrar, buf)
        self._finalizer = weakref.finalize(self, _unregister_all, self._state)

    def _verb(self) -> str:
        return "page-lock"

    def calibrate(self) -> FaultRates | None:
        return None  # registering is the one way to pin: nothing to choose

    def _work(self, start: int, n: int, fallback_touch: bool) -> bool:
        if self.error is not None:
            return False
        addr = self.addr + start
        try:
            self._state.registrar.register(addr, n)
        except Exception as e:  # noqa: BLE001 - any driver error: named, never pageable
            err = PinError(f"{self.name}: page-locking {human_bytes(n)} at offset "
                           f"{human_bytes(start)} of {human_bytes(self.size)} failed "
                           f"({human_bytes(self.front)} locked so far; local_cpu_size asked "
                           f"{human_bytes(self.asked)}): {e}. Host limits: {host_limits()}. "
                           "Lower local_cpu_size, raise the limit (ulimit -l, systemd "
                           "LimitMEMLOCK=), or set pin_memory=false for pageable copies")
            with self._mu:
                self.error = self.error or err
                self._advanced.notify_all()
            self._stop.set()
            raise self.error from None
        return self._state.add(addr, n)  # False: closed meanwhile, already unregistered

    def _help(self, offset: int, end: int) -> None:
        """Claim and register every step up to ``end`` here, however far: a block is
        handed out pinned (the allocator carves from the front, so this is rare)."""
        while self._cursor < end and not self._stop.is_set():
            if not self._step(fallback_touch=False):
                break

    def start(self) -> None:
        log.info("%s: page-locking %s (%s asked) in %s steps in the background%s", self.name,
                 human_bytes(self.size), human_bytes(self.asked), human_bytes(self.step),
                 self._pages())
        self._t0 = self._last_log = time.perf_counter()
        self._step(fallback_touch=False)  # the first step here: a broken driver fails now
        if self.front < self.size:
            self._thread = threading.Thread(target=_background, args=(weakref.ref(self),),
                                            daemon=True, name=f"lmc-pin-{id(self):x}")
            self._thread.start()

    def ensure(self, offset: int, nbytes: int) -> None:
        """Return once ``[offset, offset + nbytes)`` is page-locked (raising the pinner's
        error if it failed): steps near the front are registered by the caller, a step
        another thread is registering is waited for."""
        end = min(offset + nbytes, self.size)
        if end <= self.front:
            return
        self._raise()
        self._help(offset, end)
        with self._mu:
            while self.front < end and self.error is None and not self._stop.is_set():
                if self._cursor < end and not self._thread_alive():
                    break  # nobody is coming: claim the rest here
                self._advanced.wait(0.05)
        self._raise()
        if self.front < end and not self._stop.is_set():
            while self._cursor < end and self._step(fallback_touch=False):
                pass
            self._raise()

    def wait(self, timeout: float | None = None) -> int:
        """Block until every step is registered (or it failed: raises); pinned bytes."""
        self.done.wait(timeout)
        self._raise()
        return self.front

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _stopped(self) -> None:
        self.done.set()

    def stop(self, wait: float | None = 60.0) -> None:
        """Stop registering, then unregister everything (the pool is closing)."""
        super().stop(wait)
        self._finalizer()

    def stats(self) -> dict[str, float]:
        return {"prefaulted": self.front, "prefault_seconds": self.seconds,
                "pinned_bytes": self.front, "pinned_asked": self.asked}

    @property
    def registered(self) -> list[tuple[int, int]]:
        """The ranges registered now, ``(address, bytes)``."""
        with self._state.lock:
            return list(self._state.ranges)
