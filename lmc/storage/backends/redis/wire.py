"""RESP on a connected socket: pipelined commands out, bulk replies read straight into pool memory.

Why not redis-py's reply path for values: its parser (hiredis included) receives a bulk reply
into its own growing buffer and then builds a ``bytes`` object, two copies and a Python loop
per 64 KiB; on this machine one redis-py connection GETs 32 MiB values at ~0.3 GiB/s. Here a
bulk reply's first bytes (the lmc value header) are read into a small buffer, the header says
the shape, the caller allocates the pool object, and the payload is ``recv_into`` that object
directly: the kernel's copy out of the socket is the only copy. Commands go out with one
``sendmsg`` over scatter-gather buffers, so a value's payload is never joined with its header.

redis-py still connects, authenticates, negotiates TLS and parses every control reply
(hiredis); this module only speaks on sockets it has been handed.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Sequence

CRLF = b"\r\n"
_IOV_MAX = 512           # stay well under the kernel's IOV_MAX (1024) per sendmsg
_RX_SIZE = 64 * 1024     # buffer for reply lines and small replies
_COALESCE = 16 * 1024    # buffers smaller than this are copied together before sending


class ProtocolError(ConnectionError):
    """The server said something that is not RESP; the connection can't be trusted."""


class ReplyError(Exception):
    """An error reply (``-ERR ...``). Returned, not raised, so a pipeline stays in sync."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def kind(self) -> str:
        return self.message.split(" ", 1)[0]


class Deadline:
    """Time left for a call: a fixed end (``total``) or a fresh allowance per I/O (``idle``)."""

    __slots__ = ("seconds", "at", "idle")

    def __init__(self, seconds: float, idle: bool = False) -> None:
        self.seconds = seconds
        self.idle = idle
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        if self.idle:
            return self.seconds
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"remote call exceeded its {self.seconds:g} s timeout")
        return left


def command(*args: bytes) -> bytes:
    """One RESP command with small arguments."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def getrange(rkey: bytes, start: int, n: int) -> bytes:
    """``GETRANGE`` of the ``n`` bytes of a value from offset ``start``."""
    return command(b"GETRANGE", rkey, b"%d" % start, b"%d" % (start + n - 1))


class Outbox:
    """Buffers for one pipelined send: small pieces coalesced, large ones passed by reference."""

    __slots__ = ("bufs", "_small", "nbytes")

    def __init__(self) -> None:
        self.bufs: list[bytes | memoryview] = []
        self._small = bytearray()
        self.nbytes = 0

    def add(self, data: bytes | memoryview) -> None:
        n = len(data)
        self.nbytes += n
        if n < _COALESCE:
            self._small += data
            return
        if self._small:
            self.bufs.append(bytes(self._small))
            self._small.clear()
        self.bufs.append(data)

    def add_set(self, key: bytes, header: bytes, payload: memoryview, px: int = 0) -> None:
        """``SET key header+payload [PX px]`` without joining header and payload."""
        argc = 5 if px else 3
        vlen = len(header) + payload.nbytes
        self.add(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(key), key, vlen)
                 + header)
        self.add(payload)
        if px:
            p = b"%d" % px
            self.add(b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(p), p))
        else:
            self.add(CRLF)

    def finish(self) -> list[bytes | memoryview]:
        if self._small:
            self.bufs.append(bytes(self._small))
            self._small.clear()
        bufs, self.bufs = self.bufs, []
        return bufs


# Given the header bytes and the value's total length, a sink returns the buffer the rest of
# the value goes to (exactly ``total - len(head)`` bytes), or None to skip it.
Sink = Callable[[bytes, int], "memoryview | None"]


