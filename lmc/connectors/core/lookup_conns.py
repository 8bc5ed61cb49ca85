"""What the peers of a lookup socket can make a rank hold, bounded (the server side of
:mod:`lmc.connectors.core.lookup_service`).

Before, a request announcing the largest token count (2^24) made the server allocate its
64 MiB buffer before any token arrived, every connection had a thread of its own with no
cap, and nothing timed out: 8 silent connections held +512 MiB, 300 idle ones 300 threads,
and a good lookup then took 1-4 s (past the scheduler's 1 s deadline: a miss). Now
(:class:`ConnLimits`, defaults):

* a request's bytes are read as they arrive, 64 KiB (``chunk``) at a time, and the
  buffer grows by what arrived; every byte buffered is charged to one budget shared by all
  connections (``max_buffered``, 128 MiB: two requests of the largest size); a read that
  would pass it closes that connection (``over_budget``), never the others;
* at most ``max_connections`` (64) connections: one more evicts the connection idle the
  longest (between requests: a scheduler keeps one per rank and reconnects when it finds
  it closed), or is refused at once when every one is inside a request (``refused``);
* a connection waits at most ``idle_timeout`` (60 s) for its next request, a request takes
  at most ``request_timeout`` (5 s) from its first byte to its last, an answer at most
  ``send_timeout`` (5 s) to be taken: past either it is closed (``timeouts``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ConnLimits:
    max_connections: int = 64
    max_buffered: int = 128 << 20
    idle_timeout: float = 60.0
    request_timeout: float = 5.0
    send_timeout: float = 5.0
    chunk: int = 64 << 10


class Overloaded(ConnectionError):
    """Reading on would pass the bytes every connection together may buffer."""


class ConnState:
    """One connection: when it went idle (None inside a request), bytes charged."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.idle_since: float | None = time.monotonic()
        self.charged = 0


class Conns:
    """The open connections and the shared byte budget (module docstring)."""

    def __init__(self, limits: ConnLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self.open: dict[socket.socket, ConnState] = {}
        self.buffered = 0
        self.peak = 0
        self.counts = {"refused": 0, "evicted": 0, "timeouts": 0, "over_budget": 0}

    def admit(self, sock: socket.socket) -> ConnState | None:
        """A state for a new connection, evicting the longest-idle one at the cap; None
        when every open connection is inside a request (the caller closes ``sock``)."""
        with self._lock:
            if len(self.open) >= self.limits.max_connections:
                idle = [st for st in self.open.values() if st.idle_since is not None]
                if not idle:
                    self.counts["refused"] += 1
                    return None
                victim = min(idle, key=lambda st: st.idle_since or 0.0)
                del self.open[victim.sock]
                self.counts["evicted"] += 1
                with contextlib.suppress(OSError):  # its thread's read ends, it cleans up
                    victim.sock.shutdown(socket.SHUT_RDWR)
            st = self.open[sock] = ConnState(sock)
            return st

    def charge(self, st: ConnState, n: int) -> None:
        with self._lock:
            if self.buffered + n > self.limits.max_buffered:
                self.counts["over_budget"] += 1
                raise Overloaded(f"lookup requests buffer {self.buffered} bytes, at most "
                                 f"{self.limits.max_buffered}")
            self.buffered += n
            st.charged += n
            self.peak = max(self.peak, self.buffered)

    def uncharge(self, st: ConnState, n: int) -> None:
        with self._lock:
            n = min(n, st.charged)
            st.charged -= n
            self.buffered -= n

    def close(self, st: ConnState) -> None:
        self.uncharge(st, st.charged)
        with self._lock:
            if self.open.get(st.sock) is st:
                del self.open[st.sock]

    def timed_out(self) -> None:
        with self._lock:
            self.counts["timeouts"] += 1

    def all(self) -> list[socket.socket]:
        with self._lock:
            return list(self.open)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counts, "connections": len(self.open),
                    "buffered_bytes": self.buffered, "buffered_peak": self.peak}


class RequestReader:
    """Reads one connection's requests within :class:`ConnLimits`: ``exact(n)`` is the
    wire format's read, :meth:`done` ends a request (its bytes released, idle again)."""

    def __init__(self, st: ConnState, conns: Conns) -> None:
        self.st = st
        self.conns = conns
        self.limits = conns.limits
        self.deadline: float | None = None  # set at a request's first byte

    def exact(self, n: int) -> bytes:
        buf = bytearray()
        sock = self.st.sock
        while len(buf) < n:
            want = min(n - len(buf), self.limits.chunk)
            self.conns.charge(self.st, want)
            if self.deadline is None:
                sock.settimeout(self.limits.idle_timeout)
            else:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"a request not whole in {self.limits.request_timeout} s")
                sock.settimeout(left)
            got = sock.recv(want)
            self.conns.uncharge(self.st, want - len(got))
            if not got:
                raise ConnectionError("peer closed the connection")
            if self.deadline is None:
                self.deadline = time.monotonic() + self.limits.request_timeout
                self.st.idle_since = None
            buf += got
        return bytes(buf)

    def send(self, data: bytes) -> None:
        self.st.sock.settimeout(self.limits.send_timeout)
        self.st.sock.sendall(data)

    def done(self) -> None:
        self.conns.uncharge(self.st, self.st.charged)
        self.deadline = None
        self.st.idle_since = time.monotonic()
