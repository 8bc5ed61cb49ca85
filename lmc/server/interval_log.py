"""Log lines a peer cannot multiply: a per-second cap for protocol warnings, and one line per
interval (with a count) for events that can repeat thousands of times a second.

Why: every per-connection or per-frame event is something a misbehaving peer (or a full fd
table) can trigger in a loop; a log that grows at the peer's pace is a disk a peer can fill.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from lmc.ratelog import RateLimitedWarnings

log = logging.getLogger("lmc.server.daemon")
__all__ = ["FirstSeen", "IntervalLog", "RateLimitedWarnings"]


class IntervalLog:
    """One line per ``interval`` seconds for a repeating event: the first occurrence at once,
    then, while it keeps happening, one line per interval saying how often it happened.
    ``flush`` reports a count still pending (called from a periodic task)."""

    def __init__(self, level: int, msg: str, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.level = level
        self.msg = msg
        self.interval = interval
        self.clock = clock
        self.total = 0
        self._pending = 0
        self._last = float("-inf")
        self._detail = ""

    def __call__(self, detail: str = "", n: int = 1) -> None:
        self.total += n
        self._pending += n
        self._detail = detail
        if self.clock() - self._last >= self.interval:
            self._emit()

    def flush(self) -> None:
        if self._pending and self.clock() - self._last >= self.interval:
            self._emit()

    def _emit(self) -> None:
        self._last = self.clock()
        what = f" ({self._detail})" if self._detail else ""
        log.log(self.level, "%s%s: %d time(s) in the last %.0f s", self.msg, what,
                self._pending, self.interval)
        self._pending = 0


class FirstSeen:
    """One line the first time a name is seen, never one per connection: names are remembered
    (the ``remember`` most recent, so a client that reconnects is never new again), and new
    names get at most ``limit`` lines per ``window`` seconds; past that they are counted and
    summed up in one :class:`IntervalLog` line per window.

    Why: a client name is whatever the peer sends. Distinct names past any remembered set, or
    a reconnect storm once that set is full, used to write one line per connection."""

    def __init__(self, remember: int = 4096, limit: int = 20, window: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.remember = remember
        self.limit = limit
        self.window = window
        self.clock = clock
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._start = float("-inf")
        self._count = 0
        self.more = IntervalLog(logging.INFO, f"hello from new clients past {limit} lines "
                                f"per {window:g} s (not logged one by one)", window, clock)

    def __call__(self, key: Hashable) -> bool:
        """Whether ``key`` deserves its own line now (new, and within the window's budget);
        a new key past the budget is counted in the summary line instead."""
        if key in self._seen:
            self._seen.move_to_end(key)
            return False
        self._seen[key] = None
        if len(self._seen) > self.remember:
            self._seen.popitem(last=False)
        now = self.clock()
        if now - self._start >= self.window:
            self._start, self._count = now, 0
        self._count += 1
        if self._count > self.limit:
            self.more()
            return False
        return True

    def flush(self) -> None:
        self.more.flush()
