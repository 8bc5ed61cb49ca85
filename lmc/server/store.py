"""The daemon's storage: lmc's own ``StorageManager`` behind namespaces and quotas.

Namespaces: the internal key of (namespace, key) is the namespace's 6-byte tag (BLAKE2b of
its name) followed by 10 bytes of BLAKE2b of the key, keyed with the namespace. Keyed BLAKE2
rather than xxh3 because one tenant must not be able to craft a key that lands on another
tenant's (xxh3 is not collision resistant, BLAKE2 is); the tag in front because it makes a
namespace's keys a prefix every tier can find, so ``CLEAR`` removes a namespace from memory,
disk and Redis without an index of its keys (:meth:`NamespacedStore.clear`). Two names share
a tag by chance with probability 2^-48 (a clear of one would then also clear the other: a
cache miss, never a wrong value, since the 10-byte part stays keyed by the name); a
namespace's own keys collide after ~2^40 of them.

Quotas bound the memory tier's bytes per namespace. Accounting is lazy: the tier evicts
without telling us, so when a namespace looks over its quota the ledger is first pruned of
keys the tier no longer has, and only then are the namespace's own oldest chunks deleted.
Every way a chunk enters memory is charged: a PUT (admitted before its payload is read) and a
read that promotes a chunk from the disk or Redis tier (charged after the read, evicting the
namespace's own oldest chunks if that takes it over its quota). So is memory a reply still
holds while it is being sent (issue 20: a slow reader's chunks, evicted from its ledger, stayed
allocated and the pool took the room from other tenants): a held chunk that leaves the ledger
stays charged as an orphan until the reply is sent, held chunks are never evicted for the
quota (that frees nothing), and a read promotes from lower tiers only what the quota has left
once held memory and the read's own memory hits are counted (the rest are misses).

Ledgers are bounded too. Namespaces named in the config (``quotas``, or granted by a tenant
token) always have room; other namespaces (clients with an admin token, or no token) share
``max_namespaces`` ledgers: when a new one needs a ledger, empty ones are reclaimed first,
then the least recently used one's chunks leave memory (a cache may drop anything; what it
may not do is lock new tenants out of an empty pool).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmc.memory.pool import MemoryObj
from lmc.server import metrics as M
from lmc.server.interval_log import IntervalLog
from lmc.server.p2p.directory import PeerDirectory
from lmc.storage.manager import StorageManager
from lmc.storage.serde import byte_view, payload_checksum

log = logging.getLogger(__name__)
_PERSON = b"lmc-server-ns"
_TAG_PERSON = b"lmc-server-tag"
TAG_BYTES = 6  # of the namespace's tag; the key's own part is the other 10


class Checksum(int):
    """Marks ``MemoryObj.meta`` as the payload checksum the daemon verified on PUT, so a GET
    need not hash the value again. Objects from lower tiers carry no mark and are hashed."""


def checksum_of(obj: MemoryObj) -> int:
    meta = obj.meta
    if isinstance(meta, Checksum):
        return int(meta)
    return payload_checksum(byte_view(obj))


class _Full(Exception):
    """Every ledger that could be reclaimed has writes in flight."""


class _Held:
    """One pool object referenced by this namespace's replies being sent."""

    __slots__ = ("key", "nbytes", "count", "orphan")

    def __init__(self, key: bytes, nbytes: int, orphan: bool) -> None:
        self.key, self.nbytes, self.count, self.orphan = key, nbytes, 1, orphan


