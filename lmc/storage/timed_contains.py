"""A lookup's existence checks on a lower tier, with a deadline: a tier that does not answer
in time is a miss for that lookup.

A lookup runs on the engine's scheduling thread, before anything is decided, so whatever a
tier's ``contains`` waits for, every request waits for too. A slow tier's link carries
prefetch reads and write-behind puts besides the lookups: measured, ``lmc demo --quick``
with its disk tier behind a 2 MiB/s link, restarted, spent ~1 s of its six requests' TTFT in
the disk's ``contains`` queued behind a prefetch (TTFT p50 291 ms against 193 ms for the
engine alone) although lmc then chose to recompute every token the disk held. Asking late
gains nothing: a lookup's wait is paid whether the hit is then loaded or recomputed.

So the manager (:meth:`lmc.storage.manager.StorageManager.sources`) asks each lower tier on
that tier's own threads and waits at most a share of what recomputing the prompt costs
(:func:`budget_s`; at least ``lookup_min_wait`` in the config, 20 ms by default, from the
call's start); past that the tier's keys are misses for this lookup (counted,
``lookup_late``), and its answer, when it comes, is dropped. At most ``MAX_IN_FLIGHT`` calls
per tier run at once (a tier that keeps them all past their deadlines is a miss at once,
``lookup_busy``): a stuck tier holds a few threads, never one per request. Where nothing
estimates compute (the daemon's own lookups, a bare manager) the call is made inline, as
before: there is no recompute to compare with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmc.storage.speeds import PrefillRate
    from lmc.storage.tier import Key, StorageBackend

MAX_IN_FLIGHT = 4
SHARE = 0.1
"""A lookup may cost at most this share of recomputing the prompt (issue 36's bar is 1.25x
the engine alone; the load, watched, has the rest)."""
MIN_S = 0.02
"""Every tier gets at least this long from its call's start (the default of the config's
``lookup_min_wait``): a healthy tier (a disk index, a Redis ``EXISTS``, an ``lmc server``'s
round trip) usually answers within it, so a short prompt still finds its hits; a tier that
takes longer costs a short prompt at most this. A host stalled for longer than this (a
loaded machine descheduling the tier's thread) makes a healthy tier late too: where hits
must not depend on that (tests, a far remote tier), ``lookup_min_wait`` raises it."""
START_GUARD_S = 5.0
"""How long a call handed to a free thread may wait to start (a hang guard: only a host
stalled for seconds reaches it; the call is then a miss)."""


def budget_s(rate: PrefillRate | None, tokens: int, min_s: float = MIN_S) -> float | None:
    """How long a lookup of ``tokens`` prompt tokens may wait for the lower tiers: ``SHARE``
    of computing them at ``rate`` (at least ``min_s``); ``None`` (no deadline) without a
    rate."""
    if rate is None or tokens <= 0:
        return None
    return max(min_s, SHARE * rate.seconds(0, tokens))


class TimedContains:
    """``tier.contains`` on at most ``max_in_flight`` threads of its own, waited for with a
    timeout (module doc). Threads start on first use and end at :meth:`close`."""

    def __init__(self, tier: StorageBackend, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.tier = tier
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def _executor(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_in_flight,
                                                thread_name_prefix=f"lmc-exists-{self.tier.name}")
            return self._pool

    def _call(self, keys: list[Key], started: list[float], go: threading.Event
              ) -> list[bool]:
        started.append(time.monotonic())
        go.set()
        try:
            return list(self.tier.contains(keys))
        finally:
            self._slots.release()

    def ask(self, keys: Sequence[Key], timeout: float) -> list[bool] | str:
        """The tier's answer for ``keys`` within ``timeout`` seconds of the call's start,
        else why not: ``"late"`` (asked, not answered in time) or ``"busy"`` (every thread
        still held by calls past their deadlines; not asked). The deadline counts from
        when the tier's call starts on its thread, not from the hand-off: a loaded host's
        scheduling delay is not the tier's slowness. The tier's own error is raised."""
        if not self._slots.acquire(blocking=False):
            return "busy"
        pool = self._executor()
        if pool is None:  # closed: the manager is closing, nothing waits for a tier now
            self._slots.release()
            return "busy"
        started: list[float] = []
        go = threading.Event()
        try:
            fut = pool.submit(self._call, list(keys), started, go)
        except RuntimeError:  # shut down between the check and the submit
            self._slots.release()
            return "busy"
        if not go.wait(START_GUARD_S):  # a free thread not scheduled for this long
            return "late"
        try:
            return fut.result(max(0.0, started[0] + timeout - time.monotonic()))
        except FutureTimeout:
            return "late"

    def close(self) -> None:
        """Stop the threads without waiting for calls in flight (their tier closes after
        this and wakes them)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
