"""A circuit breaker: after repeated failures, stop calling a dead server for a while.

Why: a dead remote tier must cost the engine nothing, not one connect timeout per call.
Closed -> (``threshold`` consecutive failures) -> open for ``backoff`` seconds, during
which every call is a miss without touching the network -> half-open: one trial call is let
through; success closes the breaker, failure opens it again with the backoff doubled (up to
``cap``). Recovery needs no one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, threshold: int = 2, base: float = 0.1, cap: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.base = base
        self.cap = cap
        self.clock = clock
        self.state = CLOSED
        self.failures = 0
        self.trips = 0
        self._backoff = base
        self._retry_at = 0.0
        self._trial = False
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether a call may go to the network now."""
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and self.clock() >= self._retry_at:
                self.state = HALF_OPEN
                self._trial = False
            if self.state == HALF_OPEN and not self._trial:
                self._trial = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self.state = CLOSED
            self.failures = 0
            self._backoff = self.base
            self._trial = False

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self.state == HALF_OPEN or self.failures >= self.threshold:
                if self.state != OPEN:
                    self.trips += 1
                self.state = OPEN
                self._retry_at = self.clock() + self._backoff
                self._backoff = min(self.cap, self._backoff * 2)
                self._trial = False

    def stats(self) -> dict[str, float | str]:
        return {"breaker": self.state, "breaker_trips": self.trips,
                "consecutive_failures": self.failures}
