"""The daemon's Prometheus metrics (``/metrics``): connections, requests, bytes, failures.

Counters are updated once per request, not per value. Gauges that describe the storage
(pool occupancy, chunks) are read at scrape time through callbacks, so they cost nothing on
the request path.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

_LAT = (5e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)

CONNECTIONS = Gauge("lmc_server_connections", "Open client connections")
ACCEPTED = Counter("lmc_server_connections_accepted", "Client connections accepted", ["via"])
REFUSED = Counter("lmc_server_connections_refused", "Connections refused (limit or shutdown)")
AUTH_FAILURES = Counter("lmc_server_auth_failures", "Connections rejected for their token")
FORBIDDEN = Counter("lmc_server_forbidden", "Requests refused: namespace not granted by the token")
UNAUTHENTICATED_DROPPED = Counter(
    "lmc_server_unauthenticated_dropped",
    "Connections closed before their HELLO", ["why"])  # hello_timeout | displaced
ACCEPT_ERRORS = Counter("lmc_server_accept_errors", "accept() failures (e.g. out of fds)")
NAMESPACES_RECLAIMED = Counter("lmc_server_namespaces_reclaimed",
                               "Namespace ledgers reclaimed to stay within max_namespaces")
REQUESTS = Counter("lmc_server_requests", "Requests answered", ["op", "status"])
REQUEST_SECONDS = Histogram("lmc_server_request_seconds", "Time to answer a request", ["op"],
                            buckets=_LAT)
BYTES = Counter("lmc_server_bytes", "Value bytes moved", ["direction"])
VALUES = Counter("lmc_server_values", "Values by outcome", ["outcome"])
PROTOCOL_ERRORS = Counter("lmc_server_protocol_errors", "Malformed frames", ["status"])
WRITE_WAIT_EXPIRED = Counter("lmc_server_write_wait_expired",
                             "PUTs answered after write_wait with a write-behind queue still "
                             "full (a lower tier misses their values)")
STALLED = Counter("lmc_server_stalled_connections", "Connections dropped mid-frame for stalling")
POOL_USED = Gauge("lmc_server_pool_used_bytes", "Bytes in use in the daemon's memory pool")
POOL_CAPACITY = Gauge("lmc_server_pool_capacity_bytes", "Size of the daemon's memory pool")
CHUNKS = Gauge("lmc_server_chunks", "Chunks in the daemon's memory tier")


def bind_storage(used: Callable[[], float], capacity: Callable[[], float],
                 chunks: Callable[[], float]) -> None:
    POOL_USED.set_function(used)
    POOL_CAPACITY.set_function(capacity)
    CHUNKS.set_function(chunks)
