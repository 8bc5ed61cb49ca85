"""Prometheus metrics of the Redis tier (process-wide; ``RedisBackend.stats()`` has the same
figures per instance). Kept here rather than in ``lmc.metrics`` so the tier owns its names."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from .redis_circuit import STATE_CODES

BREAKER_STATE = Gauge(
    "lmc_redis_breaker_state", "Circuit breaker of each Redis node: 0 closed, 1 half-open, 2 open",
    ["node"])
BREAKER_TRIPS = Counter("lmc_redis_breaker_trips", "Times a node's breaker opened", ["node"])
REJECTED_KEYS = Counter(
    "lmc_redis_rejected_keys", "Keys answered without a call because the breaker was open", ["op"])
ERRORS = Counter("lmc_redis_errors", "Failed remote calls by kind (timeout, connection, reply)",
                 ["op", "kind"])
CORRUPT = Counter("lmc_redis_corrupt_values",
                  "Values that failed the header or checksum check: served as misses, deleted")
KEYS = Counter("lmc_redis_keys", "Keys by operation and outcome", ["op", "outcome"])
BYTES = Counter("lmc_redis_bytes", "KV bytes moved to and from Redis", ["direction"])
OP_SECONDS = Histogram("lmc_redis_op_seconds", "Latency of one batched tier call", ["op"],
                       buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0))


def breaker_listener(node: str):
    """A callback for :class:`CircuitBreaker` that mirrors its state into the gauge."""
    gauge = BREAKER_STATE.labels(node)
    trips = BREAKER_TRIPS.labels(node)
    gauge.set(0)

    def on_change(state: str) -> None:
        gauge.set(STATE_CODES[state])
        if state == "open":
            trips.inc()

    return on_change
