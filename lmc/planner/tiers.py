"""One tier stack without KV bytes: lmc's L1 tier, the disk tier's index, an lmc daemon's memory.

What is lmc's own code here and what mirrors it:

* **L1** is :class:`lmc.storage.backends.cpu.CPUBackend` itself over an :class:`AddressPool`
  (lmc's TLSF allocator and ``MemoryObj`` reference counts, no buffer): its eviction policy
  object (:mod:`lmc.storage.eviction`), its allocate-evict-retry loop and its rule that a
  referenced chunk is never evicted run unchanged.
* **remote** is an lmc daemon (``lmc://``): its memory tier is the same ``CPUBackend`` over a
  pool of the remote's size, so it is that class again. A Redis remote with an LRU
  ``maxmemory-policy`` evicts by sampled LRU, which this approximates.
* **disk** is :class:`SimDisk` over the disk tier's own index
  (:class:`lmc.storage.backends.disk.index.DiskIndex`: the tier's eviction policy objects,
  its byte accounting, a file of a 4 KiB header block plus the payload rounded up to 4 KiB,
  and its eviction, which stops early at a same-size victim the tier recycles), driven as
  the tier's writes and reads drive it, with no files; ``contains`` is not an access,
  ``get`` and a re-put are. ``tests/planner/test_disk_index.py`` drives the real
  ``DiskBackend`` and :class:`SimDisk` with the same operations and checks they hold the
  same keys in the same order.

:class:`SimCache` strings them together, in the order of any ``tiers:`` chain of a config
(:func:`chain_tiers` reads :meth:`lmc.config.CacheConfig.tier_chain`, the list
:mod:`lmc.storage.chain` builds the real tiers from), the way :class:`lmc.storage.manager.StorageManager`
does (prefix lookups each tier once, promotion of lower-tier hits into L1, write-through or
write-on-evict), with one difference that is the point of a simulation: the write-behind queues are drained
at the end of each request (:meth:`SimCache.drain`), where the real ones drain on their own
threads whenever the tier is ready. Until then a queued chunk holds its pool memory, as in
lmc: under write-through it cannot be evicted from L1, and under write-on-evict an
allocation under pressure keeps evicting into the queue until the queue's bound
(``write_queue_size``, at most a quarter of the pool) refuses a victim, which is then lost
rather than written (``lmc/storage/manager.py`` documents this behaviour). See
docs/planner.md for what the drain point changes and by how much.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lmc.config import CacheConfig, TierEntry
from lmc.memory.pool import MemoryObj
from lmc.planner.addrpool import AddressPool
from lmc.settings import parse_size
from lmc.storage.backends.cpu import CPUBackend
from lmc.storage.backends.disk.index import DiskIndex, file_bytes
from lmc.storage.manager import WRITE_POLICIES
from lmc.storage.tier import Medium, backend_factory, tier_medium

Key = Any  # the planner's interned key ids (ints); lmc's tiers treat keys as opaque
_BYTE = torch.uint8


def memory_tier(capacity: int, eviction_policy: str = "lru") -> CPUBackend:
    """lmc's L1 tier class over ``capacity`` bytes of address space."""
    cfg = CacheConfig(eviction_policy=eviction_policy, local_cpu_size=max(capacity, 4096))
    # AddressPool has the MemoryPool calls the CPU tier makes, with no buffer behind them
    return CPUBackend(config=cfg, pool=AddressPool(capacity))  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, order=True)
class SimTier:
    """One lower tier of a simulated chain: its name (its level in the results), what it is
    simulated as (``disk``: :class:`SimDisk`; ``memory``: a daemon-like memory tier,
    :class:`RemoteDaemon`; ``peer``: :class:`PeerTier`), its capacity and eviction policy."""

    name: str
    kind: str
    capacity: int = 0
    eviction_policy: str = "lru"

    def build(self) -> LowerTier:
        if self.kind == "disk":
            return SimDisk(self.capacity, self.eviction_policy, name=self.name)
        if self.kind == "memory":
            return RemoteDaemon(self.capacity, self.eviction_policy, name=self.name)
        if self.kind == "peer":
            return PeerTier(self.name)
        raise ValueError(f"tier {self.name}: no simulation of kind {self.kind!r}")


def _leaf(entry: TierEntry) -> TierEntry:
    """The tier a wrapper finally wraps: counting or rate limits do not change what it holds."""
    while entry.inner is not None:
        entry = entry.inner
    return entry


