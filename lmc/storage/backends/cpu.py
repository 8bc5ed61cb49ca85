"""L1: chunks kept in the process's memory pool, evicted by policy when the pool is full.

The tier's capacity is the pool itself (``local_cpu_size``). It holds one reference on each
stored object; an object anyone else still references (a pending retrieve, a pinned lookup) is
passed over by eviction, so it is never freed or reused under a reader.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from lmc.config import CacheConfig
from lmc.lazy_import import LazyModule
from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.metrics import EVICTIONS
from lmc.storage.eviction import EvictionPolicy, make_policy
from lmc.storage.tier import Key, Medium, StorageBackend, TierCapabilities, register_backend

if TYPE_CHECKING:
    import torch
else:  # imported at first use (lmc.lazy_import says why)
    torch = LazyModule("torch", globals())

EvictListener = Callable[[list[tuple[Key, MemoryObj]]], None]


@register_backend("cpu")
class CPUBackend(StorageBackend):
    """Map from key to pool object, evicted in the order of its policy object
    (``eviction_policy``: :mod:`lmc.storage.eviction`)."""

    medium = Medium.MEMORY
    capabilities = TierCapabilities(existence_without_reading=True)

    def __init__(self, spec: str = "cpu", *, config: CacheConfig, pool: MemoryPool,
                 **_: Any) -> None:
        self.pool = pool
        self.policy = config.eviction_policy
        self._policy: EvictionPolicy[Key, MemoryObj] = make_policy(self.policy)
        self._map = self._policy.entries  # lookups that are not a use (never reassigned)
        self._lock = threading.RLock()
        self.on_evict: EvictListener | None = None  # the storage manager's listeners hook in here
        self.evictions = 0
        self.evicted_bytes = 0
        self._closed = False

    # ------------------------------------------------------------------ reads
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        m = self._map
        return [k in m for k in keys]

    def touch(self, keys: Sequence[Key]) -> list[bool]:
        """Presence of each key; present ones count as just used (a re-stored hot prefix
        must not age out of an LRU while it keeps being asked for)."""
        with self._lock:
            m = self._map
            if m.keys().isdisjoint(keys):  # a new prompt: no loop per key
                return [False] * len(keys)
            out = [k in m for k in keys]
            self._policy.touch_many(keys)
        return out

    def prefix_hits(self, keys: Sequence[Key]) -> int:
        m = self._map
        n = 0
        for k in keys:
            if k not in m:
                break
            n += 1
        return n

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        with self._lock:
            m = self._map
            out: list[MemoryObj | None] = list(map(m.get, keys))
            every = None not in out
            hits = cast("list[MemoryObj]", out) if every else [o for o in out if o is not None]
            if hits:
                self.pool.acquire_many(hits)  # one pool lock for the batch, not one each
                if every:
                    self._policy.touch_held(keys)
                else:
                    self._policy.touch_many(keys)  # misses are skipped
        return out

    # ----------------------------------------------------------------- writes
    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        """Keep a reference on each object whose key is new; a key already held (or repeated
        in this call: two reads of one chunk promoted together) keeps its first object, and
        the later one gets no reference, which would otherwise leak with no map entry.
        After ``close()`` nothing is kept (a late promotion from another thread would hold
        its reference forever); an object of another pool is refused (evicting it would
        free nothing here)."""
        with self._lock:
            if self._closed:
                return 0
            m = self._map
            n = len(objs)
            if (len(keys) == n and [o.pool for o in objs].count(self.pool) == n
                    and m.keys().isdisjoint(keys)):  # the usual batch: every key new
                new = dict(zip(keys, objs))
                if len(new) == n:  # and none repeated: no loop per key
                    self.pool.acquire_many(objs)
                    self._policy.insert_many(new)
                    return n
            new = {}
            for k, o in zip(keys, objs, strict=True):
                if o.pool is not self.pool:
                    raise ValueError(f"put of {o!r} for key {k!r}: it belongs to another "
                                     f"memory pool than this tier's")
                if k not in m and k not in new:
                    new[k] = o
            self.pool.acquire_many(new.values())
            self._policy.insert_many(new)
        return len(keys)

    def delete(self, keys: Sequence[Key]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                obj = self._policy.remove(k)
                if obj is not None:
                    obj.release()
                    n += 1
        return n

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, num_tokens: int
                 ) -> MemoryObj | None:
        objs = self.allocate_many(shape, dtype, 1, num_tokens)
        return objs[0] if objs else None

    def allocate_many(self, shape: Sequence[int], dtype: torch.dtype, count: int,
                      num_tokens: int) -> list[MemoryObj]:
        """Pool objects, evicting unreferenced chunks until they fit; fewer than ``count``
        (possibly none) when everything left is referenced."""
        objs = self.pool.allocate_many(shape, dtype, count, num_tokens)
        if len(objs) == count:
            return objs
        need = dtype.itemsize
        for d in shape:
            need *= d
        with self._lock:
            while len(objs) < count:
                more = self.pool.allocate_many(shape, dtype, count - len(objs), num_tokens)
                objs += more
                if len(objs) < count and not self._evict(need * (count - len(objs))):
                    break
        return objs

    def _evict(self, need: int) -> int:
        """Evict unreferenced chunks in the policy's order until about ``need`` bytes are
        freed."""
        victims: list[tuple[Key, MemoryObj]] = []
        freed = 0
        for k, obj in self._policy.victims():
            if obj.ref_count == 1:  # only this tier holds it
                victims.append((k, obj))
                freed += obj.nbytes
                if freed >= need:
                    break
        if not victims:
            return 0
        evict = self._policy.evict
        for k, _ in victims:
            evict(k)
        if self.on_evict is not None:  # gone from the map, memory not yet released
            self.on_evict(victims)
        self.pool.release_many([obj for _, obj in victims])  # neighbours freed as one block
        self.evictions += len(victims)
        self.evicted_bytes += freed
        EVICTIONS.labels(self.name).inc(len(victims))
        return len(victims)

    def clear(self) -> None:
        with self._lock:
            objs = list(self._map.values())
            self._policy.clear()
        self.pool.release_many(objs)

    def clear_namespace(self, prefix: bytes = b"") -> list[Key]:
        """Everything (the pool is this engine's), or the keys starting with ``prefix``."""
        objs: list[MemoryObj | None]
        with self._lock:
            if not prefix:
                keys = list(self._map)
                objs = list(self._map.values())
                self._policy.clear()
            else:
                keys = [k for k in self._map if k.startswith(prefix)]
                objs = [self._policy.remove(k) for k in keys]
        self.pool.release_many([o for o in objs if o is not None])
        return keys

    def set_priority(self, keys: Sequence[Key], priority: int) -> int:
        with self._lock:
            return self._policy.set_priority(keys, priority)

    def priority_of(self, key: Key) -> int:
        with self._lock:
            return self._policy.priority_of(key)

    def rank_arrivals(self, source: Callable[[Key], int | None] | None) -> None:
        with self._lock:
            self._policy.arrival = source

    def coldest(self, nbytes: int) -> list[tuple[Key, MemoryObj]]:
        """What this tier evicts next: its first unreferenced victims, in the policy's
        order, at most ``nbytes`` (at least one), each acquired for the caller (write-ahead
        under ``write_on_evict``: :meth:`lmc.storage.manager.StorageManager.write_ahead`)."""
        out: list[tuple[Key, MemoryObj]] = []
        got = 0
        with self._lock:
            for k, obj in self._policy.victims():
                if out and got + obj.nbytes > nbytes:
                    break
                if obj.ref_count == 1:
                    obj.acquire()
                    out.append((k, obj))
                    got += obj.nbytes
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.clear()

    def __len__(self) -> int:
        return len(self._map)

    def stats(self) -> dict[str, Any]:
        return {"chunks": len(self._map), "evictions": self.evictions,
                "evicted_bytes": self.evicted_bytes, **self.pool.stats()}
