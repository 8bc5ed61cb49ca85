"""Pins taken by ``lookup(pin=True)``: owned by the prompt, bounded in count and in time.

A pin is one extra reference on an L1 chunk, so eviction passes it over until the engine
loads it. Pins are keyed by chunk key and released by the prompt's *keys*, all of them: a
retrieve whose mask skips the leading chunks still releases the pins its lookup took on them
(the engine has that KV already and will never load it). A scheduler that looks up and then
never retrieves (request aborted, preempted) would otherwise pin memory forever, so pins are
also bounded: at most ``max_pins`` at once (further pins are refused, the lookup still
answers) and each expires ``timeout`` seconds after it was taken. Expiry is lazy: every
engine call sweeps what is due, oldest first.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from lmc.memory import MemoryObj


class _Pin:
    __slots__ = ("key", "obj", "deadline")

    def __init__(self, key: Hashable, obj: MemoryObj, deadline: float) -> None:
        self.key = key
        self.obj: MemoryObj | None = obj  # None once released
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
        self._by_key: dict[Hashable, deque[_Pin]] = {}
        self._order: deque[_Pin] = deque()  # by deadline (one timeout: the order taken)
        self.count = 0
        self.refused = 0
        self.expired = 0

    def pin(self, keys: Sequence[Hashable], objs: Sequence[MemoryObj | None]) -> int:
        """Take ownership of one reference on each object (already acquired by the caller);
        those past the bound are released at once. Returns the number pinned."""
        extra: list[MemoryObj] = []
        n = 0
        with self._lock:
            deadline = self.clock() + self.timeout
            for k, o in zip(keys, objs, strict=True):
                if o is None:
                    continue
                if self.count >= self.max_pins:
                    extra.append(o)
                    continue
                p = _Pin(k, o, deadline)
                self._by_key.setdefault(k, deque()).append(p)
                self._order.append(p)
                self.count += 1
                n += 1
            self.refused += len(extra)
            self._compact_locked()
        for o in extra:
            o.release()
        return n

    def release(self, keys: Sequence[Hashable]) -> int:
        """Drop one pin (the oldest) on each key that has one; returns pins dropped."""
        out: list[MemoryObj] = []
        with self._lock:
            for k in keys:
                q = self._by_key.get(k)
                if q:
                    out.append(self._drop_locked(q.popleft()))
                    if not q:
                        del self._by_key[k]
        for o in out:
            o.release()
        return len(out)

    def expire(self) -> int:
        """Release every pin past its deadline; returns how many."""
        try:  # the common case, without the lock: nothing due
            if self._order[0].deadline > self.clock():
                return 0
        except IndexError:  # empty (or emptied by another thread meanwhile)
            return 0
        out: list[MemoryObj] = []
        with self._lock:
            order, now = self._order, self.clock()
            while order and order[0].deadline <= now:
                p = order.popleft()
                if p.obj is None:
                    continue  # released earlier
                q = self._by_key[p.key]
                q.remove(p)
                if not q:
                    del self._by_key[p.key]
                out.append(self._drop_locked(p))
            self.expired += len(out)
        for o in out:
            o.release()
        return len(out)

    def clear(self) -> int:
        with self._lock:
            out = [self._drop_locked(p) for q in self._by_key.values() for p in q]
            self._by_key.clear()
            self._order.clear()
        for o in out:
            o.release()
        return len(out)

    def _drop_locked(self, p: _Pin) -> MemoryObj:
        o, p.obj = p.obj, None
        self.count -= 1
        assert o is not None
        return o

    def _compact_locked(self) -> None:
        """Released pins stay in the deadline queue until due; keep that queue bounded."""
        if len(self._order) > 2 * self.count + 64:
            self._order = deque(p for p in self._order if p.obj is not None)

    def stats(self) -> dict[str, int]:
        return {"pinned_chunks": self.count, "pins_refused": self.refused,
                "pins_expired": self.expired}