class _Ledger:
    """One namespace's chunks in memory, oldest first, and their bytes; and the objects its
    replies being sent hold (``held``). A held object whose key left the ledger (evicted for
    the quota, deleted) is an orphan: still allocated, in no ledger, so its bytes are
    charged here (``orphan``) until the reply is sent. Keys a reply holds are never evicted
    for the quota (``pinned`` of their bytes): that would free nothing."""

    __slots__ = ("keys", "bytes", "pending", "held", "held_keys", "orphan", "pinned")

    def __init__(self) -> None:
        self.keys: OrderedDict[bytes, int] = OrderedDict()
        self.bytes = 0
        self.pending = 0  # admitted, still arriving: counted so concurrent PUTs cannot overshoot
        self.held: dict[int, _Held] = {}  # id(obj) -> what a reply holds
        self.held_keys: dict[bytes, set[int]] = {}  # ledger key -> held objects of it
        self.orphan = 0
        self.pinned = 0

    @property
    def charge(self) -> int:
        """Memory this namespace holds or is about to: what its quota bounds."""
        return self.bytes + self.pending + self.orphan

    @property
    def busy(self) -> bool:
        """Writes arriving or replies being sent: the ledger cannot be forgotten now."""
        return bool(self.pending or self.held)

    def add(self, key: bytes, nbytes: int) -> None:
        old = self.keys.pop(key, None)
        if old is not None:
            self.bytes -= old
            if key in self.held_keys:
                self.pinned += nbytes - old
        self.keys[key] = nbytes
        self.bytes += nbytes

    def drop(self, key: bytes) -> None:
        n = self.keys.pop(key, None)
        if n is None:
            return
        self.bytes -= n
        ids = self.held_keys.pop(key, None)
        if ids:  # still being sent: its memory stays, charged as an orphan
            self.pinned -= n
            for i in ids:
                h = self.held[i]
                h.orphan = True
                self.orphan += h.nbytes

    def evictable(self, need: int, quota: int, skip: set[bytes] | frozenset = frozenset()
                  ) -> list[bytes]:
        """Oldest keys whose eviction brings the charge plus ``need`` within ``quota``,
        never one a reply holds (or in ``skip``)."""
        over = self.charge + need - quota
        out: list[bytes] = []
        for k, n in self.keys.items():
            if over <= 0:
                break
            if k in self.held_keys or k in skip:
                continue
            out.append(k)
            over -= n
        return out

    def hold(self, keys: Sequence[bytes], objs: Sequence[MemoryObj | None]) -> None:
        """A reply will send ``objs`` (``None``: a miss): one loop for the batch (a GET's
        64 keys: ~35 us with the unhold on a 2-core VM, a third less than per-key calls)."""
        held, ledger_keys, held_keys = self.held, self.keys, self.held_keys
        for key, obj in zip(keys, objs):
            if obj is None:
                continue
            oid = id(obj)
            h = held.get(oid)
            if h is not None:
                h.count += 1
                continue
            owned = key in ledger_keys
            held[oid] = _Held(key, obj.nbytes, not owned)
            if not owned:
                self.orphan += obj.nbytes
                continue
            ids = held_keys.get(key)
            if ids is None:
                held_keys[key] = {oid}
                self.pinned += ledger_keys[key]
            else:
                ids.add(oid)

    def unhold(self, objs: Sequence[MemoryObj | None]) -> None:
        """The reply that held ``objs`` is sent (or dropped)."""
        held, held_keys = self.held, self.held_keys
        for obj in objs:
            if obj is None:
                continue
            oid = id(obj)
            h = held.get(oid)
            if h is None:
                continue
            h.count -= 1
            if h.count:
                continue
            del held[oid]
            if h.orphan:
                self.orphan -= h.nbytes
                continue
            ids = held_keys.get(h.key)
            if ids is not None:
                ids.discard(oid)
                if not ids:
                    del held_keys[h.key]
                    self.pinned -= self.keys.get(h.key, 0)


