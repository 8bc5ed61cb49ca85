"""Background threads yield the CPU to the engine's.

A GPU engine's Python thread launches kernels and waits; on a host whose cores are busy, a
thread of lmc's that writes, checksums or pre-faults in the background takes the core the
engine's next launch needs. Work that no request waits for -- the write-behind's puts, a
tier's writes, the pool's first touch -- runs in threads that lower their own scheduling
priority (Linux: ``setpriority`` on the thread's id; nice +5 is about a third of a busy
core against a nice-0 thread). Loads and the layer-wise copies keep the engine's priority:
a request waits for them. Not ``SCHED_IDLE``: on a host whose cores are always busy (a CPU
engine, a shared machine) such a thread gets almost nothing, and a flush at shutdown would
run out of time.
"""

from __future__ import annotations

import contextlib
import os
import threading

BACKGROUND_NICE = 5


def lower_thread_priority(by: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's priority by ``by`` nice steps (at most to 19); where the
    platform cannot, nothing happens (a thread pool's ``initializer``, or a thread's first
    call)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
