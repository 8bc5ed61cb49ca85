"""Wrapper tiers: a tier around another, keeping the same contract.

A wrapper delegates every call to the tier it wraps (``inner``) and changes one thing: it
counts, it slows, (next) it encodes. It is a tier like any other -- the storage manager,
write-behind, listeners and the contract suite see no difference -- and takes the wrapped
tier's name, medium and metrics, so stats sections, lookups and events name the real tier.

In config a wrapper goes around any entry of the ``tiers:`` list::

    tiers:
      - memory
      - {wrap: rate_limit, bytes_per_second: 200MiB, tier: {wrap: counting,
                                                        tier: "redis://h:6379"}}

Built by hand, ``create_backend("counting", config, pool, tier="disk")`` wraps a tier it
builds itself from the same config and pool (the contract suite builds one that way).

* ``counting``: calls, keys, hits and bytes per operation in :meth:`stats`
  (``wrapped_<op>_calls``...), and each call logged at DEBUG with ``log_calls``. What a
  benchmark or a test asks of a tier: how many round trips a lookup cost, how many bytes a
  load moved.
* ``rate_limit``: the bytes a ``get`` returns and a ``put`` sends pass at most
  ``bytes_per_second`` (one shared budget, as one link), plus ``latency`` per call: a slow
  tier for benchmarks and for tests of load-or-recompute decisions. It reads whole chunks
  (``get_layers`` answers ``None``) so every byte is paced; with ``layered`` it relays the
  wrapped tier's layered reads instead, each chunk's layer handed on once its bytes passed
  (:mod:`lmc.storage.paced_read`): a slow disk or Redis read layer by layer. A call never waits past
  ``max_delay`` (then it goes on, the rate exceeded: a benchmark's mistake must not hang the
  engine), and ``close()`` wakes every waiting call at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmc.settings import parse_bool, parse_duration, parse_opt_str, parse_positive_size
from lmc.storage.layered_read import Coordinators
from lmc.storage.paced_read import paced
from lmc.storage.tier import (
    BackendOption,
    Key,
    StorageBackend,
    TierCapabilities,
    create_backend,
    register_backend,
    tier_capabilities,
    tier_medium,
)

if TYPE_CHECKING:
    from lmc.config import CacheConfig
    from lmc.memory.pool import MemoryObj
    from lmc.storage.layered_read import LayeredRead

log = logging.getLogger(__name__)
FORWARDED = ("expected_geometry", "on_evicted")
"""Attributes the engine and the manager set on a tier: set on a wrapper, they reach the
wrapped tier (which is the one that checks geometry or evicts)."""


class WrapperTier(StorageBackend):
    """Delegates everything to ``inner``; subclasses override what they change."""

    wraps = True
    OPTIONS = {
        "tier": BackendOption(None, parse_opt_str, "the tier to wrap, by name or URL, when "
                              "built by hand (config nests it under tier:)"),
    }

    def __init__(self, spec: str = "", *, config: CacheConfig, pool: Any,
                 inner: StorageBackend | None = None, tier: str | None = None,
                 **_: Any) -> None:
        if inner is None:
            if not tier:
                raise ValueError(f"the {type(self).__name__} wrapper needs the tier it wraps "
                                 "(tier: in config)")
            inner = create_backend(tier, config, pool)
        object.__setattr__(self, "inner", inner)
        self.name = inner.name  # stats, lookups and events name the real tier
        self.medium = tier_medium(inner)
        self.capabilities = tier_capabilities(inner)
        self.pool = pool

    def __getattr__(self, name: str) -> Any:
        """Anything else the wrapped tier has (its path, metrics, breaker...)."""
        if name == "inner":  # not set yet: no recursion while constructing
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FORWARDED:
            setattr(self.inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return self.inner.contains(keys)

    def prefix_hits(self, keys: Sequence[Key]) -> int:
        return self.inner.prefix_hits(keys)

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        return self.inner.get(keys)

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        return self.inner.put(keys, objs)

    def delete(self, keys: Sequence[Key]) -> int:
        return self.inner.delete(keys)

    def get_layers(self, keys: Sequence[Key]) -> LayeredRead | None:
        return self.inner.get_layers(keys)

    def clear_namespace(self, prefix: bytes = b"") -> list[Key] | None:
        return self.inner.clear_namespace(prefix)

    def set_priority(self, keys: Sequence[Key], priority: int) -> int:
        return self.inner.set_priority(keys, priority)

    # the eviction-order hints too: the base class's no-ops would end them here
    def demote(self, keys: Sequence[Key]) -> None:
        self.inner.demote(keys)

    def refresh(self, keys: Sequence[Key]) -> None:
        self.inner.refresh(keys)

    def rank_arrivals(self, source: Callable[[Key], int | None] | None) -> None:
        self.inner.rank_arrivals(source)

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()


# ------------------------------------------------------------------------------ counting
_OPS = ("contains", "get", "put", "delete", "get_layers")


@register_backend("counting")
class CountingTier(WrapperTier):
    """Counts what passes through (and logs each call at DEBUG with ``log_calls``)."""

    OPTIONS = {
        **WrapperTier.OPTIONS,
        "log_calls": BackendOption(False, parse_bool, "log every call at DEBUG level"),
    }

    def __init__(self, spec: str = "counting", *, config: CacheConfig, pool: Any,
                 inner: StorageBackend | None = None, tier: str | None = None,
                 log_calls: bool = False, **_: Any) -> None:
        super().__init__(spec, config=config, pool=pool, inner=inner, tier=tier)
        self.log_calls = log_calls
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {f"{op}_{what}": 0 for op in _OPS
                                       for what in ("calls", "keys", "hits", "bytes")}

    def _count(self, op: str, keys: int, hits: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            c = self.counts
            c[f"{op}_calls"] += 1
            c[f"{op}_keys"] += keys
            c[f"{op}_hits"] += hits
            c[f"{op}_bytes"] += nbytes
        if self.log_calls:
            log.debug("tier %s: %s of %d keys: %d hits, %d bytes", self.name, op, keys, hits,
                      nbytes)

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        out = self.inner.contains(keys)
        self._count("contains", len(keys), sum(map(bool, out)))
        return out

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        out = self.inner.get(keys)
        hits = [o for o in out if o is not None]
        self._count("get", len(keys), len(hits), sum(o.nbytes for o in hits))
        return out

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        n = self.inner.put(keys, objs)
        self._count("put", len(keys), n, sum(o.nbytes for o in objs[:n]))
        return n

    def delete(self, keys: Sequence[Key]) -> int:
        n = self.inner.delete(keys)
        self._count("delete", len(keys), n)
        return n

    def get_layers(self, keys: Sequence[Key]) -> LayeredRead | None:
        read = self.inner.get_layers(keys)
        if read is not None:
            hits = [o for o in read.objs if o is not None]
            self._count("get_layers", len(keys), len(hits), sum(o.nbytes for o in hits))
        return read

    def stats(self) -> dict[str, Any]:
        with self._lock:
            mine = {f"wrapped_{k}": v for k, v in self.counts.items()}
        return {**self.inner.stats(), **mine}


# ---------------------------------------------------------------------------- rate limit
@register_backend("rate_limit")
class RateLimitTier(WrapperTier):
    """Paces the bytes through the wrapped tier (see the module docstring)."""

    OPTIONS = {
        **WrapperTier.OPTIONS,
        "bytes_per_second": BackendOption(
            100 << 20, parse_positive_size, "bytes per second get and put move at most, "
            "together (as one link)"),
        "latency": BackendOption(0.0, lambda v, k: parse_duration(v, k, minimum=0),
                                 "seconds (or '2ms') added to every call, as a round trip"),
        "max_delay": BackendOption(30.0, lambda v, k: parse_duration(v, k, minimum=0),
                                   "seconds one call may be held at most"),
        "layered": BackendOption(False, parse_bool, "relay the wrapped tier's layer-by-layer "
                                 "reads at the link's pace (else whole chunks through get)"),
    }

    def __init__(self, spec: str = "rate_limit", *, config: CacheConfig, pool: Any,
                 inner: StorageBackend | None = None, tier: str | None = None,
                 bytes_per_second: int | str = 100 << 20, latency: float = 0.0,
                 max_delay: float = 30.0, layered: bool | str = False, **_: Any) -> None:
        super().__init__(spec, config=config, pool=pool, inner=inner, tier=tier)
        self.rate = parse_positive_size(bytes_per_second, "bytes_per_second")
        self.latency = parse_duration(latency, "latency", minimum=0)
        self.max_delay = parse_duration(max_delay, "max_delay", minimum=0)
        self.layered = parse_bool(layered, "layered")
        self.capabilities = TierCapabilities(
            self.layered and self.capabilities.layered_reads,
            self.capabilities.existence_without_reading, self.capabilities.durable)
        self._relays = Coordinators("lmc-rate-limit")
        self._lock = threading.Lock()
        self._free_at = 0.0  # monotonic time the link is next idle
        self._closed = threading.Event()
        self.delayed_seconds = 0.0

    def _pace(self, nbytes: int, t0: float) -> None:
        """Hold the call until its bytes have passed the link (and its latency elapsed),
        counted from ``t0``, its start; never past ``max_delay``, never after close."""
        with self._lock:
            start = max(t0, self._free_at)
            self._free_at = start + nbytes / self.rate
            until = max(self._free_at, t0 + self.latency)
        wait = min(until - time.monotonic(), t0 + self.max_delay - time.monotonic())
        if wait > 0:
            self._closed.wait(wait)
            self.delayed_seconds += wait

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        t0 = time.monotonic()
        out = self.inner.contains(keys)
        self._pace(0, t0)
        return out

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        t0 = time.monotonic()
        out = self.inner.get(keys)
        self._pace(sum(o.nbytes for o in out if o is not None), t0)
        return out

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        t0 = time.monotonic()
        n = self.inner.put(keys, objs)
        self._pace(sum(o.nbytes for o in objs[:n]), t0)
        return n

    def get_layers(self, keys: Sequence[Key]) -> LayeredRead | None:
        if not self.layered:
            return None  # whole chunks through get(), so every byte is paced
        read = self.inner.get_layers(keys)
        if read is None:
            return None
        return paced(read, self._pace, self._closed.is_set, self._relays,
                     self.max_delay + 60.0)

    def close(self) -> None:
        self._closed.set()
        self._relays.close()
        self.inner.close()

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "rate_limit_delayed_seconds": self.delayed_seconds}
