"""The circuit breaker every remote tier uses: stop calling a dead server, probe it with backoff.

Why: a dead or hung server would otherwise cost every lookup a full timeout (or a refused
connect) and every write-behind batch a failed transfer. After ``threshold`` consecutive
transport failures the breaker *opens*: calls are refused at once (the tier answers misses
without touching the network). When the backoff has elapsed one caller is let through as a
*probe* (half-open); its success closes the breaker, its failure re-opens it with the backoff
doubled (up to ``max_backoff``). Nobody has to reset it: recovery is the next probe.

A probe that never reports (its thread died, its caller forgot) frees the probe slot after
``probe_timeout``. The backoff is jittered by ``±jitter`` so that engines sharing one server
do not all probe it in the same instant; tests pass ``jitter=0`` for exact times.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class CircuitBreaker:
    """Thread-safe. Callers do ``if b.allow(): ...; b.success() / b.failure()``."""

    def __init__(self, threshold: int = 3, backoff: float = 0.25, max_backoff: float = 10.0,
                 probe_timeout: float = 5.0, *, jitter: float = 0.2,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[str], None] | None = None) -> None:
        if threshold < 1:
            raise ValueError(f"breaker threshold must be >= 1, got {threshold}")
        if not 0 < backoff <= max_backoff:
            raise ValueError(f"breaker: need 0 < backoff <= max_backoff, got {backoff}, "
                             f"{max_backoff}")
        if not 0 <= jitter < 1:
            raise ValueError(f"breaker jitter must be in [0, 1), got {jitter}")
        if probe_timeout <= 0:
            raise ValueError(f"breaker probe_timeout must be > 0, got {probe_timeout}")
        self.threshold = threshold
        self.base_backoff = backoff
        self.max_backoff = max_backoff
        self.probe_timeout = probe_timeout
        self.jitter = jitter
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self.state = CLOSED
        self.consecutive_failures = 0
        self.backoff = backoff  # the wait before the next probe, once open
        self.retry_at = 0.0
        self._probe_since = 0.0
        self.on_first_failure: Callable[[BaseException | None], None] | None = None
        self.failures = 0      # all failures since creation
        self.trips = 0         # closed/half-open -> open transitions
        self.rejected = 0      # calls refused while open
        self.recoveries = 0    # half-open -> closed transitions

    def allow(self) -> bool:
        """May a call go to the server now? While half-open only the probe may."""
        with self._lock:
            if self.state == CLOSED:
                return True
            now = self._clock()
            if self.state == OPEN and now >= self.retry_at:
                self._set(HALF_OPEN)
                self._probe_since = now
                return True
            if self.state == HALF_OPEN and now - self._probe_since > self.probe_timeout:
                self._probe_since = now  # the last probe was lost: let another one try
                return True
            self.rejected += 1
            return False

    def success(self) -> None:
        with self._lock:
            self.consecutive_failures = 0
            if self.state != CLOSED:
                self.recoveries += 1
                self.backoff = self.base_backoff
                self._set(CLOSED)

    def failure(self, error: BaseException | None = None) -> None:
        """A call failed (``error``: why, for the first-failure hook). The first failure of
        the breaker's life calls ``on_first_failure``, so a tier says so at once instead of
        only when the breaker opens."""
        with self._lock:
            self.failures += 1
            self.consecutive_failures += 1
            if self.state == HALF_OPEN:
                self.backoff = min(self.backoff * 2, self.max_backoff)
                self._open()
            elif self.state == CLOSED and self.consecutive_failures >= self.threshold:
                self._open()
            first = self.failures == 1
        hook = self.on_first_failure
        if first and hook is not None:
            hook(error)

    def _open(self) -> None:
        spread = random.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else 1.0
        self.retry_at = self._clock() + self.backoff * spread
        self.trips += 1
        self._set(OPEN)

    def _set(self, state: str) -> None:
        self.state = state
        if self._on_change is not None:
            self._on_change(state)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"state": self.state, "consecutive_failures": self.consecutive_failures,
                    "trips": self.trips, "rejected": self.rejected,
                    "recoveries": self.recoveries, "backoff_s": self.backoff,
                    "retry_in_s": max(0.0, self.retry_at - self._clock())
                    if self.state == OPEN else 0.0}
