"""When each request of a trace may be sent: the one pacing policy both replay targets share.

- **timed**: a request is due at its ``arrival_s`` (from the replay's start);
- **fast**: arrival times are ignored, a request is due at once;

and in both, a turn of a session waits for the previous turn's answer (a user does not ask
turn k+1 before reading answer k; the prompt of turn k+1 holds that answer), and at most
``concurrency`` requests are in flight (None: no limit beyond the target's own queue; a
limit plays a fixed number of clients).

A request's **due** time is when it could have been sent: the latest of its arrival, its
session's previous answer and a free client slot. TTFT is measured from it, so a replay loop that is
late to send (a long engine step) cannot hide the wait from the numbers. Requests are sent
in trace order among those due: a session waiting on an answer blocks only itself.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from lmc.workloads.trace import TraceRequest


class Dispatcher:
    def __init__(self, requests: Sequence[TraceRequest], *, fast: bool = False,
                 concurrency: int | None = None) -> None:
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.requests = list(requests)
        self.fast = fast
        self.concurrency = concurrency
        self._queues: dict[str, deque[int]] = {}
        self._session_of: list[str] = []
        for i, r in enumerate(self.requests):
            key = r.session_id if r.session_id is not None else f"\0{i}"
            self._session_of.append(key)
            self._queues.setdefault(key, deque()).append(i)
        # heads of idle sessions: (due time, trace index)
        self._eligible: list[tuple[float, int]] = []
        for q in self._queues.values():
            self._push(q[0], 0.0)
        self._by_id = {r.request_id: i for i, r in enumerate(self.requests)}
        self.due: dict[str, float] = {}
        self.in_flight = 0
        self.finished = 0
        # client slots: when each free one opened (FIFO); None without a limit
        self._slots: deque[float] | None = (deque([0.0] * concurrency)
                                            if concurrency is not None else None)

    def _push(self, index: int, after: float) -> None:
        due = after if self.fast else max(self.requests[index].arrival_s, after)
        heapq.heappush(self._eligible, (due, index))

    def ready(self, now: float) -> list[TraceRequest]:
        """Requests to send now (each marked in flight, its due time in ``self.due``)."""
        out: list[TraceRequest] = []
        while self._eligible and self._eligible[0][0] <= now and (
                self._slots is None or self._slots):
            due, i = heapq.heappop(self._eligible)
            if self._slots is not None:
                due = max(due, self._slots.popleft())
            req = self.requests[i]
            self.due[req.request_id] = due
            self.in_flight += 1
            out.append(req)
        return out

    def done(self, request_id: str, now: float) -> None:
        """A request finished (answered or failed) at ``now``: its session's next turn
        becomes due no earlier than ``now``."""
        i = self._by_id[request_id]
        if self._slots is not None:
            self._slots.append(now)
        self.in_flight -= 1
        self.finished += 1
        q = self._queues[self._session_of[i]]
        q.popleft()
        if q:
            self._push(q[0], now)

    def next_due(self) -> float | None:
        """The earliest due time among requests not yet sent, or None (all sent, or all
        waiting on answers / a concurrency slot)."""
        if not self._eligible or (self._slots is not None and not self._slots):
            return None
        return self._eligible[0][0]

    @property
    def all_done(self) -> bool:
        return self.finished == len(self.requests)