def chain_tiers(config: CacheConfig, sizes: Mapping[str, int | str] | None = None
                ) -> list[SimTier]:
    """The lower tiers of ``config``'s chain (``tiers:``, or the shorthand keys' chain), top
    down, as the planner simulates them. A tier is known by its backend's declared medium:
    local storage is the disk tier's index (its capacity and ``eviction_policy`` from the
    entry, as the tier reads them); a remote store is a memory tier of ``sizes[name]`` bytes
    (a daemon's pool, Redis's ``maxmemory``, a Mooncake cluster's segments: not in the
    engine's config, so the caller says it), or, for a backend that declares
    ``planner_capacity(options)``, what its entry says it holds (a ``mooncake://`` entry:
    its own ``segment`` up to the master's eviction watermark, this engine the only holder);
    a peer holds nothing a one-engine trace stored.
    Two tiers of one backend are named ``redis``, ``redis#2``..."""
    sizes = dict(sizes or {})
    out: list[SimTier] = []
    seen: dict[str, int] = {}
    for entry in config.tier_chain()[1:]:
        leaf = _leaf(entry)
        factory = backend_factory(leaf.backend)
        base = str(getattr(factory, "name", leaf.backend))
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}#{seen[base]}"
        options = dict(leaf.options)
        policy = str(options.get("eviction_policy", "lru"))
        medium = tier_medium(factory)
        where = f"{leaf.where} ({leaf.backend})"
        if medium == Medium.PEER:
            out.append(SimTier(name, "peer"))
        elif medium == Medium.LOCAL_STORAGE:
            tier_cfg = config.replace(**leaf.config) if leaf.config else config
            size = sizes.get(name, options.get("capacity") or tier_cfg.local_disk_size)
            out.append(SimTier(name, "disk", parse_size(size, f"{where} capacity"), policy))
        else:  # a remote store: a daemon, Redis, a Mooncake cluster...
            size = sizes.get(name)
            held = getattr(factory, "planner_capacity", None)
            if size is None and held is not None:
                size = held(options)  # the entry says what it holds (Mooncake: its segment)
            if size is None:
                raise ValueError(f"{where}: the planner needs this tier's size (what it "
                                 f"holds is not in the engine's config): give sizes[{name!r}]")
            out.append(SimTier(name, "memory", parse_size(size, f"{where} size"), policy))
    return out


class SimDisk:
    """The disk tier without files: its own index (:class:`lmc.storage.backends.disk.index.
    DiskIndex`), driven as the tier's writes and reads drive it (see the module doc)."""

    def __init__(self, capacity: int, eviction_policy: str = "lru", name: str = "disk"
                 ) -> None:
        self.name = name
        self.capacity = int(capacity)
        self.index = DiskIndex(self.capacity, eviction_policy)
        self.evictions = 0
        self.rejected = 0

    @property
    def used(self) -> int:
        return self.index.used

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        idx = self.index.entries
        return [k in idx for k in keys]

    def touch_present(self, keys: Sequence[Key]) -> list[bool]:
        """``get``'s first half: present keys become most recently used (before any read)."""
        out = self.contains(keys)
        self.index.policy.touch_many(keys)
        return out

    def put(self, keys: Sequence[Key], nbytes: Sequence[int]) -> int:
        """The tier's ``_write`` without the file: too large is refused, a held key is an
        access, else room is made (victims unlinked at once: nothing else writes here) and
        the value committed."""
        stored = 0
        index = self.index
        for k, n in zip(keys, nbytes):
            size = file_bytes(n)
            if size > self.capacity:
                self.rejected += 1
                continue
            if k in index.entries:
                index.policy.access(k)
                stored += 1
                continue
            done = False
            while not done:
                done, ev = index.make_room(size, _no_file)
                if ev is not None:
                    index.dying -= ev.dying  # unlinked
                    self.evictions += len(ev.gone)
            index.commit(k, size)
            stored += 1
        return stored

    def keys_in_order(self) -> list[Key]:
        """Held keys, first to evict first."""
        return self.index.policy.keys_in_order()

    def __len__(self) -> int:
        return len(self.index.entries)


def _no_file(key: Key, size: int) -> Key:
    """The planner's ``retire``: there is no file, the key stands for it."""
    return key