class WireConn:
    """One server connection used for pipelined data commands."""

    def __init__(self, sock: socket.socket, owner: object = None) -> None:
        self.sock = sock
        self.owner = owner            # the redis-py Connection that made the socket
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.rx = bytearray(_RX_SIZE)
        self.mv = memoryview(self.rx)
        self.lo = 0
        self.hi = 0
        self._scratch: memoryview | None = None
        self._armed = -1.0  # the socket's current timeout, as last set by _arm
        self.bytes_in = 0
        self.bytes_out = 0
        self.on_fill: Callable[[int], None] | None = None
        """Told each slice of a value as it lands in its sink's target (a load watch's
        progress, counted while the value is still arriving; None: nobody listens)."""

    def _arm(self, dl: Deadline) -> None:
        """Bound the next socket operation by the time left. ``settimeout`` is a syscall, so
        it is only re-armed when the time left has shrunk by 10 %: a call then overruns its
        deadline by at most a tenth of it."""
        left = dl.remaining()
        if left < 0.9 * self._armed or left > self._armed:
            self.sock.settimeout(left)
            self._armed = left

    # ------------------------------------------------------------------ send
    def send(self, bufs: Sequence[bytes | memoryview], dl: Deadline) -> None:
        sock = self.sock
        if self.tls:  # SSLSocket has no sendmsg
            for b in bufs:
                self._arm(dl)
                sock.sendall(b)
                self.bytes_out += len(b)
            return
        pending = [memoryview(b).cast("B") for b in bufs]
        i = 0
        while i < len(pending):
            self._arm(dl)
            sent = sock.sendmsg(pending[i: i + _IOV_MAX])
            self.bytes_out += sent
            while sent:
                n = pending[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    pending[i] = pending[i][sent:]
                    sent = 0

    # ------------------------------------------------------------------ receive
    def _recv(self, dl: Deadline) -> None:
        """Append more bytes to the receive buffer."""
        if self.lo == self.hi:
            self.lo = self.hi = 0
        elif self.hi == len(self.rx):
            if self.lo == 0:  # one line longer than the buffer: grow it
                self.mv.release()
                self.rx.extend(bytes(len(self.rx)))
                self.mv = memoryview(self.rx)
            else:
                n = self.hi - self.lo
                self.rx[:n] = bytes(self.mv[self.lo: self.hi])
                self.lo, self.hi = 0, n
        self._arm(dl)
        n = self.sock.recv_into(self.mv[self.hi:])
        if n == 0:
            raise ConnectionError("server closed the connection")
        self.hi += n
        self.bytes_in += n

    def _line(self, dl: Deadline) -> bytes:
        while True:
            end = self.rx.find(CRLF, self.lo, self.hi)
            if end >= 0:
                line = bytes(self.mv[self.lo: end])
                self.lo = end + 2
                if not line:
                    raise ProtocolError("empty reply line")
                return line
            self._recv(dl)

    def _take(self, n: int, dl: Deadline) -> bytes:
        while self.hi - self.lo < n:
            self._recv(dl)
        out = bytes(self.mv[self.lo: self.lo + n])
        self.lo += n
        return out

    def _end_of_bulk(self, dl: Deadline) -> None:
        if self._take(2, dl) != CRLF:
            raise ProtocolError("bulk reply not terminated by CRLF")

    def read_reply(self, dl: Deadline) -> object:
        """One small reply: int, bytes, str (status), None, list, or a ReplyError."""
        line = self._line(dl)
        kind, rest = line[:1], line[1:]
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self._take(n, dl)
            self._end_of_bulk(dl)
            return data
        if kind == b"+":
            return rest.decode("utf-8", "replace")
        if kind == b"-":
            return ReplyError(rest.decode("utf-8", "replace"))
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read_reply(dl) for _ in range(n)]
        if kind == b"_":
            return None
        raise ProtocolError(f"unexpected reply type {kind!r}")

    def read_value(self, dl: Deadline, head_size: int, sink: Sink) -> object:
        """One GET-style reply: ``None`` (no value), a ``ReplyError``, or ``True`` once the
        value went through ``sink`` (which saw its head and may have skipped the rest)."""
        line = self._line(dl)
        kind = line[:1]
        if kind == b"$":
            total = int(line[1:])
            if total < 0:
                return None
        elif kind == b"-":
            return ReplyError(line[1:].decode("utf-8", "replace"))
        elif kind == b"_":
            return None
        else:
            raise ProtocolError(f"expected a bulk reply, got {kind!r}")
        head = self._take(min(total, head_size), dl)
        rest = total - len(head)
        target = sink(head, total)
        if target is None:
            self._skip(rest, dl)
        else:
            if target.nbytes != rest:
                raise ValueError(f"sink gave {target.nbytes} bytes for a {rest}-byte remainder")
            self._fill(target, dl)
        self._end_of_bulk(dl)
        return True

    def _fill(self, target: memoryview, dl: Deadline) -> None:
        """Fill ``target``: first from what is buffered, then straight from the socket."""
        n = target.nbytes
        k = min(self.hi - self.lo, n)
        tell = self.on_fill
        if k:
            target[:k] = self.mv[self.lo: self.lo + k]
            self.lo += k
            if tell is not None:
                tell(k)
        sock = self.sock
        while k < n:
            self._arm(dl)
            got = sock.recv_into(target[k:], n - k)
            if got == 0:
                raise ConnectionError("server closed the connection mid-value")
            k += got
            self.bytes_in += got
            if tell is not None:
                tell(got)

    def _skip(self, n: int, dl: Deadline) -> None:
        """Read and drop ``n`` bytes (a value we will not keep), staying in sync."""
        k = min(self.hi - self.lo, n)
        self.lo += k
        n -= k
        if not n:
            return
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = memoryview(bytearray(1 << 20))
        while n:
            self._arm(dl)
            got = self.sock.recv_into(scratch, min(n, scratch.nbytes))
            if got == 0:
                raise ConnectionError("server closed the connection mid-value")
            n -= got
            self.bytes_in += got

    @property
    def idle(self) -> bool:
        """Nothing unread is buffered: safe to hand to the next caller."""
        return self.lo == self.hi

    def close(self) -> None:
        owner = self.owner
        try:
            if owner is not None and hasattr(owner, "disconnect"):
                owner.disconnect()
            else:
                self.sock.close()
        except Exception:  # closing a broken socket must never raise into a tier
            pass
