"""Warnings a peer cannot multiply: at most ``limit`` lines per ``window`` seconds.

Why: every warning about a client, a peer or a frame is something the other side can
trigger in a loop, and a log that grows at its pace is a disk it can fill. The first lines
of an incident go out verbatim (what an operator needs to see); the rest are counted and the
count is told with the next line that gets through. Used by the daemon, the HTTP servers and
the P2P tier (``lmc.server.interval_log`` adds per-interval summaries for very frequent events).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any


class RateLimitedWarnings:
    """At most ``limit`` log lines per ``window`` seconds on ``logger``; thread-safe."""

    def __init__(self, limit: int = 20, window: float = 10.0,
                 logger: logging.Logger | None = None) -> None:
        self.limit, self.window = limit, window
        self.logger = logger or logging.getLogger("lmc")
        self._start = float("-inf")
        self._count = self._suppressed = 0
        self._lock = threading.Lock()

    def __call__(self, msg: str, *args: Any, level: int = logging.WARNING,
                 exc_info: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self.window:
                self._start, self._count = now, 0
            self._count += 1
            if self._count > self.limit:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            self.logger.warning("(%d similar warnings suppressed)", suppressed)
        self.logger.log(level, msg, *args, exc_info=exc_info)