class RemoteDaemon:
    """An lmc daemon's memory tier seen from the engine: ``contains``, ``get`` (refreshes the
    daemon's LRU), ``put`` (the daemon allocates in its own pool, evicting)."""

    def __init__(self, capacity: int, eviction_policy: str = "lru", name: str = "remote"
                 ) -> None:
        self.name = name
        self.tier = memory_tier(capacity, eviction_policy)

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return self.tier.contains(keys)

    def touch_present(self, keys: Sequence[Key]) -> list[bool]:
        objs = self.tier.get(keys)
        out = [o is not None for o in objs]
        for o in objs:
            if o is not None:
                o.release()
        return out

    def put(self, keys: Sequence[Key], nbytes: Sequence[int]) -> int:
        stored = 0
        tier = self.tier
        for k, n in zip(keys, nbytes):
            obj = tier.allocate((n,), _BYTE, 0)
            if obj is None:
                continue
            tier.put([k], [obj])
            obj.release()
            stored += 1
        return stored

    @property
    def evictions(self) -> int:
        return self.tier.evictions

    def __len__(self) -> int:
        return len(self.tier)


class PeerTier:
    """A P2P tier seen from one engine: it reads other engines' exports, which a one-engine
    trace never makes, so it holds nothing (it is in the chain, asked and missed)."""

    evictions = 0

    def __init__(self, name: str = "p2p") -> None:
        self.name = name

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return [False] * len(keys)

    touch_present = contains

    def put(self, keys: Sequence[Key], nbytes: Sequence[int]) -> int:
        return 0  # a peer tier stores nothing (its exports are L1's own chunks)

    def __len__(self) -> int:
        return 0


LowerTier = SimDisk | RemoteDaemon | PeerTier


