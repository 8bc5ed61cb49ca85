"""Prometheus metrics only the Redis tier can see: its breakers and the calls they refused.

Hits, misses, bytes, latency, errors and checksum failures go through the tier's
``lmc.metrics.TierMetrics`` (shared with the storage manager, labelled ``tier="redis"``).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from lmc.storage.breaker import STATE_CODES

BREAKER_STATE = Gauge(
    "lmc_redis_breaker_state", "Circuit breaker of each Redis node: 0 closed, 1 half-open, 2 open",
    ["node"])
BREAKER_TRIPS = Counter("lmc_redis_breaker_trips", "Times a node's breaker opened", ["node"])
REJECTED_KEYS = Counter(
    "lmc_redis_rejected_keys", "Keys answered without a call because the breaker was open", ["op"])


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
