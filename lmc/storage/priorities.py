"""Retention priorities that follow a chunk from tier to tier.

A priority is kept by each tier's eviction policy for the keys it holds
(:mod:`lmc.storage.eviction`); a key that leaves a tier forgets it there. But a chunk moves:
write-behind copies it to a lower tier after the priority was set (under
``write_on_evict`` only once L1 evicts it), and a lower-tier hit is promoted back into L1.
So the storage manager remembers the priorities it was asked to set (:class:`Sticky`,
bounded; the oldest forgotten first) and sets them again on each tier a chunk lands in:
the chunk keeps its rank against other traffic wherever it is.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

Key = bytes
MAX_KEYS = 1 << 20  # remembered at once (~100 MB of keys at most; the oldest go first)


class Sticky:
    """Priorities by key, for keys set to anything but 0 (thread-safe)."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._by_key: OrderedDict[Key, int] = OrderedDict()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def remember(self, keys: Sequence[Key], priority: int) -> None:
        with self._lock:
            d = self._by_key
            for k in keys:
                if priority:
                    d[k] = priority
                    d.move_to_end(k)
                else:
                    d.pop(k, None)
            while len(d) > self.max_keys:
                d.popitem(last=False)

    def get(self, key: Key) -> int | None:
        """``key``'s remembered priority (None: 0). Lock-free: one dict lookup, called by a
        tier's eviction policy as each chunk arrives (``rank_arrivals``)."""
        return self._by_key.get(key)

    def forget(self, keys: Sequence[Key]) -> None:
        if self._by_key:
            with self._lock:
                for k in keys:
                    self._by_key.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()

    def apply(self, tier: Any, keys: Sequence[Key]) -> None:
        """Set the remembered priorities of ``keys`` on ``tier`` (one call per priority)."""
        if not self._by_key:
            return
        with self._lock:
            groups: dict[int, list[Key]] = {}
            for k in keys:
                p = self._by_key.get(k)
                if p is not None:
                    groups.setdefault(p, []).append(k)
        for p, ks in groups.items():
            tier.set_priority(ks, p)
