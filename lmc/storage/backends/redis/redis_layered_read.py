"""The Redis tier's layer-by-layer read (``RedisBackend.get_layers``, :mod:`lmc.storage.layered_read`).

Open: one pipelined round trip per server asks each key's head (``GETRANGE key 0 H-1``: the
header, and the tag with an integrity secret) and ``STRLEN``; a head that fails its checks,
or a length that disagrees with it, or (given the engine's ``Geometry``) a shape or dtype none
of the engine's chunks has, is a bad value (deleted, counted, a miss, as in ``get``); a key with no
value is a plain miss; the hits' pool objects are allocated, and the call returns.

Then, on a thread of the call's own, the payloads arrive as ``GETRANGE`` windows in layer
order: over each connection (the hits split across ``remote_connections`` as for ``get``),
layer 0 of its chunks, then layer 1, ..., each layer's range cut into pieces of at most
``get_piece`` bytes with about ``get_window`` bytes requested ahead (the same reasons as
``fetch``: the server reuses a few hot buffers). Each reply lands straight in its slice
of the pool object and is noted as it lands, its bytes counted as moving while they arrive
(``WireConn.on_fill``; ``LayeredRead.note``/``moving``: a load watch's rate and last landing,
:mod:`lmc.storage.layered_watch`; without them the watch saw nothing until the read ended and
could only stop on its stall rule). When every connection has received layer l, the read
announces it; each connection feeds its chunks' xxh3 with a layer's bytes as soon as it has them (a streamed
xxh3 equals the one-shot digest in the header), so at the end only the keyed tag (when
configured; it covers the whole payload in one pass) is left to check. The whole read has one
deadline, ``remote_timeout``, as ``get`` does; a connection that fails or times out fails the
read (the engine recomputes), a value whose checksum or tag fails is deleted and reported not
ok.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from lmc.memory.pool import MemoryObj
from lmc.storage.layered_read import LayeredRead, LayerReadError
from lmc.storage.remote import Rejects
from lmc.storage.serde import CorruptValue, Header

from .jobs import Call, Job, StreamJob
from .wire import Deadline, ReplyError, WireConn, command, getrange

if TYPE_CHECKING:
    from .backend import RedisCalls

log = logging.getLogger(__name__)


class HeadJob(Job):
    """``GETRANGE key 0 H-1`` and ``STRLEN key`` per key; result ``(head, length)``."""

    op = "get"

    def __init__(self, call: Call, idxs: Sequence[int], hsize: int) -> None:
        super().__init__(call, idxs)
        self.hsize = hsize

    def send(self, wc: WireConn, dl: Deadline) -> None:
        rk = self.call.rkeys
        end = b"%d" % (self.hsize - 1)
        wc.send([b"".join(command(b"GETRANGE", rk[i], b"0", end) + command(b"STRLEN", rk[i])
                          for i in self.idxs)], dl)

    def recv(self, wc: WireConn, dl: Deadline) -> None:
        res = self.call.results
        for i in self.idxs:
            head, n = wc.read_reply(dl), wc.read_reply(dl)
            for r in (head, n):
                if isinstance(r, ReplyError):
                    self.call.reply_errors.append(r)
            ok = isinstance(head, bytes) and isinstance(n, int)
            res[i] = (head, n) if ok else None

    def abort(self) -> None:
        for i in self.idxs:
            self.call.results[i] = None


class _Landing:
    """Which layer every connection of the call has received: the read's ``landed``; and
    each piece as it lands (``note``: a load watch's progress, its rate and last landing)."""

    def __init__(self, read: LayeredRead, index: Sequence[int]) -> None:
        self.read = read
        self.index = index  # a job's key j is the read's key index[j]
        self.parts: dict[int, int] = {}
        self.lock = threading.Lock()

    def note(self, j: int, nbytes: int) -> None:
        self.read.note(self.index[j], nbytes)

    def join(self, part: int) -> None:
        with self.lock:
            self.parts[part] = -1

    def landed(self, part: int, layer: int) -> None:
        with self.lock:
            self.parts[part] = layer
            low = min(self.parts.values())
        if low >= 0:
            self.read.landed(low)


class LayerJob(StreamJob):
    """The payloads of some opened values over one connection, layer by layer."""

    op = "get"

    def __init__(self, call: Call, idxs: Sequence[int], opened: dict[int, tuple[MemoryObj,
                 Header]], hsize: int, layers: int, piece: int, window: int,
                 landing: _Landing) -> None:
        super().__init__(call, idxs)
        self.opened = opened
        self.hsize = hsize
        self.layers = layers
        self.piece = piece
        self.window = window
        self.landing = landing
        landing.join(id(self))
        self.complete = False
        self.hashers: dict[int, Any] = {}
        self._arrived = 0  # bytes of the piece being received (``_arriving``)
        self._reset()

    def _reset(self) -> None:
        reqs = []  # (layer, key index, payload offset, bytes)
        for layer in range(self.layers):
            for i in self.idxs:
                obj, hdr = self.opened[i]
                lb = hdr.payload_len // self.layers
                off, end = layer * lb, (layer + 1) * lb
                while off < end:
                    n = min(self.piece, end - off)
                    reqs.append((layer, i, off, n))
                    off += n
        self._todo = deque(reqs)
        self._pending: deque[tuple[int, int, int, int]] = deque()
        self._left = [0] * self.layers
        for layer, *_ in reqs:
            self._left[layer] += 1
        self._next_layer = 0
        self._limit = max(2, min(64, self.window * len(reqs) // max(1, sum(r[3] for r in reqs))))
        self.broken = ""
        self.hashers = {i: xxhash.xxh3_64() for i in self.idxs}
        self._views = {i: self.opened[i][0].byte_view() for i in self.idxs}
        self.complete = False

    def _ask(self, wc: WireConn, dl: Deadline) -> None:
        rk = self.call.rkeys
        out = []
        while self._todo and len(self._pending) < self._limit:
            req = self._todo.popleft()
            _, i, off, n = req
            out.append(getrange(rk[i], self.hsize + off, n))
            self._pending.append(req)
        if out:
            wc.send([b"".join(out)], dl)

    def _arriving(self, nbytes: int) -> None:
        """``WireConn.on_fill``: bytes of the piece being received, moving until it lands."""
        self._arrived += nbytes
        self.landing.read.moving(nbytes)

    def recv(self, wc: WireConn, dl: Deadline) -> None:
        self._arrived = 0
        wc.on_fill = self._arriving
        try:
            self._recv(wc, dl)
        finally:
            wc.on_fill = None
        self.complete = not self.broken

    def _recv(self, wc: WireConn, dl: Deadline) -> None:
        short: list[str] = []
        read = self.landing.read
        while self._pending:
            layer, i, off, n = self._pending.popleft()

            def sink(_h: bytes, got: int, i: int = i, off: int = off, n: int = n
                     ) -> memoryview | None:
                if got != n:  # the value vanished or changed since it was opened
                    short.append(f"a piece of {got} bytes where {n} were asked")
                    return None
                return self._views[i][off: off + n]

            try:
                r = wc.read_value(dl, 0, sink)
                if not short and not isinstance(r, ReplyError) and r is not None:
                    self.landing.note(i, n)  # before the in-flight count drops
            finally:
                read.moving(-self._arrived)
                self._arrived = 0
            if isinstance(r, ReplyError):
                self.call.reply_errors.append(r)
                short.append(f"reply error {r.message}")
            elif r is None:
                short.append("no value")
            if short:  # stop asking; read what is in flight (the connection stays in sync)
                self.broken = short[0]
                self._todo.clear()
                continue
            self._left[layer] -= 1
            self._ask(wc, dl)  # keep the pipe full before hashing what landed
            while self._next_layer < self.layers and self._left[self._next_layer] == 0:
                lyr = self._next_layer
                for j in self.idxs:
                    lb = self.opened[j][1].payload_len // self.layers
                    self.hashers[j].update(self._views[j][lyr * lb:(lyr + 1) * lb])
                self._next_layer += 1
                self.landing.landed(id(self), lyr)

    def abort(self) -> None:
        self.complete = False


class RedisLayeredRead:
    """One ``get_layers`` call (see the module docstring)."""

    def __init__(self, tier: RedisCalls, keys: Sequence[bytes]) -> None:
        self.tier = tier
        self.keys = keys
        self.rkeys = [tier.remote_key(k) for k in keys]
        self.t0 = time.perf_counter()
        self.rejects: Rejects[int] = Rejects(f"redis tier {tier.display}")
        self.opened: dict[int, tuple[MemoryObj, Header]] = {}
        self.heads: dict[int, bytes] = {}
        self.alloc_failures = 0
        objs = self._open()
        self.layers = next(iter(self.opened.values()))[1].shape[0] if self.opened else 1
        self.read = LayeredRead(objs, self.layers)
        self.read.stops_on_cut = False  # the connections go on in layer order (a watch's rule)

    def _open(self) -> list[MemoryObj | None]:
        tier = self.tier
        framing = tier.framing
        hsize = framing.size
        call = Call("get", self.keys, self.rkeys, [None] * len(self.keys))
        tier.dispatch(call, lambda c, idxs: HeadJob(c, idxs, hsize), Deadline(tier.timeout),
                       parallel=False)
        objs: list[MemoryObj | None] = [None] * len(self.keys)
        layers = None
        for i, r in enumerate(call.results):
            if r is None or not r[0]:
                continue  # no value (or the server did not answer): a miss
            head, n = r
            try:
                # as get() does: header and the engine's geometry, before allocating
                hdr = framing.decode(head, self.keys[i], tier.geometry)
                if len(head) != hsize or n != hsize + hdr.payload_len:
                    raise CorruptValue(f"value is {n} bytes, its header says "
                                       f"{hsize + hdr.payload_len}")
            except CorruptValue as e:
                self.rejects.reject(i, e, self.rkeys[i].decode(errors="replace"))
                continue
            if layers is None:
                layers = hdr.shape[0]
            if hdr.shape[0] != layers:  # another model's shape: not this call's, a miss
                tier.metrics.error("get", "layers_mismatch")
                continue
            obj = tier.pool.allocate(hdr.shape, hdr.dtype, hdr.num_tokens)
            if obj is None:
                self.alloc_failures += 1
                continue
            objs[i] = obj
            self.opened[i] = (obj, hdr)
            self.heads[i] = head
        return objs

    def start(self) -> None:
        if not self.opened:
            self._end(None, {})
            return
        if not self.tier.coordinators.start(self._run):  # close() joins every one it started
            self._end(LayerReadError("redis tier closed"), {})

    def _run(self) -> None:
        tier = self.tier
        jobs: list[LayerJob] = []
        sub = sorted(self.opened)  # the hits only, split over the connections as get() does
        landing = _Landing(self.read, sub)
        err: BaseException | None = None
        try:
            sub_call = Call("get", [self.keys[i] for i in sub], [self.rkeys[i] for i in sub],
                            [None] * len(sub))
            opened = {j: self.opened[i] for j, i in enumerate(sub)}

            def make(c: Call, idxs: Sequence[int]) -> LayerJob:
                job = LayerJob(c, idxs, opened, tier.framing.size, self.layers, tier.piece,
                               tier.window, landing)
                jobs.append(job)
                return job

            tier.dispatch(sub_call, make, Deadline(tier.timeout), parallel=True)
            done = {j for job in jobs if job.complete for j in job.idxs}
            if len(done) < len(sub):
                why = next((job.broken for job in jobs if job.broken),
                           "connection failed, timed out or refused")
                raise LayerReadError(f"{len(sub) - len(done)} of {len(sub)} values not read "
                                     f"({why})")
            hashers = {sub[j]: h for job in jobs for j, h in job.hashers.items()}
        except BaseException as e:  # noqa: BLE001 - reported through the read
            err = e
            hashers = {}
        self._end(err, hashers)

    def _end(self, err: BaseException | None, hashers: dict[int, Any]) -> None:
        tier = self.tier
        ok = [False] * len(self.keys)
        try:
            if err is None:
                for i, (obj, hdr) in self.opened.items():
                    try:
                        self._check(i, obj, hdr, hashers[i])
                        ok[i] = True
                    except CorruptValue as e:
                        self.rejects.reject(i, e, self.rkeys[i].decode(errors="replace"))
            bad = self.rejects.take()
            if bad:
                tier.metrics.checksum_failure(len(bad))
                tier.count(corrupt=len(bad))
                tier.delete([self.keys[i] for i in bad])
            if self.alloc_failures:
                tier.count(alloc_failures=self.alloc_failures)
            if err is not None:
                log.debug("redis tier %s: layered read failed: %s", tier.display, err)
            hits = sum(ok)
            tier.count(get_calls=1, get_seconds=time.perf_counter() - self.t0, get_hit=hits,
                        get_miss=len(self.keys) - hits,
                        bytes_read=sum(self.opened[i][1].payload_len + tier.framing.size
                                       for i in self.opened if ok[i]))
        finally:
            if err is not None:
                self.read.fail(err)
            else:
                self.read.finish(ok)

    def _check(self, i: int, obj: MemoryObj, hdr: Header, hasher: Any) -> None:
        # the payload was hashed as it landed: the framing checks that digest and the tag
        self.tier.framing.verify(self.keys[i], self.heads[i], hdr, obj.byte_view(),
                               digest=hasher.intdigest())
