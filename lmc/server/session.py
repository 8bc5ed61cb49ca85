"""One client connection: authenticate, then read requests and answer them, in order.

The token presented in HELLO decides the connection's :class:`~lmc.server.auth.Grant`; every
request naming a namespace is checked against it before anything else is done for it
(``forbidden``). Any failed HELLO closes the connection.

A request is answered completely before the next one is read, so responses keep the order
of requests and a client may pipeline. What the peer sends is bounded before it is read
(``protocol.check_header``) and validated before it is used; a broken frame is answered
with an error and the connection closed, a malformed request is answered and the
connection kept. Payloads go from the socket straight into pool objects and become visible
only after their checksum holds.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmc.server import control
from lmc.server import metrics as M
from lmc.server.auth import OPEN, Grant
from lmc.server.p2p import ops as p2p_ops
from lmc.server.reader import FrameReader, PeerClosed
from lmc.server.store import Checksum, checksum_of
from lmc.server.text import safe
from lmc.server.writer import send_buffers
from lmc.storage.backends.server import protocol as P
from lmc.storage.control import ControlError
from lmc.storage.serde import byte_view, encode_header, payload_checksum

if TYPE_CHECKING:
    from lmc.memory.pool import MemoryObj
    from lmc.server.daemon import Daemon

log = logging.getLogger(__name__)
HELLO_MAX_META = 4096
IDLE, READING, WORKING, SENDING = "idle", "reading", "working", "sending"


def _printable(s: Any, limit: int = 64) -> str:
    """A peer-supplied name made safe for a log line (control characters escaped)."""
    return safe(s if isinstance(s, str) else "", limit)


def _plain(v: Any) -> Any:
    """Stats values made msgpack-safe."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)


