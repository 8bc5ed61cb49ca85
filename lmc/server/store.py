"""The daemon's storage: lmc's own ``StorageManager`` behind namespaces and quotas.

Namespaces: the internal key of (namespace, key) is BLAKE2b-128 of the key, keyed with the
namespace. A keyed PRF rather than a plain prefix because every tier stores 16-byte keys;
rather than xxh3 because one tenant must not be able to craft a key that lands on another
tenant's (xxh3 is not collision resistant, BLAKE2 is).

Quotas bound the memory tier's bytes per namespace. Accounting is lazy: the tier evicts
without telling us, so when a namespace looks over its quota the ledger is first pruned of
keys the tier no longer has, and only then are the namespace's own oldest chunks deleted.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from lmc.memory import MemoryObj
from lmc.serde import payload_checksum
from lmc.server.views import byte_view
from lmc.storage_manager import StorageManager

log = logging.getLogger(__name__)
_PERSON = b"lmc-server-ns"


class Checksum(int):
    """Marks ``MemoryObj.meta`` as the payload checksum the daemon verified on PUT, so a GET
    need not hash the value again. Objects from lower tiers carry no mark and are hashed."""


def checksum_of(obj: MemoryObj) -> int:
    meta = obj.meta
    if isinstance(meta, Checksum):
        return int(meta)
    return payload_checksum(byte_view(obj))


class _Ledger:
    """One namespace's chunks in memory, oldest first, and their bytes."""

    __slots__ = ("keys", "bytes", "pending")

    def __init__(self) -> None:
        self.keys: OrderedDict[bytes, int] = OrderedDict()
        self.bytes = 0
        self.pending = 0  # admitted, still arriving: counted so concurrent PUTs cannot overshoot

    def add(self, key: bytes, nbytes: int) -> None:
        old = self.keys.pop(key, None)
        if old is not None:
            self.bytes -= old
        self.keys[key] = nbytes
        self.bytes += nbytes

    def drop(self, key: bytes) -> None:
        n = self.keys.pop(key, None)
        if n is not None:
            self.bytes -= n


class NamespacedStore:
    """Thread-safe; all batch calls take internal keys from :meth:`internal_keys`."""

    def __init__(self, storage: StorageManager, quotas: dict[str, int] | None = None,
                 quota_default: int | None = None, max_namespaces: int = 4096) -> None:
        self.storage = storage
        self.l1 = storage.l1
        self.quotas = dict(quotas or {})
        self.quota_default = quota_default
        self.max_namespaces = max_namespaces
        self._ledgers: dict[str, _Ledger] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ keys
    @staticmethod
    def internal_keys(ns: str, keys: Sequence[bytes]) -> list[bytes]:
        nsb = ns.encode()
        return [hashlib.blake2b(k, digest_size=16, key=nsb, person=_PERSON).digest()
                for k in keys]

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
        with self._lock:
            ledger = self._ledgers.get(ns)
            if ledger is None:
                if len(self._ledgers) >= self.max_namespaces:
                    self._prune_empty()
                if len(self._ledgers) >= self.max_namespaces:
                    return [False] * len(sizes), 0
                ledger = self._ledgers[ns] = _Ledger()
            need = min(sum(sizes), quota)
            if ledger.bytes + ledger.pending + need > quota:
                self._prune(ledger)
            victims: list[bytes] = []
            while ledger.bytes + ledger.pending + need > quota and ledger.keys:
                k = next(iter(ledger.keys))
                ledger.drop(k)
                victims.append(k)
            out, room = [], quota - ledger.bytes - ledger.pending
            for s in sizes:
                ok = s <= room
                room -= s if ok else 0
                out.append(ok)
            reserved = sum(s for s, ok in zip(sizes, out) if ok)
            ledger.pending += reserved
        if victims:  # quotas bound memory: copies in the disk/Redis tiers stay (own limits)
            self.l1.delete(victims)
        return out, reserved

    def settle(self, ns: str, reserved: int) -> None:
        if reserved:
            with self._lock:
                ledger = self._ledgers.get(ns)
                if ledger is not None:
                    ledger.pending = max(0, ledger.pending - reserved)

    def commit(self, ns: str, ikeys: Sequence[bytes], objs: Sequence[MemoryObj]) -> int:
        """Make verified values visible (the caller keeps and releases its references)."""
        if not ikeys:
            return 0
        n = self.storage.put(ikeys, objs)
        if self.quota(ns) is not None:
            with self._lock:
                ledger = self._ledgers.setdefault(ns, _Ledger())
                for k, o in zip(ikeys, objs):
                    ledger.add(k, o.nbytes)
        return n

    def delete(self, ns: str, ikeys: Sequence[bytes]) -> int:
        n = self.storage.delete(ikeys)
        with self._lock:
            ledger = self._ledgers.get(ns)
            if ledger is not None:
                for k in ikeys:
                    ledger.drop(k)
        return n

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

    def get(self, ikeys: Sequence[bytes], prefix: bool) -> list[MemoryObj | None]:
        """Objects (one reference each, for the caller) or None; ``prefix`` stops at the first
        miss. Lower-tier hits go through the manager's ``get_prefix``, so they are promoted."""
        n = len(ikeys)
        if prefix:
            objs: list[MemoryObj | None] = list(self.storage.get_prefix(ikeys))
            return objs + [None] * (n - len(objs))
        found: list[MemoryObj | None] = list(self.l1.get(ikeys))
        if len(self.storage.tiers) == 1 or all(o is not None for o in found):
            return found
        missing = [i for i, o in enumerate(found) if o is None]
        present = self.contains([ikeys[i] for i in missing])
        todo = [i for i, p in zip(missing, present) if p]
        while todo:  # all present: one call fetches them, unless one vanished meanwhile
            got = self.storage.get_prefix([ikeys[i] for i in todo])
            for i, o in zip(todo, got):
                found[i] = o
            todo = todo[len(got) + 1:]
        return found

    def touch(self, ns: str, ikeys: Sequence[bytes]) -> None:
        """Reads keep a namespace's chunks young in its quota ledger too."""
        with self._lock:
            ledger = self._ledgers.get(ns)
            if ledger is not None:
                for k in ikeys:
                    if k in ledger.keys:
                        ledger.keys.move_to_end(k)

    # ----------------------------------------------------------------- misc
    def _prune(self, ledger: _Ledger) -> None:
        keys = list(ledger.keys)
        for k, present in zip(keys, self.l1.contains(keys)):
            if not present:
                ledger.drop(k)

    def _prune_empty(self) -> None:
        for ns in list(self._ledgers):
            ledger = self._ledgers[ns]
            self._prune(ledger)
            if not ledger.keys and not ledger.pending:
                del self._ledgers[ns]

    def namespace_stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {ns: {"chunks": len(ld.keys), "bytes": ld.bytes,
                         "quota": self.quota(ns) or 0} for ns, ld in self._ledgers.items()}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for tier in self.storage.tiers:
            try:
                for k, v in tier.stats().items():
                    out[f"{tier.name}.{k}"] = v
            except Exception as e:
                log.warning("tier %s failed stats(): %s", tier.name, e)
        return out