class NamespacedStore:
    """Thread-safe; all batch calls take internal keys from :meth:`internal_keys`."""

    def __init__(self, storage: StorageManager, quotas: dict[str, int] | None = None,
                 quota_default: int | None = None, max_namespaces: int = 4096,
                 reserved: frozenset[str] = frozenset()) -> None:
        self.storage = storage
        self.l1 = storage.l1
        self.quotas = dict(quotas or {})
        self.quota_default = quota_default
        self.max_namespaces = max_namespaces
        self.configured = frozenset(self.quotas) | reserved  # never count against the cap
        self._ledgers: OrderedDict[str, _Ledger] = OrderedDict()  # least recently used first
        self._dynamic = 0  # ledgers of namespaces not in ``configured``
        self.reclaimed = 0
        self._reclaim_log = IntervalLog(
            logging.INFO, f"max_namespaces ({max_namespaces}) reached: the least recently used "
            "namespace's ledger was reclaimed and its chunks left memory")
        self._lock = threading.Lock()
        self.p2p = PeerDirectory()  # who holds which chunk in its own pool (lmc/server/p2p)
        self.pinned_keys: Callable[[str], frozenset[bytes]] = lambda ns: frozenset()
        """A namespace's pinned keys (set by the daemon's :mod:`lmc.server.control`): never
        evicted for its quota, since their pins keep the memory anyway."""

    # ------------------------------------------------------------------ keys
    @staticmethod
    def namespace_tag(ns: str) -> bytes:
        """The first bytes of every internal key of ``ns`` (module doc)."""
        return hashlib.blake2b(ns.encode(), digest_size=TAG_BYTES, person=_TAG_PERSON).digest()

    @classmethod
    def internal_keys(cls, ns: str, keys: Sequence[bytes]) -> list[bytes]:
        nsb, tag = ns.encode(), cls.namespace_tag(ns)
        return [tag + hashlib.blake2b(k, digest_size=16 - TAG_BYTES, key=nsb,
                                      person=_PERSON).digest() for k in keys]

    def quota(self, ns: str) -> int | None:
        return self.quotas.get(ns, self.quota_default)

    # ---------------------------------------------------------------- writes
    def allocate_many(self, shape: Sequence[int], dtype: torch.dtype, count: int,
                      num_tokens: int) -> list[MemoryObj]:
        """Pool memory for incoming values: up to ``count`` objects of one shape in one call
        (the memory tier evicts unreferenced chunks to make room, once for all)."""
        return self.storage.allocate_many(shape, dtype, count, num_tokens)

    def admit(self, ns: str, sizes: Sequence[int]) -> tuple[list[bool], int]:
        """Which of these incoming values fit the namespace's quota (making room by deleting
        the namespace's oldest chunks when needed), and the bytes reserved for them: pass
        those to :meth:`settle` once the values are committed or dropped."""
        quota = self.quota(ns)
        if quota is None:
            return [True] * len(sizes), 0
        victims: list[bytes] = []
        with self._lock:
            try:
                ledger = self._ledger(ns, victims)
            except _Full:  # every tracked namespace has a write in flight right now
                return [False] * len(sizes), 0
            need = min(sum(sizes), quota)
            if ledger.charge + need > quota:
                self._prune(ledger)
            for k in ledger.evictable(need, quota, self.pinned_keys(ns)):
                ledger.drop(k)
                victims.append(k)
            out, room = [], quota - ledger.charge
            for s in sizes:
                ok = s <= room
                room -= s if ok else 0
                out.append(ok)
            reserved = sum(s for s, ok in zip(sizes, out) if ok)
            ledger.pending += reserved
        if victims:  # quotas bound memory: copies in the disk/Redis tiers stay (own limits)
            self._drop(victims)
        return out, reserved

    def settle(self, ns: str, reserved: int) -> None:
        if reserved:
            with self._lock:
                ledger = self._ledgers.get(ns)
                if ledger is not None:
                    ledger.pending = max(0, ledger.pending - reserved)

    def _ledger(self, ns: str, victims: list[bytes]) -> _Ledger:
        """``ns``'s ledger, made (and marked recently used) now; under the lock. Chunks that
        must leave memory to keep the ledgers bounded are appended to ``victims``."""
        ledger = self._ledgers.get(ns)
        if ledger is not None:
            self._ledgers.move_to_end(ns)
            return ledger
        if ns not in self.configured:
            if self._dynamic >= self.max_namespaces:
                self._prune_empty()
            while self._dynamic >= self.max_namespaces:
                victims += self._reclaim_oldest()
            self._dynamic += 1
        ledger = self._ledgers[ns] = _Ledger()
        return ledger

    def _reclaim_oldest(self) -> list[bytes]:
        """Forget the least recently used unconfigured namespace without pending writes; its
        chunks are returned for deletion from memory (a namespace nobody tracks must not
        keep memory its quota no longer bounds)."""
        for name, ledger in self._ledgers.items():
            if name not in self.configured and not ledger.busy:
                del self._ledgers[name]
                self._dynamic -= 1
                self.reclaimed += 1
                M.NAMESPACES_RECLAIMED.inc()
                self._reclaim_log()
                log.debug("namespace ledger %r reclaimed (%d chunks leave memory)", name,
                          len(ledger.keys))
                return list(ledger.keys)
        raise _Full

    def commit(self, ns: str, ikeys: Sequence[bytes], objs: Sequence[MemoryObj]) -> int:
        """Make verified values visible (the caller keeps and releases its references). A key
        given twice is stored once (the first value; keys are content addresses): the tier
        takes one reference per key, so a second object under the same key would leak."""
        if not ikeys:
            return 0
        first: dict[bytes, MemoryObj] = {}
        for k, o in zip(ikeys, objs):
            first.setdefault(k, o)
        keep = list(first.items())
        if len(keep) < len(ikeys):
            ikeys, objs = [k for k, _ in keep], [o for _, o in keep]
        n = self.storage.put(ikeys, objs)
        if self.quota(ns) is not None:  # admitted (reserved in ``pending``): room was made
            self._charge(ns, ikeys, [o.nbytes for o in objs], enforce=False)
        return n

    def _charge(self, ns: str, ikeys: Sequence[bytes], sizes: Sequence[int],
                enforce: bool = True, keep: Sequence[bytes] = ()) -> None:
        """Record chunks now in memory for ``ns``; with ``enforce`` (chunks that arrived
        without an admission: promotions by a read), its oldest others leave while it is
        over quota, except those in ``keep`` (the rest of that read: its reply will hold
        them, so evicting them would free nothing). The read was budgeted to fit."""
        quota = self.quota(ns)
        assert quota is not None
        victims: list[bytes] = []
        with self._lock:
            try:
                ledger = self._ledger(ns, victims)
            except _Full:  # every ledger has writes in flight: do not keep what we cannot bound
                victims += ikeys
            else:
                for k, n in zip(ikeys, sizes):
                    ledger.add(k, n)
                if enforce and ledger.charge > quota:
                    self._prune(ledger)
                    old = ledger.evictable(0, quota,
                                           skip={*ikeys, *keep, *self.pinned_keys(ns)})
                    for k in old:
                        ledger.drop(k)
                    victims += old
        if victims:
            self._drop(victims)

    def delete(self, ns: str, ikeys: Sequence[bytes]) -> int:
        """How many of the (distinct) keys were present anywhere; every copy goes (the
        manager's own count adds up copies, so a key in memory and on disk would count
        twice)."""
        uniq = list(dict.fromkeys(ikeys))
        n = sum(self.contains(uniq))
        self.storage.delete(uniq)
        with self._lock:
            ledger = self._ledgers.get(ns)
            if ledger is not None:
                for k in ikeys:
                    ledger.drop(k)
        return n

    def clear(self, ns: str) -> int:
        """Remove every value of ``ns`` from every tier and write-behind queue (its keys are
        the ones starting with its tag), forget its ledger's chunks; the tiers' listeners
        hear of the removals (KV events). Returns the values removed that the tiers could
        count (the copies in each tier, added up)."""
        out = self.storage.clear_namespace(self.namespace_tag(ns))
        with self._lock:
            ledger = self._ledgers.get(ns)
            if ledger is not None:
                for k in list(ledger.keys):
                    ledger.drop(k)
        return sum(n for n in out.values() if n)

    # ----------------------------------------------------------------- reads
    def contains(self, ikeys: Sequence[bytes]) -> list[bool]:
        """Presence in any tier (or a write-behind queue), each asked once, batched."""
        present = list(self.l1.contains(ikeys))
        for q in getattr(self.storage, "queues", ()):
            if getattr(q, "queued_chunks", 0) and not all(present):
                present = [p or w for p, w in zip(present, q.contains(ikeys))]
        for tier in self.storage.tiers[1:]:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            try:
                found = tier.contains([ikeys[i] for i in todo])
            except Exception as e:
                log.warning("tier %s failed contains(): %s", tier.name, e)
                continue
            for i, f in zip(todo, found):
                present[i] = present[i] or bool(f)
        return present

    def prefix_hits(self, ikeys: Sequence[bytes]) -> int:
        return self.storage.prefix_hits(ikeys)

    def get(self, ns: str, ikeys: Sequence[bytes], prefix: bool) -> list[MemoryObj | None]:
        """Objects (one reference each, for the caller) or None; ``prefix`` stops at the first
        miss. Lower-tier hits go through the manager's ``get_prefix``, so they are promoted,
        and charged to ``ns``'s quota."""
        uniq = list(dict.fromkeys(ikeys))
        if len(uniq) < len(ikeys):
            return self._spread(ikeys, uniq, self.get(ns, uniq, prefix), prefix)
        if len(self.storage.tiers) == 1:
            return self._get(ikeys, prefix)
        quota = self.quota(ns)
        # what lower-tier reads may allocate for ns: its quota less what replies being sent
        # and writes arriving hold (evicting ns's other chunks cannot free that)
        budget = None if quota is None else quota - self.unfreeable(ns)
        hint = self._chunk_size(ns)
        before = self.l1.contains(ikeys)
        found = self._get(ikeys, prefix, budget, hint)
        if self.quota(ns) is not None:
            up = [(k, o.nbytes) for k, o, b in zip(ikeys, found, before)
                  if o is not None and not b]
            if up:
                self._charge(ns, [k for k, _ in up], [n for _, n in up], keep=ikeys)
        return found

    @staticmethod
    def _spread(ikeys: Sequence[bytes], uniq: list[bytes], got: list[MemoryObj | None],
                prefix: bool) -> list[MemoryObj | None]:
        """Answers for ``ikeys`` from the answers for its distinct keys ``uniq``, one reference
        per position. Why: a key asked twice must be read once, or a lower tier returns two
        objects for one key and promoting both leaks one."""
        by = {k: o for k, o in zip(uniq, got) if o is not None}
        used: set[bytes] = set()
        out: list[MemoryObj | None] = []
        for k in ikeys:
            o = by.get(k)
            if o is None and prefix:
                break
            if o is not None:
                if k in used:
                    o.acquire()
                used.add(k)
            out.append(o)
        for k, o in by.items():
            if k not in used:
                o.release()
        return out + [None] * (len(ikeys) - len(out))

    def _get(self, ikeys: Sequence[bytes], prefix: bool, budget: int | None = None,
             size_hint: int = 0) -> list[MemoryObj | None]:
        """Memory first, then the lower tiers (promoting). With a ``budget`` (bytes), lower-tier
        reads stop before they would allocate past it, the memory hits of this very request
        counted in (its reply will hold them): the rest are misses."""
        n = len(ikeys)
        if prefix and budget is None:
            objs: list[MemoryObj | None] = list(self.storage.get_prefix(ikeys))
            return objs + [None] * (n - len(objs))
        found: list[MemoryObj | None] = list(self.l1.get(ikeys))
        if len(self.storage.tiers) == 1 or all(o is not None for o in found):
            return found
        hint = max((o.nbytes for o in found if o is not None), default=0)
        if budget is not None:
            budget -= sum(o.nbytes for o in found if o is not None)
        if prefix:
            cut = found.index(None)
            for o in found[cut:]:  # asked again below, in order, with the lower tiers
                if o is not None:
                    o.release()
            rest = self._read_lower(list(ikeys[cut:]), budget, True, hint or size_hint)
            found[cut:] = rest
            if None in found:  # a prefix ends at its first miss
                end = found.index(None)
                for o in found[end:]:
                    if o is not None:
                        o.release()
                found[end:] = [None] * (n - end)
            return found
        missing = [i for i, o in enumerate(found) if o is None]
        present = self.contains([ikeys[i] for i in missing])
        todo = [i for i, p in zip(missing, present) if p]
        for i, o in zip(todo, self._read_lower([ikeys[i] for i in todo], budget, False,
                                               hint or size_hint)):
            found[i] = o
        return found

    def _read_lower(self, keys: list[bytes], budget: int | None, stop_at_miss: bool = False,
                    size_hint: int = 0) -> list[MemoryObj | None]:
        """``keys`` through the manager's ``get_prefix`` (queues, then tiers, promoting), in
        one call without a budget; with one, as many keys as the budget holds at the size of
        the namespace's chunks (``size_hint``, else of the first one read), so no read
        allocates past it (chunks of one model are of one size)."""
        out: list[MemoryObj | None] = [None] * len(keys)
        i, step = 0, len(keys)
        if budget is not None:
            step = 0 if budget <= 0 else budget // size_hint if size_hint else 1
        while i < len(keys) and step > 0:
            part = keys[i:i + step]
            got = self.storage.get_prefix(part)
            out[i:i + len(got)] = got
            i += len(got)
            if budget is not None:
                budget -= sum(o.nbytes for o in got)
                step = budget // got[-1].nbytes if got else 1
            if len(got) < len(part):  # missing (or vanished meanwhile)
                if stop_at_miss:
                    break
                i += 1
        return out

    def touch(self, ns: str, ikeys: Sequence[bytes]) -> None:
        """Reads keep a namespace's chunks young in its quota ledger too."""
        with self._lock:
            ledger = self._ledgers.get(ns)
            if ledger is not None:
                self._ledgers.move_to_end(ns)
                for k in ikeys:
                    if k in ledger.keys:
                        ledger.keys.move_to_end(k)

    def hold(self, ns: str, ikeys: Sequence[bytes], objs: Sequence[MemoryObj | None]) -> bool:
        """A reply of ``ns`` is about to send ``objs`` (its references are the caller's until
        :meth:`unhold`): while it does, whatever of them leaves the namespace's ledger stays
        charged to the namespace, and none of them is evicted for its quota. Returns whether
        anything was recorded (namespaces without a quota are not tracked)."""
        if self.quota(ns) is None or not any(o is not None for o in objs):
            return False
        victims: list[bytes] = []
        with self._lock:
            try:
                ledger = self._ledger(ns, victims)
            except _Full:  # every ledger is busy: charge nothing rather than fail the read
                return False
            ledger.hold(ikeys, objs)
        if victims:
            self._drop(victims)
        return True

    def unhold(self, ns: str, objs: Sequence[MemoryObj | None]) -> None:
        """The reply that :meth:`hold` recorded has been sent (or dropped)."""
        with self._lock:
            ledger = self._ledgers.get(ns)
            if ledger is not None:
                ledger.unhold(objs)

    def _chunk_size(self, ns: str) -> int:
        """The size of ``ns``'s newest chunk in memory (0 if none): what its next read is
        likely to allocate per key."""
        with self._lock:
            ledger = self._ledgers.get(ns)
            if ledger is None or not ledger.keys:
                return 0
            return next(reversed(ledger.keys.values()))

    def unfreeable(self, ns: str) -> int:
        """Bytes of ``ns``'s charge that evicting its chunks cannot free now (replies being
        sent, writes arriving); 0 for a namespace without a quota."""
        with self._lock:
            ledger = self._ledgers.get(ns)
            return 0 if ledger is None else ledger.orphan + ledger.pinned + ledger.pending

    # ----------------------------------------------------------------- misc
    def _drop(self, victims: Sequence[bytes]) -> None:
        """Chunks leaving memory for a quota or a reclaimed ledger: deleted from the memory
        tier, and told to the storage's listeners (the KV events' ``BlockRemoved``): the
        tier reports its own evictions, not deletes made behind the manager's back."""
        self.l1.delete(victims)
        info = self.storage.infos[0]
        for x in self.storage.listeners:
            try:
                x.on_removed(victims, info, "quota")
            except Exception as e:  # a listener's failure is its own
                log.warning("listener %r failed on_removed: %s", x, e)

    def _prune(self, ledger: _Ledger) -> None:
        keys = list(ledger.keys)
        for k, present in zip(keys, self.l1.contains(keys)):
            if not present:
                ledger.drop(k)

    def _prune_empty(self) -> None:
        """Reclaim ledgers of namespaces that hold nothing in memory any more."""
        for ns in list(self._ledgers):
            ledger = self._ledgers[ns]
            self._prune(ledger)
            if not ledger.keys and not ledger.busy:
                del self._ledgers[ns]
                if ns not in self.configured:
                    self._dynamic -= 1

    def namespace_stats(self, allowed: frozenset[str] | None = None
                        ) -> dict[str, dict[str, int]]:
        """Per namespace: chunks, bytes and quota in memory; only ``allowed`` ones if given
        (a tenant sees its own namespaces, not who else uses the daemon)."""
        with self._lock:
            return {ns: {"chunks": len(ld.keys), "bytes": ld.bytes,
                         "quota": self.quota(ns) or 0, "unsent_bytes": ld.orphan}
                    for ns, ld in self._ledgers.items() if allowed is None or ns in allowed}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for tier in self.storage.tiers:
            try:
                for k, v in tier.stats().items():
                    out[f"{tier.name}.{k}"] = v
            except Exception as e:
                log.warning("tier %s failed stats(): %s", tier.name, e)
        with self._lock:
            out["namespaces.tracked"] = len(self._ledgers)
            out["namespaces.reclaimed"] = self.reclaimed
        out.update({f"p2p.{k}": v for k, v in self.p2p.stats().items()})
        return out