class Session:
    """The coroutine serving one accepted socket; the daemon tracks it for drain and stalls."""

    def __init__(self, daemon: Daemon, sock: socket.socket, peer: str, via: str) -> None:
        self.daemon = daemon
        self.sock = sock
        self.peer = peer
        self.via = via
        self.loop = asyncio.get_running_loop()
        self.reader = FrameReader(self.loop, sock)
        self.limits = daemon.config.limits
        self.store = daemon.store
        # no tokens configured: everything is allowed, but the connection still counts as
        # unauthenticated (hello_timeout, the pre-HELLO cap) until it has sent one frame
        self.grant: Grant | None = None if daemon.auth.required else OPEN
        self.established = False
        self.client = "-"
        self.state = IDLE
        self.accepted_at = self.sent_at = time.monotonic()
        self._sending = False
        self.dropped = False  # closed by the daemon (displaced, timed out): counted till closed
        self._own_wait = False  # waiting on the daemon itself (queue room), not on the peer
        self.task: asyncio.Task | None = None

    # --------------------------------------------------------------- loop
    @property
    def progress_at(self) -> float:
        return max(self.reader.progress_at, self.sent_at)

    @property
    def waiting_on_peer(self) -> bool:
        """Mid-frame on either side: a request half-received (or its refused payload being
        discarded) or an answer the peer is not reading. The watchdog times these out."""
        return (self.reader.mid_frame or self._sending) and not self._own_wait

    async def run(self) -> None:
        log.debug("%s: connected via %s", self.peer, self.via)
        try:
            while True:
                if self.daemon.draining and not self.reader.buffered:
                    break
                self.state = IDLE
                self.reader.shrink()
                raw = await self.reader.read(P.FRAME_SIZE, at_boundary=True)
                self.state = READING
                if not await self._serve_frame(raw):
                    break
                if not self.established and self.grant is not None:
                    self._establish()
        except PeerClosed as e:
            if not e.clean:
                self.daemon.warn("%s: connection closed mid-frame", self.peer)
        except asyncio.CancelledError:
            log.debug("%s: connection dropped (%s)", self.peer,
                      "shutdown" if self.daemon.draining else "stalled or timed out")
        except OSError as e:
            self.daemon.warn("%s: connection error: %s", self.peer, e)
        except Exception:
            # a daemon bug a peer can trigger at will must not write a traceback per try
            self.daemon.warn("%s: internal error; closing the connection", self.peer,
                             level=logging.ERROR, exc_info=True)
        finally:
            self.store.p2p.leave(self)  # a closed owner's locations go with it
            self.sock.close()
            log.debug("%s: disconnected", self.peer)

    async def _serve_frame(self, raw: memoryview) -> bool:
        """Read and answer one request; False closes the connection."""
        op, req_id = raw[5], 0
        t0 = time.perf_counter()
        try:
            h = P.unpack_header(raw)
            op, req_id = h.op, h.req_id
            if self.grant is None and h.op != P.HELLO:
                M.AUTH_FAILURES.inc()
                raise P.ProtocolError(P.AUTH_FAILED, "authentication required", fatal=True)
            if h.op == P.HELLO and (h.meta_len > HELLO_MAX_META or h.payload_len):
                raise P.ProtocolError(P.TOO_LARGE, "HELLO too large", fatal=True)
            P.check_header(h, self.limits)
        except P.ProtocolError as e:
            await self._fail(op, req_id, e, payload_left=0)
            return False
        if self.grant is OPEN and not self.established:
            self._establish()  # no tokens: a well-formed header is all a HELLO would prove
        status, keep = P.OK, True
        try:
            meta = P.unpack_meta(await self.reader.read(h.meta_len), self.limits)
            self.state = WORKING
            handler = self._handlers.get(h.op)
            if handler is None:
                raise P.ProtocolError(P.UNKNOWN_OP, f"unknown op {h.op:#x}")
            keep = await handler(self, h, meta)
        except P.ProtocolError as e:
            status = e.status
            if h.op == P.HELLO:
                e.fatal = True  # a client that cannot say HELLO right gets no second try
            left = h.payload_len if h.op == P.PUT else 0  # PUTs fail before their payload
            keep = await self._fail(h.op, h.req_id, e, payload_left=left)
        M.REQUESTS.labels(P.OPS.get(h.op, "unknown"), P.STATUS_NAMES.get(status, "?")).inc()
        M.REQUEST_SECONDS.labels(P.OPS.get(h.op, "unknown")).observe(time.perf_counter() - t0)
        return keep

    def _establish(self) -> None:
        self.established = True
        self.daemon.established(self)

    # ------------------------------------------------------------ replies
    async def _send(self, op: int, req_id: int, meta: dict[str, Any], bufs: Sequence[Any] = (),
                    payload_len: int = 0, status: int = P.OK) -> None:
        m = P.pack_meta(meta)
        self.state = SENDING
        head = P.pack_header(op | P.RESPONSE, req_id, len(m), payload_len, status) + m
        self._sending = True
        self.sent_at = time.monotonic()
        try:
            await send_buffers(self.loop, self.sock, [head, *bufs], self._sent)
        finally:
            self._sending = False

    def _sent(self) -> None:
        self.sent_at = time.monotonic()

    async def _fail(self, op: int, req_id: int, e: P.ProtocolError, payload_left: int) -> bool:
        """Answer an error; returns whether the connection stays open."""
        M.PROTOCOL_ERRORS.labels(P.STATUS_NAMES.get(e.status, "?")).inc()
        self.daemon.warn("%s: %s %s: %s", self.peer, P.OPS.get(op, f"op {op:#x}"),
                         P.STATUS_NAMES.get(e.status, "?"), e)
        if not e.fatal and payload_left:
            await self.reader.discard(payload_left)  # bounded by max_payload; keeps framing
        answer = {"error": str(e)}
        if e.code:
            answer["code"] = e.code
        try:
            await self._send(op, req_id, answer, status=e.status)
        except OSError:
            return False
        return not e.fatal

    # ----------------------------------------------------------- handlers
    async def _hello(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        """Authenticate: the token's grant replaces the connection's (a repeated HELLO
        re-authenticates; any failure closes the connection)."""
        client = _printable(meta.get("client"))
        given = P.get_token(meta)
        if self.daemon.auth.required:
            grant = self.daemon.auth.check(given)
            if grant is None:
                M.AUTH_FAILURES.inc()
                why = "no token" if not given else "wrong token"
                raise P.ProtocolError(P.AUTH_FAILED, f"authentication failed ({why})",
                                      fatal=True)
            self.grant = grant
        self.client = client
        self.daemon.hello_log(self)
        answer: dict[str, Any] = {"server": "lmc", "version": P.VERSION,
                                  "limits": self.limits.as_dict()}
        if self.grant is not None and not self.grant.admin:
            answer["namespaces"] = sorted(self.grant.namespaces)
        if self.daemon.kv_events is not None:
            answer["kv_events"] = self.daemon.kv_events.hello()
        await self._send(h.op, h.req_id, answer)
        return True

    def granted_namespace(self, meta: dict[str, Any]) -> str:
        """The request's namespace, if this connection's token grants it (``FORBIDDEN``
        otherwise): what every namespaced op, the P2P directory's included, starts with."""
        ns = P.get_namespace(meta, self.limits)
        if self.grant is None or not self.grant.allows(ns):
            M.FORBIDDEN.inc()
            raise P.ProtocolError(P.FORBIDDEN, f"this token does not grant namespace "
                                  f"{_printable(ns)!r}")
        return ns

    async def _ping(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        await self._send(h.op, h.req_id, {})
        return True

    async def _stats(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        stats = await self.daemon.run_storage(self.daemon.stats, self.grant)
        await self._send(h.op, h.req_id, _plain(stats))
        return True

    async def _put(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        ns = self.granted_namespace(meta)
        items = P.get_put_items(meta, h.payload_len, self.limits)
        ikeys = self.store.internal_keys(ns, [it.key for it in items])
        if self.daemon.kv_events is not None:  # block info checked before any payload
            self.daemon.kv_events.check(ns, meta, items, ikeys)
        admitted, reserved = self.store.admit(ns, [it.payload_len for it in items])
        results = bytearray(len(items))
        self.state = READING
        try:
            i = 0
            while i < len(items):
                if not admitted[i]:
                    results[i] = P.OVER_QUOTA
                    await self.reader.discard(items[i].payload_len)
                    i += 1
                    continue
                j = self._group_end(items, admitted, i)
                await self._receive_group(ns, items, ikeys, i, j, results)
                i = j
        finally:
            self.store.settle(ns, reserved)
        self._count_put(results, h.payload_len)
        self.daemon.activity.put(ns, len(items), results.count(P.STORED), h.payload_len)
        await self._send(h.op, h.req_id, {"results": bytes(results)})
        return True

    def _group_end(self, items: list, admitted: list[bool], i: int) -> int:
        """End of the run of admitted values shaped like ``items[i]`` that is allocated (and
        made visible) together: one allocation and one commit per run, not per value."""
        first, size, j = items[i], items[i].payload_len, i + 1
        while (j < len(items) and admitted[j] and items[j].shape == first.shape
               and items[j].dtype == first.dtype and items[j].num_tokens == first.num_tokens
               and size + items[j].payload_len <= self.daemon.commit_bytes):
            size += items[j].payload_len
            j += 1
        return j

    async def _receive_group(self, ns: str, items: list, ikeys: list[bytes], i: int, j: int,
                             results: bytearray) -> None:
        """Receive ``items[i:j]`` straight into pool objects, verify, commit the good ones."""
        it0 = items[i]
        objs = self.store.allocate_many(it0.shape, it0.dtype, j - i, it0.num_tokens)
        good: list[tuple[bytes, MemoryObj]] = []
        try:
            for k in range(i, j):
                obj = objs[k - i] if k - i < len(objs) else None
                if obj is None:
                    results[k] = P.NO_MEMORY
                    await self.reader.discard(items[k].payload_len)
                    continue
                view = byte_view(obj)
                await self.reader.read_into(view)
                if payload_checksum(view) != items[k].checksum:
                    results[k] = P.BAD_CHECKSUM  # never visible; freed below
                    continue
                obj.meta = Checksum(items[k].checksum)
                good.append((ikeys[k], obj))
            if good:
                await self._queue_room(sum(o.nbytes for _, o in good))
                self.store.commit(ns, [k for k, _ in good], [o for _, o in good])
        finally:
            if objs:
                objs[0].pool.release_many(objs)

    async def _queue_room(self, nbytes: int) -> None:
        """The daemon's wait for write-behind room; not the peer's stall (the watchdog's
        clock restarts after it)."""
        self._own_wait = True
        try:
            await self.daemon.queue_room(nbytes)
        finally:
            self._own_wait = False
            self.sent_at = time.monotonic()

    @staticmethod
    def _count_put(results: bytearray, nbytes: int) -> None:
        M.BYTES.labels("in").inc(nbytes)
        for code, name in ((P.STORED, "stored"), (P.BAD_CHECKSUM, "bad_checksum"),
                           (P.NO_MEMORY, "no_memory"), (P.OVER_QUOTA, "over_quota")):
            n = results.count(code)
            if n:
                M.VALUES.labels(name).inc(n)

    async def _get(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        ns = self.granted_namespace(meta)
        keys = P.get_keys(meta, self.limits)
        prefix = P.get_flag(meta, "prefix")
        ikeys = self.store.internal_keys(ns, keys)
        objs = await self.daemon.run_storage(self.store.get, ns, ikeys, prefix)
        # while this reply is unsent its objects stay charged to ns (a slow reader must not
        # make the pool take room from other tenants)
        held = self.store.hold(ns, ikeys, objs)
        try:
            items: list[bytes | None] = []
            bufs: list[memoryview] = []
            total, more = 0, False
            for key, obj in zip(keys, objs):
                if obj is None:
                    if prefix:
                        break
                    items.append(None)
                    continue
                if bufs and total + obj.nbytes > self.limits.max_payload:
                    more = True  # the client asks again for the rest
                    break
                view = byte_view(obj)
                items.append(encode_header(key, obj.shape, obj.dtype, obj.num_tokens, view,
                                           checksum=checksum_of(obj)))
                bufs.append(view)
                total += obj.nbytes
            self.store.touch(ns, ikeys[: len(items)])
            await self._send(h.op, h.req_id, {"items": items, "more": more}, bufs, total)
            M.BYTES.labels("out").inc(total)
            # cut short by max_payload: the rest is asked again, not missed
            self.daemon.activity.get(ns, len(items) if more else len(keys), len(bufs), total)
        finally:
            if held:
                self.store.unhold(ns, objs)
            live = [o for o in objs if o is not None]
            if live:
                live[0].pool.release_many(live)
        return True

    async def _exists(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        ns = self.granted_namespace(meta)
        ikeys = self.store.internal_keys(ns, P.get_keys(meta, self.limits))
        if P.get_flag(meta, "prefix"):
            hits = await self.daemon.run_storage(self.store.prefix_hits, ikeys)
            await self._send(h.op, h.req_id, {"hits": hits})
        else:
            present = await self.daemon.run_storage(self.store.contains, ikeys)
            await self._send(h.op, h.req_id, {"present": bytes(bytearray(present))})
            hits = sum(present)
        self.daemon.activity.lookup(ns, len(ikeys), hits)
        return True

    async def _delete(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        ns = self.granted_namespace(meta)
        ikeys = self.store.internal_keys(ns, P.get_keys(meta, self.limits))
        self.daemon.pins.release_keys(ns, ikeys)  # a deleted chunk's pins go with it
        n = await self.daemon.run_storage(self.store.delete, ns, ikeys)
        await self._send(h.op, h.req_id, {"deleted": n})
        return True

    # ----------------------------------------------------- control (lmc.server.control)
    async def _clear(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        ns = self.granted_namespace(meta)
        unpinned = self.daemon.pins.clear(ns)
        n = await self.daemon.run_storage(self.store.clear, ns)
        log.info("%s: cleared namespace %s (%d values, %d pinned chunks released)",
                 self.peer, _printable(ns), n, unpinned)
        await self._send(h.op, h.req_id, {"deleted": n})
        return True

    async def _pin(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        ns = self.granted_namespace(meta)
        ikeys = self.store.internal_keys(ns, P.get_keys(meta, self.limits))
        ttl, owner = P.get_number(meta, "ttl"), P.get_owner(meta)
        priority = P.get_opt_int(meta, "priority")
        n = await self._control(self.daemon.pins.pin, ns, ikeys, ttl, owner, priority)
        await self._send(h.op, h.req_id, {"pinned": n})
        return True

    async def _unpin(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        ns = self.granted_namespace(meta)
        owner = P.get_owner(meta)
        ikeys = [] if owner is not None else \
            self.store.internal_keys(ns, P.get_keys(meta, self.limits))
        n = self.daemon.pins.unpin(ns, owner, ikeys)
        await self._send(h.op, h.req_id, {"unpinned": n})
        return True

    async def _priority(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        ns = self.granted_namespace(meta)
        ikeys = self.store.internal_keys(ns, P.get_keys(meta, self.limits))
        priority = P.get_opt_int(meta, "priority")
        if priority is None:
            raise P.ProtocolError(P.BAD_REQUEST, "field 'priority' is required")
        n = await self._control(control.set_priority, self.store, ikeys, priority)
        await self._send(h.op, h.req_id, {"held": n})
        return True

    async def _control(self, fn: Any, *args: Any) -> Any:
        """A control call, its rule's refusal answered as ``refused`` with the rule's code."""
        try:
            return await self.daemon.run_storage(fn, *args)
        except ControlError as e:
            raise P.ProtocolError(P.REFUSED, str(e), code=e.code) from None

    async def _p2p(self, h: P.FrameHeader, meta: dict[str, Any]) -> bool:
        """A P2P directory op: answered by :mod:`lmc.server.p2p.ops` from this session's
        public side (store, limits, granted namespace); the connection always stays open."""
        await self._send(h.op, h.req_id, p2p_ops.answer(self, h, meta))
        return True

    _handlers = {P.HELLO: _hello, P.PING: _ping, P.STATS: _stats, P.PUT: _put, P.GET: _get,
                 P.EXISTS: _exists, P.DELETE: _delete, P.CLEAR: _clear, P.PIN: _pin,
                 P.UNPIN: _unpin, P.PRIORITY: _priority}
    _handlers.update(dict.fromkeys(P.P2P_OPS, _p2p))
