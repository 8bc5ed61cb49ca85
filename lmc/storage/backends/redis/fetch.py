"""Reading values: ranged, windowed GETs whose payloads land directly in pool objects.

Why ranges and a window rather than one pipelined GET per value: Redis copies a whole reply
into its output buffers before writing any of it, so a pipeline of large GETs makes the
server allocate (and page-fault in) hundreds of MiB of fresh reply memory, and a value past
jemalloc's 8 MiB "oversize" threshold is mapped and unmapped on every GET. Measured here with
32 MiB values: whole GETs ~1.0 GiB/s; ``GETRANGE`` pieces of 1 MiB with at most ~4 MiB
requested ahead per connection ~2.2 GiB/s (the server then reuses a few hot buffers).

So each value is read as ``GETRANGE key 0 1.25P-1`` (the header and the start of the payload;
for values up to 1.25 pieces all of it); the header says the length, the pool object is allocated, and
the rest follows as further pieces, each received straight into its slice of the object.
Requests are streamed: a new one goes out as each reply is consumed, so the pipe never drains.
A value that turns out shorter or longer than its header (the last request asks for one byte
past the end), whose header is bad, or whose checksum fails is a miss, deleted and counted.
Keys with no value (an empty reply) are plain misses. Given the engine's geometry
(``lmc.storage.integrity.Geometry``), a header describing another chunk is refused the same way,
before anything is allocated for it. With an integrity secret the value's
head is the header and its tag (``lmc.storage.integrity``), and a tag that does not verify is a miss,
deleted and counted like a bad checksum; the payload is checked where it landed, in place.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Sequence

from lmc.memory.pool import MemoryObj
from lmc.storage.framing import ValueFraming
from lmc.storage.integrity import Geometry
from lmc.storage.remote import Rejects
from lmc.storage.serde import (
    CorruptValue,
    Header,
)

from .jobs import Allocate, Call, StreamJob
from .wire import Deadline, ReplyError, WireConn, command, getrange

log = logging.getLogger(__name__)


class _Open:
    """A value being received: its object and how much of it has arrived."""

    __slots__ = ("obj", "hdr", "head", "view", "vlen", "pieces_left")

    def __init__(self, obj: MemoryObj, hdr: Header, head: bytes, vlen: int) -> None:
        self.obj = obj
        self.hdr = hdr
        self.head = head  # header (and tag): what the integrity check needs at the end
        self.view = obj.byte_view()
        self.vlen = vlen
        self.pieces_left = 0


class GetJob(StreamJob):
    """The values of some keys over one connection (see the module docstring)."""

    op = "get"

    def __init__(self, call: Call, idxs: Sequence[int], allocate: Allocate,
                 piece: int = 1 << 20, window: int = 4 << 20,
                 framing: ValueFraming | None = None, geometry: Geometry | None = None
                 ) -> None:
        super().__init__(call, idxs)
        self.frame = framing if framing is not None else ValueFraming()
        self.geometry = geometry
        self.hsize = self.frame.size  # bytes before the payload
        if piece <= self.hsize:
            raise ValueError(f"piece size must exceed the {self.hsize}-byte header")
        self.allocate = allocate
        self.piece = piece
        # the first request takes a bit more, so that a value of one piece plus its header
        # (1 MiB chunks are common) needs no second request
        self.first = piece + piece // 4
        self.window = window
        self._reset()

    def _reset(self) -> None:
        self._next = 0                                  # next key whose first piece to ask
        self._more: deque[tuple[int, int]] = deque()    # (key, offset) ready to ask
        self._pending: deque[tuple[int, int]] = deque()  # asked, reply not read yet
        self._open: dict[int, _Open] = {}
        self._bad: Rejects[int] = Rejects("redis tier")  # indices into the call's keys
        self._held: list[int] = []
        self._est = self.piece                          # expected reply size, for the window

    # ------------------------------------------------------------------ requests
    def _ask(self, wc: WireConn, dl: Deadline) -> None:
        """Top the pipe up to the window."""
        limit = max(2, min(64, self.window // max(self._est, 1)))
        rk = self.call.rkeys
        out = []
        while len(self._pending) < limit:
            if self._more:
                i, off = self._more.popleft()
                if i in self._bad or i not in self._open:
                    continue
                end = min(off + self.piece, self._open[i].vlen + 1)  # +1: catch extra bytes
            elif self._next < len(self.idxs):
                i, off = self.idxs[self._next], 0
                self._next += 1
                end = self.first
            else:
                break
            out.append(getrange(rk[i], off, end - off))
            self._pending.append((i, off))
        if out:
            wc.send([b"".join(out)], dl)

    # ------------------------------------------------------------------ replies
    def recv(self, wc: WireConn, dl: Deadline) -> None:
        while self._pending:
            i, off = self._pending.popleft()
            if off == 0:
                r = wc.read_value(dl, self.hsize, functools.partial(self._first, i))
            else:
                r = wc.read_value(dl, 0, functools.partial(self._piece_sink, i, off))
            if isinstance(r, ReplyError):
                self.call.reply_errors.append(r)
            st = self._open.get(i)
            if st is not None and st.pieces_left == 0 and i not in self._bad:
                self._finish(i, st)
            self._ask(wc, dl)
        if self._bad:  # same connection, still in sync: remove what we refused to serve
            bad = self._bad.take()
            rk = self.call.rkeys
            wc.send([b"".join(command(b"DEL", rk[i]) for i in bad)], dl)
            for _ in bad:
                wc.read_reply(dl)
            self.call.corrupt += len(bad)

    def _first(self, i: int, head: bytes, n: int) -> memoryview | None:
        if n == 0:
            return None  # no value under this key
        try:
            hdr = self.frame.decode(head, self.call.keys[i], self.geometry)  # before allocating
            vlen = self.hsize + hdr.payload_len
            if n != min(self.first, vlen):  # a longer value shows in its last piece
                raise CorruptValue(f"value is {n} bytes, its header says {vlen}")
        except CorruptValue as e:
            self._corrupt(i, e)
            return None
        obj = self.allocate(hdr.shape, hdr.dtype, hdr.num_tokens)
        if obj is None:  # pool full: a miss, not an error
            self.call.alloc_failures += 1
            return None
        st = self._open[i] = _Open(obj, hdr, bytes(head), vlen)
        self._est = min(self.piece, vlen)
        for off in range(self.first, vlen + 1, self.piece):
            self._more.append((i, off))
            st.pieces_left += 1
        return st.view[: n - self.hsize]

    def _piece_sink(self, i: int, off: int, _head: bytes, n: int) -> memoryview | None:
        """:meth:`_next_piece` as a ``read_value`` sink (a later piece has no head)."""
        return self._next_piece(i, off, n)

    def _next_piece(self, i: int, off: int, n: int) -> memoryview | None:
        st = self._open.get(i)
        if st is None or i in self._bad:
            return None
        st.pieces_left -= 1
        want = min(off + self.piece, st.vlen) - off
        if n != want:
            self._corrupt(i, CorruptValue(f"{'more' if n > want else 'fewer'} bytes than its "
                                          f"header says ({st.vlen})"))
            return None
        if n == 0:
            return None
        return st.view[off - self.hsize: off - self.hsize + n]

    def _finish(self, i: int, st: _Open) -> None:
        del self._open[i]

        def check() -> None:
            self.frame.verify(self.call.keys[i], st.head, st.hdr, st.view)

        if self._bad.verify(i, st.obj, check, self._name(i)) is None:
            return
        self.call.results[i] = st.obj
        self._held.append(i)
        self.call.nbytes += st.vlen

    def _name(self, i: int) -> str:
        return self.call.rkeys[i].decode(errors="replace")

    def _corrupt(self, i: int, e: CorruptValue) -> None:
        if i in self._bad:
            return
        self._bad.reject(i, e, self._name(i))
        st = self._open.pop(i, None)
        if st is not None:
            st.obj.release()

    def abort(self) -> None:
        for st in self._open.values():
            st.obj.release()
        res = self.call.results
        for i in self._held:
            if res[i] is not None:
                res[i].release()
                res[i] = None
        self._reset()
