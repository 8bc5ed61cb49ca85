"""The daemon's cache control: CLEAR, PIN, UNPIN and PRIORITY, per namespace.

Every op names a namespace its connection's token grants (checked by the session before
anything here runs), so a tenant steers only its own chunks. The rules are the engine's
(:mod:`lmc.storage.control`):

* **PIN** reads the keys' longest stored prefix into memory (promoting from disk or Redis,
  charged to the namespace's quota like any read) and holds one reference on each chunk
  until its TTL: memory's eviction passes over them, and so does the namespace's quota
  (the pins keep the memory anyway). Pins belong to an ``owner`` (a session id, up to 64
  bytes) or else to the key chain itself; a new PIN by one owner replaces its last.
  Bounded per namespace: ``max_pins`` chunks, ``max_pin_share`` of the pool and never more
  than the namespace's quota, ``max_pin_ttl``; past a bound the PIN is refused as a whole
  (``refused``, with the rule's code). Expired pins are released by the watchdog's sweep.
* **PRIORITY** sets the retention priority of the keys memory and disk hold.
* **CLEAR** removes every value of the namespace from every tier (its keys share a tag:
  :meth:`lmc.server.store.NamespacedStore.clear`) and every pin it holds; **DELETE**
  (the store's) drops the pins on the keys it deletes. Removals reach the KV events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lmc.storage.control import PinLimitError, check_priority, check_ttl
from lmc.storage.pins import PinTable

if TYPE_CHECKING:
    from lmc.server.server_config import ServerConfig
    from lmc.server.store import NamespacedStore

log = logging.getLogger(__name__)


class NamespacePins:
    """One :class:`PinTable` per namespace that pins, each bounded (module doc).
    ``clock`` (seconds, monotonic) times the TTLs: a test moves it by hand, so expiry does
    not depend on how fast the machine runs the test."""

    def __init__(self, store: NamespacedStore, config: ServerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.clock = clock
        self.max_pins = config.max_pins
        self.max_ttl = config.max_pin_ttl
        self.max_bytes = int(config.max_pin_share * config.size)
        self.max_tables = config.max_namespaces + len(store.configured)
        self._tables: dict[str, PinTable] = {}
        self._keys: dict[str, frozenset[bytes]] = {}  # pinned keys per namespace (quota)
        self._lock = threading.Lock()
        store.pinned_keys = self.keys_of

    def _table(self, ns: str) -> PinTable:
        with self._lock:
            t = self._tables.get(ns)
            if t is None:
                if len(self._tables) >= self.max_tables:
                    self._drop_empty_locked()
                if len(self._tables) >= self.max_tables:
                    raise PinLimitError(f"{len(self._tables)} namespaces hold pins already, "
                                        f"the daemon's bound")
                quota = self.store.quota(ns)
                limit = self.max_bytes if quota is None else min(self.max_bytes, quota)
                t = self._tables[ns] = PinTable(self.max_pins, self.max_ttl, self.clock,
                                                max_bytes=limit)
            return t

    def _drop_empty_locked(self) -> None:
        for ns in [n for n, t in self._tables.items() if not t.count]:
            del self._tables[ns]
            self._keys.pop(ns, None)

    def keys_of(self, ns: str) -> frozenset[bytes]:
        return self._keys.get(ns, frozenset())

    def _note(self, ns: str, table: PinTable) -> None:
        keys = frozenset(k for k in table.pinned_keys() if isinstance(k, bytes))
        with self._lock:
            self._keys[ns] = keys

    # ------------------------------------------------------------------ ops
    def pin(self, ns: str, ikeys: Sequence[bytes], ttl: float, owner: bytes | None,
            priority: int | None) -> int:
        """Pin the longest stored prefix of ``ikeys`` for ``ttl`` s; chunks pinned."""
        ttl = check_ttl(ttl, self.max_ttl)
        if priority is not None:
            priority = check_priority(priority)
        if not ikeys:
            return 0
        table = self._table(ns)
        got = self.store.get(ns, ikeys, prefix=True)
        objs = [o for o in got if o is not None]
        who = ("owner", owner) if owner is not None else ("keys", ikeys[-1])
        try:
            n = table.pin(who, objs, ttl=ttl, keys=list(ikeys[:len(objs)]), strict=True)
        finally:
            self._note(ns, table)
        if priority is not None:
            self.store.storage.set_priority(ikeys, priority)
        return n

    def unpin(self, ns: str, owner: bytes | None, ikeys: Sequence[bytes]) -> int:
        table = self._tables.get(ns)
        if table is None:
            return 0
        if owner is not None:
            n = table.release(("owner", owner))
        else:
            n = table.release(("keys", ikeys[-1])) if ikeys else 0
        self._note(ns, table)
        return n

    def release_keys(self, ns: str, ikeys: Sequence[bytes]) -> int:
        """A DELETE's: the pins on these keys go with them."""
        table = self._tables.get(ns)
        if table is None:
            return 0
        n = table.release_keys(ikeys)
        self._note(ns, table)
        return n

    def clear(self, ns: str) -> int:
        with self._lock:
            table = self._tables.pop(ns, None)
            self._keys.pop(ns, None)
        return 0 if table is None else table.clear()

    def expire(self) -> int:
        """Release every pin past its TTL (the daemon's watchdog calls this)."""
        n = 0
        for ns, table in list(self._tables.items()):
            got = table.expire()
            if got:
                n += got
                self._note(ns, table)
        return n

    def close(self) -> None:
        with self._lock:
            tables, self._tables = list(self._tables.values()), {}
            self._keys.clear()
        for t in tables:
            t.clear()

    def stats(self, allowed: frozenset[str] | None = None) -> dict[str, dict[str, int]]:
        return {ns: {"pinned_chunks": t.count, "pinned_bytes": t.nbytes,
                     "pins_expired": t.expired}
                for ns, t in list(self._tables.items()) if allowed is None or ns in allowed}


def set_priority(store: NamespacedStore, ikeys: Sequence[bytes], priority: int) -> int:
    """PRIORITY: the held keys' retention priority in memory and disk; how many memory
    holds."""
    return store.storage.set_priority(ikeys, check_priority(priority))
