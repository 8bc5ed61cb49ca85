"""Pipelines: the commands for a group of keys on one connection, then their replies.

A tier call (``contains``, ``get``, ``put``...) is cut into jobs, one or more per server; each
job sends all its commands at once and then reads all replies, so a group costs one round
trip whatever its size. A job that fails part-way undoes itself (``abort``): objects it had
allocated go back to the pool and its keys read as misses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmc.lazy_import import LazyModule
from lmc.memory.pool import MemoryObj
from lmc.storage.framing import ValueFraming

from .wire import Deadline, Outbox, ReplyError, WireConn, command

if TYPE_CHECKING:
    import torch
else:  # imported at first use (lmc.lazy_import says why)
    torch = LazyModule("torch", globals())

log = logging.getLogger(__name__)


Allocate = Callable[[Sequence[int], "torch.dtype", int], "MemoryObj | None"]
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


class StreamJob(Job):
    """A job that streams its requests: ``send`` starts over (a retry runs on a fresh
    connection) and asks for as much as its window allows; ``recv`` asks for more as it
    consumes replies, so the pipe never drains."""

    def _reset(self) -> None:
        raise NotImplementedError

    def _ask(self, wc: WireConn, dl: Deadline) -> None:
        raise NotImplementedError

    def send(self, wc: WireConn, dl: Deadline) -> None:
        self._reset()
        self._ask(wc, dl)


class SmallJob(Job):
    """Small commands per key (EXISTS, STRLEN, PEXPIRE, DEL); a key's result is the integer
    reply of its last command."""

    def __init__(self, call: Call, idxs: Sequence[int], *verbs: tuple[bytes, ...]) -> None:
        super().__init__(call, idxs)
        self.verbs = verbs  # each (name, *args after the key)
        self.op = call.op

    def send(self, wc: WireConn, dl: Deadline) -> None:
        rk = self.call.rkeys
        wc.send([b"".join(command(v[0], rk[i], *v[1:]) for i in self.idxs for v in self.verbs)],
                dl)

    def recv(self, wc: WireConn, dl: Deadline) -> None:
        res = self.call.results
        for i in self.idxs:
            for _ in self.verbs:
                r = wc.read_reply(dl)
                if isinstance(r, ReplyError):
                    self.call.reply_errors.append(r)
                    res[i] = None
                elif isinstance(r, int):
                    res[i] = r

    def abort(self) -> None:
        for i in self.idxs:
            self.call.results[i] = None


class SetJob(Job):
    """SETs of header + payload, one ``sendmsg`` per value (the payload is never copied).

    No ``abort``: a value the server acknowledged is stored even if a later reply is lost.
    """

    op = "put"

    def __init__(self, call: Call, idxs: Sequence[int], objs: Sequence[MemoryObj],
                 px: int, framing: ValueFraming | None = None) -> None:
        super().__init__(call, idxs)
        self.objs = objs
        self.px = px
        self.frame = framing if framing is not None else ValueFraming()
        self.head = self.frame.size

    def send(self, wc: WireConn, dl: Deadline) -> None:
        keys, rkeys = self.call.keys, self.call.rkeys
        for i in self.idxs:
            obj = self.objs[i]
            payload = obj.byte_view()
            header = self.frame.encode(keys[i], obj, payload)
            out = Outbox()
            out.add_set(rkeys[i], header, payload, self.px)
            wc.send(out.finish(), dl)

    def recv(self, wc: WireConn, dl: Deadline) -> None:
        res = self.call.results
        for i in self.idxs:
            r = wc.read_reply(dl)
            if r == "OK":
                res[i] = True
                self.call.nbytes += self.head + self.objs[i].nbytes
            elif isinstance(r, ReplyError):
                self.call.reply_errors.append(r)
