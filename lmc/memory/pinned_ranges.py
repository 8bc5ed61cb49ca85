"""Host ranges this process has page-locked with ``cudaHostRegister``, one entry per call.

Why: the driver treats each registration as one allocation. A copy-engine job
(``cudaMemcpyAsync``, ``cudaMemcpy2DAsync``) whose host extent runs from one registration
into the next is refused ("invalid argument", seen on an H100 for 2D copies) or may take the
pageable path; a pool page-locked in steps (:class:`lmc.memory.prefault.Pinner`) has such
boundaries inside it. The transfer code asks :func:`window` where the registration around an
address ends and cuts its copies there."""

from __future__ import annotations

import bisect
import threading

_lock = threading.Lock()
_starts: list[int] = []       # sorted
_ends: dict[int, int] = {}    # start -> end (exclusive)


def add(addr: int, nbytes: int) -> None:
    """Record that ``[addr, addr + nbytes)`` was registered in one call."""
    if nbytes <= 0:
        raise ValueError(f"a registered range has a positive size, got {nbytes}")
    with _lock:
        if addr in _ends:
            raise ValueError(f"host range at {addr:#x} is registered already")
        bisect.insort(_starts, addr)
        _ends[addr] = addr + nbytes


def remove(addr: int) -> None:
    """Forget the registration that starts at ``addr`` (unregistered); unknown: nothing."""
    with _lock:
        if _ends.pop(addr, None) is not None:
            del _starts[bisect.bisect_left(_starts, addr)]


def window(addr: int) -> tuple[int, int] | None:
    """``(start, end)`` of the registration holding ``addr``; None where lmc registered none."""
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        if i >= 0:
            start = _starts[i]
            end = _ends[start]
            if addr < end:
                return start, end
    return None
