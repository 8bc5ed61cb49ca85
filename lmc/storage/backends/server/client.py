"""A blocking client connection to ``lmc server``: the engine side of the protocol.

Batches are cut into frames within the server's limits (learnt from HELLO) and pipelined:
up to ``window`` requests are on the wire before the first answer is read. Values are sent
from pool memory with ``sendmsg`` (no joined copy) and received with ``recv_into`` straight
into freshly allocated pool objects, whose checksum is verified before they are returned.
Any socket or protocol failure raises; the connection is then unusable and the caller
(``lmc/storage/backends/server/backend.py``) closes it and turns the failure into misses.
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmc.storage.backends.server import protocol as P
from lmc.storage.backends.server.protocol import DEFAULT_PORT
from lmc.storage.control import ERRORS, ControlError
from lmc.storage.serde import byte_view, encode_header, payload_checksum

if TYPE_CHECKING:
    import torch

    from lmc.memory.pool import MemoryObj

Allocate = Callable[[Sequence[int], "torch.dtype", int], "MemoryObj | None"]
BlockMeta = tuple[dict[str, Any], Sequence["list[Any] | None"]]
"""A PUT's block info: the shared fields (``bs``, ``cs``, ``lora``) and an item per value."""
CLIENT_LIMITS = P.Limits(max_meta=16 << 20)
_SCRATCH = 1 << 20
UNIX_SNDBUF = 4 << 20  # the kernel caps it at net.core.wmem_max (and doubles it)


class ServerError(Exception):
    """The server answered a request with an error status."""

    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(f"{P.STATUS_NAMES.get(status, status)}: {message}")
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Address:
    """Where the server listens, and the namespace this client works in."""

    family: str  # "tcp" | "unix"
    host: str = ""
    port: int = DEFAULT_PORT
    path: str = ""
    namespace: str | None = None

    @classmethod
    def parse(cls, url: str) -> Address:
        """``lmc://host:port[?ns=NAME]`` or ``lmc+unix:///path/to.sock[?ns=NAME]``."""
        u = urllib.parse.urlsplit(url)
        ns = urllib.parse.parse_qs(u.query).get("ns", [None])[0]
        if u.scheme == "lmc":
            if not u.hostname:
                raise ValueError(f"remote_url {url!r}: lmc:// needs a host")
            try:
                port = u.port or DEFAULT_PORT
            except ValueError:
                raise ValueError(f"remote_url {url!r}: bad port") from None
            return cls("tcp", host=u.hostname, port=port, namespace=ns)
        if u.scheme == "lmc+unix":
            path = urllib.parse.unquote(u.netloc + u.path)
            if not path:
                raise ValueError(f"remote_url {url!r}: lmc+unix:// needs a socket path")
            return cls("unix", path=path, namespace=ns)
        raise ValueError(f"remote_url {url!r}: expected lmc:// or lmc+unix://")

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" if self.family == "tcp" else f"unix:{self.path}"


def _batches(n: int, step: int) -> Iterator[tuple[int, int]]:
    for i in range(0, n, step):
        yield i, min(n, i + step)


