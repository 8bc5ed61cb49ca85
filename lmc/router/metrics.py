"""Prometheus metrics of a front's routing, the same series for ``lmc router``
(``lmc_router_*``, per instance) and ``lmc pd-proxy`` (``lmc_pd_proxy_*``, per role and
instance): requests sent per instance and reason, prompt tokens, the cached tokens the
events predicted next to those the answer reported, failures before answering, requests
sent on to another instance, and, read from the fleets at each scrape, requests in flight,
health and event freshness (standard library and ``prometheus_client``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from lmc.router.dispatch import Instance

CONTENT_TYPE = "text/plain; version=0.0.4"
Who = tuple[str, ...]  # label values: (url,) for the router, (role, url) for the pd-proxy


class RoutingMetrics:
    """The series of one front; ``prefix`` names them, ``scope`` their labels before
    ``instance`` (the pd-proxy's ``role``)."""

    def __init__(self, prefix: str, scope: Sequence[str] = ()) -> None:
        r = self.registry = CollectorRegistry()
        who = [*scope, "instance"]
        self.requests = Counter(f"{prefix}_requests", "Requests sent, by instance and why it "
                                "was chosen (prefix, load, stale, no_tokens, round_robin)",
                                [*who, "reason"], registry=r)
        self.prompt = Counter(f"{prefix}_prompt_tokens", "Prompt tokens sent", who,
                              registry=r)
        self.predicted = Counter(f"{prefix}_predicted_cached_tokens", "Prompt tokens the "
                                 "events said the instance had cached", who, registry=r)
        self.reported = Counter(f"{prefix}_reported_cached_tokens", "Prompt tokens the "
                                "instance reported cached (usage.prompt_tokens_details)",
                                who, registry=r)
        self.failures = Counter(f"{prefix}_upstream_failures", "Requests an instance failed "
                                "before answering", who, registry=r)
        self.retries = Counter(f"{prefix}_retries", "Requests sent on to another instance "
                               "after the one chosen failed before answering", list(scope),
                               registry=r)
        self.in_flight = Gauge(f"{prefix}_in_flight", "Requests in flight", who, registry=r)
        self.healthy = Gauge(f"{prefix}_instance_healthy", "1 if the instance answers its "
                             "health check", who, registry=r)
        self.fresh = Gauge(f"{prefix}_events_fresh", "1 if the instance's events are synced "
                           "and recent", who, registry=r)
        self.blocks = Gauge(f"{prefix}_indexed_blocks", "Blocks the front knows the "
                            "instance caches", who, registry=r)
        self.gaps = Gauge(f"{prefix}_event_gaps", "Sequence gaps seen in the instance's "
                          "events", who, registry=r)

    def sent(self, who: Who, reason: str, prompt_tokens: int, predicted: int) -> None:
        """A request went to the instance ``who`` (its connection was made)."""
        self.requests.labels(*who, reason).inc()
        self.prompt.labels(*who).inc(prompt_tokens)
        self.predicted.labels(*who).inc(predicted)

    def answered(self, who: Who, answer_tail: bytes | None) -> None:
        """Count the cached tokens the instance's answer reports (if it does)."""
        n = cached_tokens(answer_tail) if answer_tail else None
        if n is not None:
            self.reported.labels(*who).inc(n)

    def scrape(self, instances: Iterable[tuple[Who, Instance]], stale_after: float) -> bytes:
        """The text exposition, the gauges read from ``instances`` now."""
        now = time.monotonic()
        for who, i in instances:
            self.healthy.labels(*who).set(1 if i.healthy else 0)
            self.in_flight.labels(*who).set(i.in_flight)
            if i.source is not None:
                self.fresh.labels(*who).set(1 if i.source.fresh(stale_after, now) else 0)
                self.blocks.labels(*who).set(i.source.index.blocks)
                self.gaps.labels(*who).set(i.source.counts["gaps"])
        return generate_latest(self.registry)


def cached_tokens(tail: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from the end of an answer (a JSON body,
    or the last server-sent event carrying usage); a lying value (negative, huge, not an
    integer) is None."""
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data:"):
            line = line[5:].strip()
        if b"cached_tokens" not in line or not line.startswith(b"{"):
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            continue
        usage = obj.get("usage") if isinstance(obj, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        n = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 40:
            return n
    return None
