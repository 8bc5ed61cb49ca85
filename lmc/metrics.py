"""Prometheus metrics, plus the same figures as plain numbers for ``CacheEngine.stats()``.

Metrics are process-wide (several engines in one process add up, as a scrape expects) and are
updated once per call, never once per chunk, so they cost nothing measurable on the hot path.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from prometheus_client import Counter, Gauge, Histogram

_LAT_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)

LOOKUPS = Counter("lmc_lookups", "Lookup calls")
LOOKUP_TOKENS = Counter("lmc_lookup_tokens", "Prompt tokens looked up")
HIT_TOKENS = Counter("lmc_hit_tokens", "Prompt tokens found by lookups")
OP_BYTES = Counter("lmc_bytes", "KV bytes moved between the engine and lmc", ["op"])
OP_TOKENS = Counter("lmc_tokens", "KV tokens moved between the engine and lmc", ["op"])
OP_SECONDS = Histogram("lmc_op_seconds", "Latency of store / retrieve / lookup calls", ["op"],
                       buckets=_LAT_BUCKETS)
SKIPPED = Counter("lmc_skipped_chunks", "Chunks not stored", ["reason"])
EVICTIONS = Counter("lmc_evictions", "Chunks evicted", ["tier"])
POOL_USED = Gauge("lmc_pool_used_bytes", "Bytes in use in the memory pool")
POOL_CAPACITY = Gauge("lmc_pool_capacity_bytes", "Size of the memory pool")


_CHILDREN: dict[str, tuple] = {}


def _children(op: str) -> tuple:
    """Labelled children cached: ``labels()`` costs a lock and a dict lookup per call."""
    c = _CHILDREN.get(op)
    if c is None:
        c = _CHILDREN[op] = (OP_BYTES.labels(op), OP_TOKENS.labels(op), OP_SECONDS.labels(op))
    return c


class EngineMetrics:
    """Per-engine plain counters that also feed the process-wide Prometheus metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, float] = defaultdict(float)

    def _add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self.counts[k] += v

    def lookup(self, query_tokens: int, hit_tokens: int, seconds: float) -> None:
        LOOKUPS.inc()
        LOOKUP_TOKENS.inc(query_tokens)
        HIT_TOKENS.inc(hit_tokens)
        _children("lookup")[2].observe(seconds)
        self._add(lookups=1, lookup_tokens=query_tokens, hit_tokens=hit_tokens)

    def transfer(self, op: str, tokens: int, nbytes: int, seconds: float) -> None:
        b, t, s = _children(op)
        b.inc(nbytes)
        t.inc(tokens)
        s.observe(seconds)
        self._add(**{f"{op}_calls": 1, f"{op}_tokens": tokens, f"{op}_bytes": nbytes,
                     f"{op}_seconds": seconds})

    def skipped(self, reason: str, chunks: int) -> None:
        if chunks:
            SKIPPED.labels(reason).inc(chunks)
            self._add(**{f"skipped_{reason}": chunks})

    def evicted(self, tier: str, chunks: int) -> None:
        if chunks:
            EVICTIONS.labels(tier).inc(chunks)
            self._add(**{f"evictions_{tier}": chunks})

    def pool(self, used: int, capacity: int) -> None:
        POOL_USED.set(used)
        POOL_CAPACITY.set(capacity)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counts)
