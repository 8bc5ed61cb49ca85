"""Reading frames off a non-blocking socket inside the event loop, payloads straight into
pool memory.

Headers and metadata are read through a small staging buffer, which may over-read: one
``recv_into`` then often brings a whole small request (header, metadata and the start of
the payload), instead of one system call per field. Payload bytes that landed in the
staging buffer are copied once into their destination (at most the staging size); the rest
of the payload is received with ``recv_into`` directly into the destination, i.e. into the
``MemoryObj``'s memory: no intermediate copy for the bulk of a value.
"""

from __future__ import annotations

import asyncio
import socket
import time

STAGE_SIZE = 64 << 10
_DISCARD = 256 << 10


class PeerClosed(ConnectionError):
    """The peer closed the connection (``clean``: between frames)."""

    def __init__(self, clean: bool) -> None:
        super().__init__("peer closed the connection" + ("" if clean else " mid-frame"))
        self.clean = clean


class FrameReader:
    """Exact reads with a bounded staging buffer; ``progress_at`` feeds the stall watchdog."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop = loop
        self.sock = sock
        self._buf = bytearray(STAGE_SIZE)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self.bytes_read = 0
        self.progress_at = time.monotonic()
        self._waiting = False     # inside a recv, waiting on the peer
        self._boundary = True     # that recv is for the first bytes of a frame header

    @property
    def buffered(self) -> int:
        return self._end - self._start

    @property
    def mid_frame(self) -> bool:
        """Waiting on the peer for bytes of a frame it has begun (header, metadata, payload,
        or a payload being discarded): the state a stall watchdog must time out. Waiting
        for the first byte of the next frame is not (an idle connection)."""
        return self._waiting and not (self._boundary and self._end == self._start)

    async def _recv_into(self, view: memoryview) -> int:
        self._waiting = True
        try:
            n = await self.loop.sock_recv_into(self.sock, view)
        finally:
            self._waiting = False
        if n:
            self.bytes_read += n
            self.progress_at = time.monotonic()
        return n

    async def _fill(self, need: int, at_boundary: bool) -> None:
        """Make ``need`` bytes available in the staging buffer (the caller bounds ``need``)."""
        if self._end - self._start >= need:
            return
        self._boundary = at_boundary
        if self._start + need > len(self._buf):  # compact, growing only for large metadata
            size = max(STAGE_SIZE, need)
            data = bytes(self._mv[self._start:self._end])  # may overlap its destination
            if size != len(self._buf):
                buf = bytearray(size)
                buf[: len(data)] = data
                self._buf, self._mv = buf, memoryview(buf)
            else:
                self._buf[: len(data)] = data
            self._end -= self._start
            self._start = 0
        while self._end - self._start < need:
            n = await self._recv_into(self._mv[self._end:])
            if n == 0:
                raise PeerClosed(clean=at_boundary and self._end == self._start)
            self._end += n

    async def read(self, n: int, at_boundary: bool = False) -> memoryview:
        """``n`` bytes, valid until the next call."""
        await self._fill(n, at_boundary)
        out = self._mv[self._start:self._start + n]
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return out

    async def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` (a byte view of pool memory): staged bytes first, then directly."""
        self._boundary = False
        pos = min(self._end - self._start, len(dst))
        if pos:
            dst[:pos] = self._mv[self._start:self._start + pos]
            self._start += pos
            if self._start == self._end:
                self._start = self._end = 0
        while pos < len(dst):
            n = await self._recv_into(dst[pos:])
            if n == 0:
                raise PeerClosed(clean=False)
            pos += n

    async def discard(self, n: int) -> None:
        """Consume ``n`` bytes nobody will keep (a value refused for memory or quota)."""
        self._boundary = False
        scratch = memoryview(bytearray(min(n, _DISCARD))) if n > self.buffered else None
        while n:
            take = min(n, self._end - self._start)
            if take:
                self._start += take
                n -= take
                if self._start == self._end:
                    self._start = self._end = 0
                continue
            assert scratch is not None
            got = await self._recv_into(scratch[: min(n, len(scratch))])
            if got == 0:
                raise PeerClosed(clean=False)
            n -= got

    def shrink(self) -> None:
        """Return a staging buffer grown for large metadata to its usual size when empty."""
        if len(self._buf) > STAGE_SIZE and self._start == self._end:
            self._buf = bytearray(STAGE_SIZE)
            self._mv = memoryview(self._buf)
            self._start = self._end = 0
