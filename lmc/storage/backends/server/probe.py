"""When to ask the server which values it already has before sending them.

Keys are content addresses: a value the daemon holds need not travel again, and engines that
share prompts re-store the same chunks all the time. But the question costs a round trip
per call, which on a busy machine (scheduling latency) can cost as much as moving several
MiB. So the client asks while asking pays: it keeps a moving average of the fraction of
values found present, probes every call while that is worth it, and otherwise only every
``every``-th call, to notice when the workload changes.
"""

from __future__ import annotations

import threading


class ProbePolicy:
    def __init__(self, threshold: float = 0.1, every: int = 8, alpha: float = 0.3) -> None:
        self.threshold = threshold
        self.every = every
        self.alpha = alpha
        self.score = 1.0  # optimistic: the first calls probe
        self._calls = 0
        self._lock = threading.Lock()

    def want(self) -> bool:
        with self._lock:
            self._calls += 1
            return self.score >= self.threshold or self._calls % self.every == 0

    def saw(self, present: int, total: int) -> None:
        """Record what a probe found: ``present`` of ``total`` values were there."""
        if total:
            with self._lock:
                self.score += self.alpha * (present / total - self.score)
