"""Pipelines: the commands for a group of keys on one connection, then their replies.

A tier call (``contains``, ``get``, ``put``...) is cut into jobs, one or more per server; each
job sends all its commands at once and then reads all replies, so a group costs one round
trip whatever its size. A job that fails part-way undoes itself (``abort``): objects it had
allocated go back to the pool and its keys read as misses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmc.memory import MemoryObj
from lmc.serde import (
    HEADER_SIZE,
    CorruptValue,
    Header,
    decode_header,
    encode_header,
    tensor_bytes,
    verify_payload,
)

from .redis_wire import Deadline, Outbox, ReplyError, WireConn, command

log = logging.getLogger(__name__)
Allocate = Callable[[Sequence[int], torch.dtype, int], "MemoryObj | None"]
_TOPOLOGY_ERRORS = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")


class Call:
    """What the jobs of one tier call share: keys, results, and what went wrong."""

    def __init__(self, op: str, keys: Sequence[bytes], rkeys: Sequence[bytes],
                 results: list[Any]) -> None:
        self.op = op
        self.keys = keys
        self.rkeys = rkeys
        self.results = results
        self.corrupt = 0
        self.reply_errors: list[ReplyError] = []
        self.alloc_failures = 0
        self.nbytes = 0

    @property
    def topology_changed(self) -> bool:
        return any(e.kind in _TOPOLOGY_ERRORS for e in self.reply_errors)


class Job:
    op = "?"

    def __init__(self, call: Call, idxs: Sequence[int]) -> None:
        self.call = call
        self.idxs = idxs

    def send(self, wc: WireConn, dl: Deadline) -> None:
        raise NotImplementedError

    def recv(self, wc: WireConn, dl: Deadline) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Undo partial results after a failure (default: nothing to undo)."""


class SmallJob(Job):
    """One small command per key, replies kept as they come (EXISTS, PEXPIRE, DEL)."""

    def __init__(self, call: Call, idxs: Sequence[int], verb: bytes, *extra: bytes) -> None:
        super().__init__(call, idxs)
        self.verb = verb
        self.extra = extra
        self.op = call.op

    def send(self, wc: WireConn, dl: Deadline) -> None:
        rk = self.call.rkeys
        wc.send([b"".join(command(self.verb, rk[i], *self.extra) for i in self.idxs)], dl)

    def recv(self, wc: WireConn, dl: Deadline) -> None:
        res = self.call.results
        for i in self.idxs:
            r = wc.read_reply(dl)
            if isinstance(r, ReplyError):
                self.call.reply_errors.append(r)
            elif isinstance(r, int):
                res[i] = r

    def abort(self) -> None:
        for i in self.idxs:
            self.call.results[i] = None


class GetJob(Job):
    """GETs whose payloads land directly in freshly allocated pool objects, then verified."""

    op = "get"

    def __init__(self, call: Call, idxs: Sequence[int], allocate: Allocate) -> None:
        super().__init__(call, idxs)
        self.allocate = allocate
        self._i = -1
        self._obj: MemoryObj | None = None
        self._hdr: Header | None = None
        self._bad: list[int] = []
        self._held: list[int] = []

    def send(self, wc: WireConn, dl: Deadline) -> None:
        rk = self.call.rkeys
        wc.send([b"".join(command(b"GET", rk[i]) for i in self.idxs)], dl)

    def _sink(self, head: bytes, total: int) -> memoryview | None:
        try:
            hdr = decode_header(head, expected_key=self.call.keys[self._i])
            if hdr.payload_len != total - HEADER_SIZE:
                raise CorruptValue(f"value is {total} bytes, header says "
                                   f"{HEADER_SIZE} + {hdr.payload_len}")
        except CorruptValue as e:
            self._corrupt(e)
            return None
        obj = self.allocate(hdr.shape, hdr.dtype, hdr.num_tokens)
        if obj is None:  # pool full: a miss, not an error
            self.call.alloc_failures += 1
            return None
        self._obj, self._hdr = obj, hdr
        return tensor_bytes(obj.tensor)

    def _corrupt(self, e: CorruptValue) -> None:
        log.warning("redis value %s is corrupt (%s): treated as a miss and deleted",
                    self.call.rkeys[self._i].decode(errors="replace"), e)
        self._bad.append(self._i)

    def recv(self, wc: WireConn, dl: Deadline) -> None:
        res = self.call.results
        for i in self.idxs:
            self._i = i
            r = wc.read_value(dl, HEADER_SIZE, self._sink)
            obj, hdr = self._obj, self._hdr
            self._obj = self._hdr = None
            if obj is not None and hdr is not None:
                try:
                    verify_payload(hdr, tensor_bytes(obj.tensor))
                except CorruptValue as e:
                    obj.release()
                    self._corrupt(e)
                    continue
                res[i] = obj
                self._held.append(i)
                self.call.nbytes += HEADER_SIZE + hdr.payload_len
            elif isinstance(r, ReplyError):
                self.call.reply_errors.append(r)
        if self._bad:  # same connection, still in sync: remove what we refused to serve
            rk = self.call.rkeys
            wc.send([b"".join(command(b"DEL", rk[i]) for i in self._bad)], dl)
            for _ in self._bad:
                wc.read_reply(dl)
            self.call.corrupt += len(self._bad)
            self._bad = []

    def abort(self) -> None:
        if self._obj is not None:
            self._obj.release()
            self._obj = None
        res = self.call.results
        for i in self._held:
            if res[i] is not None:
                res[i].release()
                res[i] = None
        self._held = []
        self._bad = []


class SetJob(Job):
    """SETs of header + payload, one ``sendmsg`` per value (the payload is never copied).

    No ``abort``: a value the server acknowledged is stored even if a later reply is lost.
    """

    op = "put"

    def __init__(self, call: Call, idxs: Sequence[int], objs: Sequence[MemoryObj],
                 px: int) -> None:
        super().__init__(call, idxs)
        self.objs = objs
        self.px = px

    def send(self, wc: WireConn, dl: Deadline) -> None:
        keys, rkeys = self.call.keys, self.call.rkeys
        for i in self.idxs:
            obj = self.objs[i]
            payload = tensor_bytes(obj.tensor)
            header = encode_header(keys[i], obj.shape, obj.dtype, obj.num_tokens, payload)
            out = Outbox()
            out.add_set(rkeys[i], header, payload, self.px)
            wc.send(out.finish(), dl)

    def recv(self, wc: WireConn, dl: Deadline) -> None:
        res = self.call.results
        for i in self.idxs:
            r = wc.read_reply(dl)
            if r == "OK":
                res[i] = True
                self.call.nbytes += HEADER_SIZE + self.objs[i].nbytes
            elif isinstance(r, ReplyError):
                self.call.reply_errors.append(r)