class ClientConnection:
    """One socket, one conversation at a time (callers hold it exclusively)."""

    def __init__(self, address: Address, token: str | None = None, timeout: float = 1.0,
                 client_name: str = "lmc", window: int = 8, sock_buf: int = 0) -> None:
        self.address = address
        self.timeout = timeout
        self.window = window
        self._next_id = 0
        self._hdr = bytearray(P.FRAME_SIZE)
        self._scratch: memoryview | None = None
        if address.family == "tcp":
            self.sock = socket.create_connection((address.host, address.port), timeout=timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            try:
                self.sock.connect(address.path)
            except OSError:
                self.sock.close()
                raise
        self.sock.settimeout(timeout)
        self.closed = False
        try:
            if address.family == "unix":  # no autotuning there: one recv moves at most this
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
            if sock_buf:
                for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                    self.sock.setsockopt(socket.SOL_SOCKET, opt, sock_buf)
            meta = {"client": client_name}
            if token:
                meta["token"] = token
            _, info = self.call(P.HELLO, meta)
            granted = info.get("namespaces")  # a tenant token: the namespaces it may use
            self.namespaces: list[str] | None = (
                [n for n in granted if isinstance(n, str)] if isinstance(granted, list) else None)
            ev = info.get("kv_events")  # the daemon publishes KV events: {"block_size": n}
            self.kv_events: dict[str, Any] | None = ev if isinstance(ev, dict) else None
            lim = info.get("limits") or {}
            self.limits = P.Limits(
                max_meta=min(int(lim.get("max_meta", 1 << 20)), CLIENT_LIMITS.max_meta),
                max_payload=int(lim.get("max_payload", 256 << 20)),
                max_value=int(lim.get("max_value", 256 << 20)),
                max_batch=max(1, int(lim.get("max_batch", 4096))),
                max_namespace=int(lim.get("max_namespace", 64)))
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    # ------------------------------------------------------------ framing
    def _send(self, op: int, meta: dict[str, Any], bufs: Sequence[memoryview] = (),
              payload_len: int = 0) -> int:
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        m = P.pack_meta(meta)
        views = [memoryview(P.pack_header(op, self._next_id, len(m), payload_len) + m), *bufs]
        while views:
            n = self.sock.sendmsg(views[:512])
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]
        return self._next_id

    def _recv_exact(self, view: memoryview) -> None:
        pos, n = 0, len(view)
        while pos < n:
            got = self.sock.recv_into(view[pos:])
            if not got:
                raise ConnectionError(f"server {self.address} closed the connection")
            pos += got

    def _discard(self, n: int) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH))
        while n:
            take = min(n, _SCRATCH)
            self._recv_exact(self._scratch[:take])
            n -= take

    def _recv(self, op: int, req_id: int, max_payload: int = 0
              ) -> tuple[P.FrameHeader, dict[str, Any]]:
        """A response's header and metadata (its payload, if any, is still on the wire)."""
        self._recv_exact(memoryview(self._hdr))
        h = P.unpack_header(self._hdr)
        P.check_response(h, op, req_id, CLIENT_LIMITS, max_payload)
        meta_buf = bytearray(h.meta_len)
        self._recv_exact(memoryview(meta_buf))
        meta = P.unpack_meta(meta_buf, P.Limits(max_meta=CLIENT_LIMITS.max_meta,
                                                max_batch=1 << 20), max_map=1 << 16)
        if h.status != P.OK:
            if h.payload_len:
                self._discard(h.payload_len)
            err, code = meta.get("error"), meta.get("code")
            raise ServerError(h.status, err if isinstance(err, str) else "?",
                              code if isinstance(code, str) else "")
        return h, meta

    def call(self, op: int, meta: dict[str, Any]) -> tuple[P.FrameHeader, dict[str, Any]]:
        """One request without payload, one answer without payload."""
        return self._recv(op, self._send(op, meta))

    def _pipeline(self, op: int, requests: Iterator[tuple[dict, Sequence[memoryview], int]],
                  on_reply: Callable[[int, P.FrameHeader, dict], None],
                  max_payload: int = 0) -> None:
        """Send requests keeping at most ``window`` unanswered; ``on_reply(i, h, meta)`` reads
        each answer (and its payload) in order."""
        pending: deque[tuple[int, int]] = deque()
        for i, (meta, bufs, plen) in enumerate(requests):
            if len(pending) >= self.window:
                j, rid = pending.popleft()
                h, m = self._recv(op, rid, max_payload)
                on_reply(j, h, m)
            pending.append((i, self._send(op, meta, bufs, plen)))
        while pending:
            j, rid = pending.popleft()
            h, m = self._recv(op, rid, max_payload)
            on_reply(j, h, m)

    # -------------------------------------------------------------- ops
    def ping(self) -> float:
        t0 = time.perf_counter()
        self.call(P.PING, {})
        return time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return self.call(P.STATS, {})[1]

    def put(self, ns: str, keys: Sequence[bytes], objs: Sequence[MemoryObj],
            probe: bool = False, blocks: BlockMeta | None = None) -> tuple[bytes, int]:
        """Store values: one result byte per value (``protocol.STORED``...), and how many the
        server already held. Keys are content addresses, so with ``probe`` one EXISTS round
        trip first spares the transfer of values the server has (they count as stored).
        ``blocks``: block info for the daemon's KV events (``lmc.events.shared``): the
        shared fields and one item (or None) per value; sent in each frame's metadata."""
        if probe and keys:
            present = self.contains(ns, keys)
            todo = [i for i, p in enumerate(present) if not p]
            if len(todo) < len(keys):
                out = bytearray(len(keys))  # STORED == 0
                if todo:
                    sub_blocks = None if blocks is None else (
                        blocks[0], [blocks[1][i] for i in todo])
                    sub, _ = self.put(ns, [keys[i] for i in todo], [objs[i] for i in todo],
                                      blocks=sub_blocks)
                    for i, r in zip(todo, sub):
                        out[i] = r
                return bytes(out), len(keys) - len(todo)
        views = [byte_view(o) for o in objs]
        items = [encode_header(k, o.shape, o.dtype, o.num_tokens, v)
                 for k, o, v in zip(keys, objs, views)]
        frames: list[tuple[int, int]] = []
        start, size, meta = 0, 0, 0
        info = None if blocks is None else blocks[1]
        meta_room = self.limits.max_meta // 2  # block info's tokens travel as metadata
        for i, v in enumerate(views):  # cut frames at max_batch values / max_payload bytes
            item = None if info is None else info[i]
            extra = 64 + (0 if item is None else len(item[1]))
            if i > start and (i - start >= self.limits.max_batch
                              or size + v.nbytes > self.limits.max_payload
                              or (info is not None and meta + extra > meta_room)):
                frames.append((start, i))
                start, size, meta = i, 0, 0
            size += v.nbytes
            meta += extra
        if start < len(views):
            frames.append((start, len(views)))
        results = bytearray(len(views))

        def requests():
            for a, b in frames:
                m: dict[str, Any] = {"ns": ns, "items": items[a:b]}
                if blocks is not None:
                    m["blocks"] = {**blocks[0], "items": list(blocks[1][a:b])}
                yield (m, views[a:b], sum(v.nbytes for v in views[a:b]))

        def on_reply(j: int, h: P.FrameHeader, meta: dict) -> None:
            a, b = frames[j]
            res = meta.get("results")
            if not isinstance(res, bytes) or len(res) != b - a:
                raise P.ProtocolError(P.BAD_FRAME, "PUT response results malformed", True)
            results[a:b] = res

        self._pipeline(P.PUT, requests(), on_reply)
        return bytes(results), 0

    def get(self, ns: str, keys: Sequence[bytes], allocate: Allocate, prefix: bool = False,
            on_corrupt: Callable[[bytes], None] | None = None) -> list[MemoryObj | None]:
        """Values into pool objects from ``allocate`` (each holding one reference for the
        caller), None where missing, unallocatable or corrupt (``on_corrupt(key)`` is told,
        so the tier can delete it). ``prefix`` stops at a miss."""
        out: list[MemoryObj | None] = [None] * len(keys)
        todo = 0
        try:
            while todo < len(keys):
                got, more = self._get_frames(ns, keys, todo, allocate, prefix, out, on_corrupt)
                if not more:
                    break
                todo = got
        except BaseException:
            for o in out:
                if o is not None:
                    o.release()
            raise
        return out

    def _get_frames(self, ns: str, keys: Sequence[bytes], start: int, allocate: Allocate,
                    prefix: bool, out: list, on_corrupt: Callable[[bytes], None] | None
                    ) -> tuple[int, bool]:
        """Pipelined GETs of ``keys[start:]``; returns (first index not answered, whether
        the server held some back for size, so another round is needed)."""
        step = self.limits.max_batch
        frames = list(_batches(len(keys) - start, step))
        state: dict[str, Any] = {"resume": len(keys), "more": False, "stop": False}

        def requests():
            for a, b in frames:
                if state["stop"]:
                    return
                yield {"ns": ns, "keys": list(keys[start + a:start + b]), "prefix": prefix}, (), 0

        def on_reply(j: int, h: P.FrameHeader, meta: dict) -> None:
            a, b = frames[j]
            base = start + a
            if state["stop"]:  # an earlier frame ended the prefix or was cut: skip this one
                self._discard(h.payload_len)
                return
            hdrs = P.get_value_headers(meta, keys[base:start + b], h.payload_len)
            for i, hd in enumerate(hdrs):
                if hd is None:
                    continue
                obj = allocate(hd.shape, hd.dtype, hd.num_tokens)
                if obj is None:
                    self._discard(hd.payload_len)
                    continue
                out[base + i] = obj
                view = byte_view(obj)
                self._recv_exact(view)
                if payload_checksum(view) != hd.checksum:
                    out[base + i] = None
                    obj.release()
                    if on_corrupt is not None:
                        on_corrupt(keys[base + i])
            if meta.get("more") is True:
                state.update(resume=base + len(hdrs), more=True, stop=True)
            elif prefix and len(hdrs) < b - a:
                state["stop"] = True

        self._pipeline(P.GET, requests(), on_reply,
                       max_payload=self.limits.max_payload)
        return int(state["resume"]), bool(state["more"])

    def contains(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        frames = list(_batches(len(keys), self.limits.max_batch))

        def on_reply(j: int, h: P.FrameHeader, meta: dict) -> None:
            a, b = frames[j]
            present = meta.get("present")
            if not isinstance(present, bytes) or len(present) != b - a:
                raise P.ProtocolError(P.BAD_FRAME, "EXISTS response malformed", True)
            out.extend(bool(x) for x in present)

        self._pipeline(P.EXISTS, (({"ns": ns, "keys": list(keys[a:b])}, (), 0)
                                  for a, b in frames), on_reply)
        return out

    def prefix_hits(self, ns: str, keys: Sequence[bytes]) -> int:
        total = 0
        for a, b in _batches(len(keys), self.limits.max_batch):
            _, meta = self.call(P.EXISTS, {"ns": ns, "keys": list(keys[a:b]), "prefix": True})
            hits = meta.get("hits")
            if not isinstance(hits, int) or not 0 <= hits <= b - a:
                raise P.ProtocolError(P.BAD_FRAME, "EXISTS response malformed", True)
            total += hits
            if hits < b - a:
                break
        return total

    # ------------------------------------------------------- control ops
    def _control(self, op: int, meta: dict[str, Any], field: str) -> int:
        """One control request; a refusal raises the rule's named error
        (:mod:`lmc.storage.control`), any other error status :class:`ServerError`."""
        try:
            _, answer = self.call(op, meta)
        except ServerError as e:
            if e.status == P.REFUSED:
                raise ERRORS.get(e.code, ControlError)(e.message) from None
            raise
        n = answer.get(field)
        if not isinstance(n, int) or n < 0:
            raise P.ProtocolError(P.BAD_FRAME, f"{P.OPS[op].upper()} response malformed", True)
        return n

    def clear(self, ns: str) -> int:
        """CLEAR: every value of namespace ``ns`` leaves every tier of the daemon."""
        return self._control(P.CLEAR, {"ns": ns}, "deleted")

    def pin(self, ns: str, keys: Sequence[bytes], ttl: float, *, owner: bytes | None = None,
            priority: int | None = None) -> int:
        """PIN the longest stored prefix of ``keys`` (at most ``max_batch``) for ``ttl``
        seconds; the chunks pinned."""
        meta: dict[str, Any] = {"ns": ns, "keys": list(keys[:self.limits.max_batch]),
                                "ttl": ttl}
        if owner is not None:
            meta["owner"] = owner
        if priority is not None:
            meta["priority"] = priority
        return self._control(P.PIN, meta, "pinned")

    def unpin(self, ns: str, keys: Sequence[bytes] = (), owner: bytes | None = None) -> int:
        meta: dict[str, Any] = {"ns": ns, "keys": list(keys[:self.limits.max_batch])}
        if owner is not None:
            meta["owner"] = owner
        return self._control(P.UNPIN, meta, "unpinned")

    def set_priority(self, ns: str, keys: Sequence[bytes], priority: int) -> int:
        total = 0
        for a, b in _batches(len(keys), self.limits.max_batch):
            total += self._control(P.PRIORITY, {"ns": ns, "keys": list(keys[a:b]),
                                                "priority": priority}, "held")
        return total

    def delete(self, ns: str, keys: Sequence[bytes]) -> int:
        total = 0
        for a, b in _batches(len(keys), self.limits.max_batch):
            _, meta = self.call(P.DELETE, {"ns": ns, "keys": list(keys[a:b])})
            n = meta.get("deleted")
            total += n if isinstance(n, int) else 0
        return total

