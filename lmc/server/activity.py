"""What each namespace asked of the daemon: PUTs and GETs, values, hits and bytes.

Why apart from the quota ledgers (:mod:`lmc.server.store`): those exist only for namespaces
with a quota, so a daemon without quotas reported ``"namespaces": {}`` however much its
clients wrote. These counters exist for every namespace that sent a request, bounded like
the ledgers (least recently active forgotten first), and give ``lmc stats`` its hit rates.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

FIELDS = ("puts", "put_values", "stored", "bytes_in", "gets", "get_keys", "hits", "bytes_out",
          "lookups", "lookup_keys", "lookup_hits")


class Activity:
    def __init__(self, limit: int = 4096) -> None:
        self.limit = max(1, limit)
        self._ns: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._total = dict.fromkeys(FIELDS, 0)
        self._lock = threading.Lock()

    def _add(self, ns: str, **kv: int) -> None:
        with self._lock:
            c = self._ns.get(ns)
            if c is None:
                if len(self._ns) >= self.limit:
                    self._ns.popitem(last=False)
                c = self._ns[ns] = dict.fromkeys(FIELDS, 0)
            else:
                self._ns.move_to_end(ns)
            for k, v in kv.items():
                c[k] += v
                self._total[k] += v

    def put(self, ns: str, values: int, stored: int, nbytes: int) -> None:
        self._add(ns, puts=1, put_values=values, stored=stored, bytes_in=nbytes)

    def get(self, ns: str, keys: int, hits: int, nbytes: int) -> None:
        self._add(ns, gets=1, get_keys=keys, hits=hits, bytes_out=nbytes)

    def lookup(self, ns: str, keys: int, hits: int) -> None:
        """An EXISTS (an engine's lookup): keys asked, keys found."""
        self._add(ns, lookups=1, lookup_keys=keys, lookup_hits=hits)

    def namespaces(self, allowed: Iterable[str] | None = None) -> dict[str, dict[str, int]]:
        """Counts per namespace; only ``allowed`` ones when given (a tenant's own)."""
        with self._lock:
            keep = None if allowed is None else set(allowed)
            return {ns: dict(c) for ns, c in self._ns.items() if keep is None or ns in keep}

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._total)