class SimCache:
    """L1 plus lower tiers -- ``chain`` (any order and number, e.g. :func:`chain_tiers` of
    a config), else an optional disk and remote tier -- driven the way the engine's storage
    manager drives lmc's tiers; every chunk is ``bytes_per_token * tokens`` bytes."""

    def __init__(self, l1_bytes: int, disk_bytes: int = 0, remote_bytes: int = 0,
                 write_policy: str = "write_through", *, bytes_per_token: int,
                 eviction_policy: str = "lru", queue_bytes: int = 1 << 30,
                 chain: Sequence[SimTier] | None = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy {write_policy!r}: choose one of "
                             f"{', '.join(WRITE_POLICIES)}")
        if l1_bytes < 4096:
            raise ValueError(f"L1 size must be at least 4 KiB, got {l1_bytes} B")
        if bytes_per_token < 1:
            raise ValueError(f"bytes_per_token must be >= 1, got {bytes_per_token}")
        self.write_policy = write_policy
        self.bpt = bytes_per_token
        self.l1 = memory_tier(l1_bytes, eviction_policy)
        if chain is None:  # the fixed shape: the disk tier's own policy (LRU), the remote's
            fixed = [SimTier("disk", "disk", disk_bytes)] if disk_bytes else []
            if remote_bytes:
                fixed.append(SimTier("remote", "memory", remote_bytes, eviction_policy))
            chain = fixed
        elif disk_bytes or remote_bytes:
            raise ValueError("give a chain or disk/remote sizes, not both")
        self.lower: list[LowerTier] = [t.build() for t in chain]
        self.levels = ["L1"] + [t.name for t in self.lower]
        # one queue per lower tier, bounded as StorageManager bounds it
        share = 4 if write_policy == "write_on_evict" else 2
        self.queue_cap = min(queue_bytes, self.l1.pool.size // share)
        self._queues: list[dict[Key, MemoryObj]] = [{} for _ in self.lower]
        self._queued = [0] * len(self.lower)
        self.dropped = [0] * len(self.lower)
        if self.lower and write_policy == "write_on_evict":
            self.l1.on_evict = self._on_evict

    # ------------------------------------------------------------------ the engine's calls
    def prefix_sources(self, keys: Sequence[Key]) -> list[int]:
        """``StorageManager.prefix_sources``: per leading present key, the first tier holding it."""
        present = self.l1.contains(keys)
        where = [0 if p else -1 for p in present]
        for level, tier in enumerate(self.lower, 1):
            todo = [i for i, w in enumerate(where) if w < 0]
            if not todo:
                break
            for i, f in zip(todo, tier.contains([keys[i] for i in todo])):
                if f:
                    where[i] = level
        n = 0
        while n < len(where) and where[n] >= 0:
            n += 1
        return where[:n]

    def fetch_prefix(self, keys: Sequence[Key], sizes: Sequence[int]
                     ) -> tuple[list[MemoryObj], list[int]]:
        """``StorageManager.fetch_prefix``: the objects of the longest present prefix (held for
        the caller) and the tier each came from; lower-tier hits are read into L1 memory
        (which may evict L1) and promoted."""
        l1 = self.l1
        found: list[MemoryObj | None] = list(l1.get(keys))
        where = [0] * len(found)
        if self.lower and None in found:
            for level, tier in enumerate(self.lower, 1):
                todo = [i for i, o in enumerate(found) if o is None]
                if not todo:
                    break
                hit = tier.touch_present([keys[i] for i in todo])
                got_keys: list[Key] = []
                got_objs: list[MemoryObj] = []
                for i, h in zip(todo, hit):
                    if not h:
                        continue
                    obj = l1.allocate((sizes[i] * self.bpt,), _BYTE, sizes[i])
                    if obj is None:  # no L1 memory for the read: a miss, as in the tier
                        continue
                    found[i] = obj
                    where[i] = level
                    got_keys.append(keys[i])
                    got_objs.append(obj)
                if got_keys:
                    l1.put(got_keys, got_objs)
                    if self.write_policy == "write_through":
                        for q in range(level - 1):  # the tiers above it missed these
                            self._offer(q, got_keys, got_objs)
        out: list[MemoryObj] = []
        for o in found:
            if o is None:
                break
            out.append(o)
        for o in found[len(out):]:
            if o is not None:
                o.release()
        return out, where[: len(out)]

    def store(self, keys: Sequence[Key], sizes: Sequence[int]) -> int:
        """``CacheEngine._plan_store`` then ``StorageManager.put``: chunks already in L1 are
        refreshed and skipped, runs of equal-size chunks allocated together (evicting), then
        put and, under write-through, written to every lower tier. Returns chunks stored."""
        l1 = self.l1
        present = l1.touch(keys)
        todo = [i for i, p in enumerate(present) if not p]
        objs: list[MemoryObj] = []
        j = 0
        while j < len(todo):
            size = sizes[todo[j]]
            k = j + 1
            while k < len(todo) and sizes[todo[k]] == size:
                k += 1
            got = l1.allocate_many((size * self.bpt,), _BYTE, k - j, size)
            objs += got
            if len(got) < k - j:  # pool full of referenced chunks
                todo = todo[: len(objs)]
                break
            j = k
        if not objs:
            return 0
        put_keys = [keys[i] for i in todo]
        l1.put(put_keys, objs)
        if self.write_policy == "write_through":
            for q in range(len(self.lower)):
                self._offer(q, put_keys, objs)
        for o in objs:
            o.release()
        return len(objs)

    # ------------------------------------------------------------------ write-behind
    def _offer(self, q: int, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> None:
        """``WriteBehind.offer``: queue what fits the byte bound (holding a reference, so
        the memory stays taken), drop the rest."""
        queue = self._queues[q]
        for k, o in zip(keys, objs):
            if k in queue:
                continue
            if self._queued[q] + o.nbytes > self.queue_cap:
                self.dropped[q] += 1
                continue
            o.acquire()
            queue[k] = o
            self._queued[q] += o.nbytes

    def _on_evict(self, victims: list[tuple[Key, MemoryObj]]) -> None:
        keys = [k for k, _ in victims]
        objs = [o for _, o in victims]
        for q in range(len(self.lower)):
            self._offer(q, keys, objs)

    def drain(self) -> None:
        """Every queue written to its tier (what the tier lacks is put), references released:
        the writer threads caught up."""
        for q, tier in enumerate(self.lower):
            queue = self._queues[q]
            if not queue:
                continue
            keys = list(queue)
            objs = list(queue.values())
            todo = [(k, o.nbytes) for k, o, p in zip(keys, objs, tier.contains(keys)) if not p]
            if todo:
                tier.put([k for k, _ in todo], [n for _, n in todo])
            queue.clear()
            self._queued[q] = 0
            for o in objs:
                o.release()

    def tier_stats(self) -> dict[str, float]:
        out: dict[str, float] = {"L1.chunks": len(self.l1), "L1.evictions": self.l1.evictions}
        for t, dropped in zip(self.lower, self.dropped):
            out[f"{t.name}.chunks"] = len(t)
            out[f"{t.name}.evictions"] = t.evictions
            out[f"{t.name}.queue_dropped"] = dropped
        return out

