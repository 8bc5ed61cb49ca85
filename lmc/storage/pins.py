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
sweeps what is due, earliest deadline first, so no timer thread is needed.

The same table holds the pins an operator or a request's hints take on purpose
(``CacheEngine.pin``: a TTL of the pinner's choosing, bounded by ``max_pin_ttl``): there a
pin past the bound of chunks or bytes is refused as a whole, with
:class:`lmc.storage.control.PinLimitError` (``strict``), and a deleted chunk's pins go
with it (:meth:`PinTable.release_keys`). An expired pin is nothing: the chunk is an ordinary
one again, evicted by priority and recency.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from lmc import units
from lmc.storage.control import PinLimitError


class Releasable(Protocol):
    def release(self) -> None: ...


class _PinSet:
    __slots__ = ("owner", "objs", "keys", "deadline", "nbytes")

    def __init__(self, owner: Hashable, objs: list[Releasable], keys: list[Hashable] | None,
                 deadline: float) -> None:
        self.owner = owner
        self.objs: list[Releasable] | None = objs  # None once released or replaced
        self.keys = keys  # each obj's chunk key, when the pinner named them (deletes find them)
        self.deadline = deadline
        self.nbytes = sum(getattr(o, "nbytes", 0) for o in objs)


class PinTable:
    """Thread-safe; releases references outside its lock."""

    def __init__(self, max_pins: int, timeout: float,
                 clock: Callable[[], float] = time.monotonic, *,
                 max_bytes: int | None = None) -> None:
        if max_pins < 0:
            raise ValueError(f"max_pins must be >= 0, got {max_pins}")
        if timeout <= 0:
            raise ValueError(f"pin timeout must be > 0 seconds, got {timeout}")
        self.max_pins = max_pins
        self.max_bytes = max_bytes  # None: bounded by count alone
        self.timeout = timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._owners: dict[Hashable, _PinSet] = {}
        self._order: list[tuple[float, int, _PinSet]] = []  # heap by deadline
        self._seq = 0
        self.count = 0  # chunks pinned, all owners
        self.nbytes = 0  # their bytes
        self.refused = 0
        self.expired = 0

    def pin(self, owner: Hashable, objs: Sequence[Releasable], *, ttl: float | None = None,
            keys: Sequence[Hashable] | None = None, strict: bool = False) -> int:
        """Pin ``objs`` for ``owner`` until ``ttl`` seconds from now (the table's
        ``timeout`` when None), replacing whatever it pinned before. The caller hands over
        one reference on each (already acquired, so a chunk re-pinned is never without a
        pin in between). Past the bounds, the leading objects that fit are pinned and the
        rest released at once; with ``strict`` nothing changes and :class:`PinLimitError`
        names the bound (every reference handed over is released). ``keys``: each object's
        chunk key, so :meth:`release_keys` can find it. Returns the number pinned."""
        with self._lock:
            old = self._owners.get(owner)
            held = self.count - (len(old.objs or ()) if old is not None else 0)
            held_bytes = self.nbytes - (old.nbytes if old is not None else 0)
            room = max(0, self.max_pins - held)
            if self.max_bytes is not None:
                room = min(room, _fitting(objs, self.max_bytes - held_bytes))
            old_objs: list[Releasable] = []
            keep: list[Releasable] = []
            extra: list[Releasable] = []
            if strict and room < len(objs):
                refused = PinLimitError(self._refusal(len(objs), objs, held, held_bytes))
            else:
                refused = None
                old_objs = self._take_locked(owner)
                keep, extra = list(objs[:room]), list(objs[room:])
                self.refused += len(extra)
                if keep:
                    p = _PinSet(owner, keep, None if keys is None else list(keys[:room]),
                                self.clock() + (self.timeout if ttl is None else ttl))
                    self._owners[owner] = p
                    self._seq += 1
                    heapq.heappush(self._order, (p.deadline, self._seq, p))
                    self.count += len(keep)
                    self.nbytes += p.nbytes
                self._compact_locked()
        if refused is not None:
            _release_all(list(objs))
            raise refused
        _release_all([*old_objs, *extra])
        return len(keep)

    def _refusal(self, n: int, objs: Sequence[Releasable], held: int, held_bytes: int) -> str:
        if held + n > self.max_pins:
            return (f"pinning {n} chunks would take the pins to {held + n}, past the bound "
                    f"of {self.max_pins} chunks ({held} held by others)")
        want = sum(getattr(o, "nbytes", 0) for o in objs)
        return (f"pinning {units.size(want)} would take the pins to "
                f"{units.size(held_bytes + want)}, past the bound of "
                f"{units.size(self.max_bytes or 0)} ({units.size(held_bytes)} held by others)")

    def release(self, owner: Hashable) -> int:
        """Drop every pin ``owner`` holds; returns how many."""
        with self._lock:
            out = self._take_locked(owner)
        _release_all(out)
        return len(out)

    def release_keys(self, keys: Sequence[Hashable]) -> int:
        """Drop the pins, whoever holds them, on chunks of ``keys`` (a delete's: the chunk
        leaves the tiers, its memory should too); only pins taken with their keys."""
        drop = set(keys)
        out: list[Releasable] = []
        with self._lock:
            for p in self._owners.values():
                if p.keys is None or p.objs is None or drop.isdisjoint(p.keys):
                    continue
                keep = [(k, o) for k, o in zip(p.keys, p.objs) if k not in drop]
                gone = [o for k, o in zip(p.keys, p.objs) if k in drop]
                out += gone
                p.keys, p.objs = [k for k, _ in keep], [o for _, o in keep]
                self.count -= len(gone)
                nb = sum(getattr(o, "nbytes", 0) for o in gone)
                p.nbytes -= nb
                self.nbytes -= nb
        _release_all(out)
        return len(out)

    def expire(self) -> int:
        """Release every pin past its deadline; returns how many."""
        try:  # the common case, without the lock: nothing due
            if self._order[0][0] > self.clock():
                return 0
        except IndexError:  # empty (or emptied by another thread meanwhile)
            return 0
        out: list[Releasable] = []
        with self._lock:
            order, now = self._order, self.clock()
            while order and order[0][0] <= now:
                _, _, p = heapq.heappop(order)
                if p.objs is not None and self._owners.get(p.owner) is p:
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
            self.nbytes = 0
        for o in out:
            o.release()
        return len(out)

    def pinned_keys(self) -> list[Hashable]:
        """Every key pinned with its key named, whoever pins it."""
        with self._lock:
            return [k for p in self._owners.values() if p.keys and p.objs is not None
                    for k in p.keys]

    def deadline_of(self, owner: Hashable) -> float | None:
        """When ``owner``'s pins expire (the table's clock), or None when it holds none."""
        with self._lock:
            p = self._owners.get(owner)
            return None if p is None or p.objs is None else p.deadline

    def _take_locked(self, owner: Hashable) -> list[Releasable]:
        p = self._owners.pop(owner, None)
        if p is None or p.objs is None:
            return []
        objs, p.objs = p.objs, None
        self.count -= len(objs)
        self.nbytes -= p.nbytes
        return objs

    def _compact_locked(self) -> None:
        """Released sets stay in the deadline heap until due; keep that heap bounded."""
        if len(self._order) > 2 * len(self._owners) + 64:
            self._order = [e for e in self._order
                           if e[2].objs is not None and self._owners.get(e[2].owner) is e[2]]
            heapq.heapify(self._order)

    def stats(self) -> dict[str, int]:
        return {"pinned_chunks": self.count, "pin_owners": len(self._owners),
                "pins_refused": self.refused, "pins_expired": self.expired}


def _fitting(objs: Sequence[Releasable], budget: int) -> int:
    """How many leading ``objs`` fit in ``budget`` bytes."""
    n = 0
    for o in objs:
        budget -= getattr(o, "nbytes", 0)
        if budget < 0:
            break
        n += 1
    return n


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
