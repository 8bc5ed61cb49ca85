"""Pins taken by ``lookup(pin=True)``: one set per owner, bounded in count and in time.

A pin is one extra reference on an L1 chunk, so eviction passes it over until the engine
loads it. Every pin belongs to an *owner*: the request id the caller names, else the prompt
itself (its token sequence). Owners matter because a scheduler asks again and again for a
request that is still waiting: a repeated lookup by one owner *replaces* that owner's pins
(it never stacks them), and a retrieve releases only its own owner's pins, on every chunk,
masked ones included (the engine has that KV already and will never load it) -- never the
pins another request took on a shared prefix, which would let those chunks be evicted
between that request's lookup and its load.

A scheduler that looks up and then never retrieves (request aborted, preempted) would pin
memory forever, so pins are also bounded: at most ``max_pins`` chunks at once (a lookup past
the bound pins its leading chunks that fit and no more; it still answers) and each owner's
pins expire ``timeout`` seconds after its last lookup. Expiry is lazy: every engine call
sweeps what is due, oldest first, so no timer thread is needed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol


class Releasable(Protocol):
    def release(self) -> None: ...


class _PinSet:
    __slots__ = ("owner", "objs", "deadline")

    def __init__(self, owner: Hashable, objs: list[Releasable], deadline: float) -> None:
        self.owner = owner
        self.objs: list[Releasable] | None = objs  # None once released or replaced
        self.deadline = deadline


class PinTable:
    """Thread-safe; releases references outside its lock."""

    def __init__(self, max_pins: int, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_pins < 0:
            raise ValueError(f"max_pins must be >= 0, got {max_pins}")
        if timeout <= 0:
            raise ValueError(f"pin timeout must be > 0 seconds, got {timeout}")
        self.max_pins = max_pins
        self.timeout = timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._owners: dict[Hashable, _PinSet] = {}
        self._order: deque[_PinSet] = deque()  # by deadline (one timeout: the order taken)
        self.count = 0  # chunks pinned, all owners
        self.refused = 0
        self.expired = 0

    def pin(self, owner: Hashable, objs: Sequence[Releasable]) -> int:
        """Pin ``objs`` for ``owner``, replacing whatever it pinned before. The caller hands
        over one reference on each (already acquired, so a chunk re-pinned is never without a
        pin in between); those past the bound are released at once. Returns the number
        pinned."""
        with self._lock:
            old = self._take_locked(owner)
            room = max(0, self.max_pins - self.count)
            keep, extra = list(objs[:room]), list(objs[room:])
            self.refused += len(extra)
            if keep:
                p = _PinSet(owner, keep, self.clock() + self.timeout)
                self._owners[owner] = p
                self._order.append(p)
                self.count += len(keep)
            self._compact_locked()
        _release_all([*old, *extra])
        return len(keep)

    def release(self, owner: Hashable) -> int:
        """Drop every pin ``owner`` holds; returns how many."""
        with self._lock:
            out = self._take_locked(owner)
        _release_all(out)
        return len(out)

    def expire(self) -> int:
        """Release every pin past its deadline; returns how many."""
        try:  # the common case, without the lock: nothing due
            if self._order[0].deadline > self.clock():
                return 0
        except IndexError:  # empty (or emptied by another thread meanwhile)
            return 0
        out: list[Releasable] = []
        with self._lock:
            order, now = self._order, self.clock()
            while order and order[0].deadline <= now:
                p = order.popleft()
                if p.objs is not None:  # else released or replaced earlier
                    out += self._take_locked(p.owner)
            self.expired += len(out)
        _release_all(out)
        return len(out)

    def clear(self) -> int:
        with self._lock:
            out = [o for p in self._owners.values() for o in p.objs or ()]
            for p in self._owners.values():
                p.objs = None
            self._owners.clear()
            self._order.clear()
            self.count = 0
        for o in out:
            o.release()
        return len(out)

    def _take_locked(self, owner: Hashable) -> list[Releasable]:
        p = self._owners.pop(owner, None)
        if p is None or p.objs is None:
            return []
        objs, p.objs = p.objs, None
        self.count -= len(objs)
        return objs

    def _compact_locked(self) -> None:
        """Released sets stay in the deadline queue until due; keep that queue bounded."""
        if len(self._order) > 2 * len(self._owners) + 64:
            self._order = deque(p for p in self._order if p.objs is not None)

    def stats(self) -> dict[str, int]:
        return {"pinned_chunks": self.count, "pin_owners": len(self._owners),
                "pins_refused": self.refused, "pins_expired": self.expired}


def _release_all(objs: list[Releasable]) -> None:
    """Release ``objs``: pool objects in one call under the pool's lock (a pinned lookup of
    a long prompt replaces a pin per chunk; one call each allocated enough to trigger
    garbage collections), anything else one by one."""
    if not objs:
        return
    release_many = getattr(getattr(objs[0], "pool", None), "release_many", None)
    if release_many is not None:
        release_many(objs)  # another pool's objects are released one by one inside
        return
    for o in objs:
        o.release()
