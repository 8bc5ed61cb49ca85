"""Prometheus metrics, plus the same figures as plain numbers for ``CacheEngine.stats()``.

Metrics are process-wide (several engines in one process add up, as a scrape expects) and are
updated once per call, never once per chunk, so they cost nothing measurable on the hot path.

An engine whose ``/metrics`` is served by another process (vLLM: the API server; lmc runs in
the workers) carries them there: :func:`values` reads this process's lmc counters and gauges
as flat ``{"m:<name>|<label values>": value}`` figures, the worker sends what changed through
the engine's own stats path, and :func:`apply` adds those changes to the same metrics in the
serving process, so its scrape shows ``lmc_lookups_total``, ``lmc_hit_tokens_total`` and the
per-tier series under their own names and labels (histograms stay in the worker).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

_LAT_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)

EVICTIONS = Counter("lmc_evictions", "Chunks evicted", ["tier"])
# the hit-rate funnel (lmc.storage.funnel; the scheduler half counts "used" and "local")
FUNNEL_TOKENS = Counter("lmc_funnel_tokens", "Prompt tokens looked up (prompt), the best "
                        "possible cache's hit (best), lmc's (found), the engine's own prefix "
                        "cache's at admission (local) and what the engine did not compute "
                        "(used: local plus lmc's load)", ["namespace", "stage"])
FUNNEL_FOUND = Counter("lmc_funnel_found_tokens", "Prompt tokens found, by the tier holding "
                       "them", ["namespace", "tier"])
FUNNEL_MISSES = Counter("lmc_funnel_miss_tokens", "Prompt tokens not found or not used, by "
                        "why", ["namespace", "reason"])


class _EngineCollectors:
    """The figures only a ``CacheEngine`` produces, registered when the process makes its
    first engine: a process without one (the ``lmc server`` daemon, which runs tiers but no
    engine) must not export them as series stuck at zero beside its own."""

    def __init__(self) -> None:
        self.lookups = Counter("lmc_lookups", "Lookup calls")
        self.lookup_tokens = Counter("lmc_lookup_tokens", "Prompt tokens looked up")
        self.hit_tokens = Counter("lmc_hit_tokens", "Prompt tokens found by lookups")
        self.op_bytes = Counter("lmc_bytes", "KV bytes moved between the engine and lmc", ["op"])
        self.op_tokens = Counter("lmc_tokens", "KV tokens moved between the engine and lmc",
                                 ["op"])
        self.op_seconds = Histogram("lmc_op_seconds",
                                    "Latency of store / retrieve / lookup calls", ["op"],
                                    buckets=_LAT_BUCKETS)
        self.skipped = Counter("lmc_skipped_chunks", "Chunks not stored", ["reason"])
        self.pool_used = Gauge("lmc_pool_used_bytes", "Bytes in use in the memory pool")
        self.pool_capacity = Gauge("lmc_pool_capacity_bytes", "Size of the memory pool")
        self.children: dict[str, tuple] = {}
        for op in ("store", "retrieve", "lookup"):  # made now, not by a request's first call
            self.of(op)

    def of(self, op: str) -> tuple:
        """Labelled children cached: ``labels()`` costs a lock and a dict lookup per call."""
        c = self.children.get(op)
        if c is None:
            c = self.children[op] = (self.op_bytes.labels(op), self.op_tokens.labels(op),
                                     self.op_seconds.labels(op))
        return c


_ENGINE: _EngineCollectors | None = None
_ENGINE_LOCK = threading.Lock()


def engine_collectors() -> _EngineCollectors:
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = _EngineCollectors()
        return _ENGINE


class EngineMetrics:
    """Per-engine plain counters that also feed the process-wide Prometheus metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, float] = defaultdict(float)
        self._m = engine_collectors()

    def _add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self.counts[k] += v

    def lookup(self, query_tokens: int, hit_tokens: int, seconds: float,
               unanswered_tokens: int = 0) -> None:
        m = self._m
        m.lookups.inc()
        m.lookup_tokens.inc(query_tokens)
        m.hit_tokens.inc(hit_tokens)
        m.of("lookup")[2].observe(seconds)
        self._add(lookups=1, lookup_tokens=query_tokens, hit_tokens=hit_tokens)
        if unanswered_tokens:  # past the hit, a lower tier did not answer in time
            self._add(lookups_unanswered=1, lookup_unanswered_tokens=unanswered_tokens)

    def transfer(self, op: str, tokens: int, nbytes: int, seconds: float) -> None:
        b, t, s = self._m.of(op)
        b.inc(nbytes)
        t.inc(tokens)
        s.observe(seconds)
        self._add(**{f"{op}_calls": 1, f"{op}_tokens": tokens, f"{op}_bytes": nbytes,
                     f"{op}_seconds": seconds})

    def skipped(self, reason: str, chunks: int) -> None:
        if chunks:
            self._m.skipped.labels(reason).inc(chunks)
            self._add(**{f"skipped_{reason}": chunks})

    def evicted(self, tier: str, chunks: int) -> None:
        if chunks:
            EVICTIONS.labels(tier).inc(chunks)
            self._add(**{f"evictions_{tier}": chunks})

    def pool(self, used: int, capacity: int) -> None:
        self._m.pool_used.set(used)
        self._m.pool_capacity.set(capacity)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counts)


_POOL_GAUGES: dict[str, Gauge] = {}
_POOL_DOCS = {
    "lmc_pool_prefaulted_bytes": "Bytes of open memory pools populated ahead of use (all of "
                                 "this process)",
    "lmc_pool_pinned_bytes": "Bytes of open memory pools page-locked for the GPU (all of this "
                             "process)"}


def pool_gauge(name: str) -> Gauge:
    """A pool gauge (``lmc.memory.prefault``), registered when the process makes its first
    pool that needs it: a process without one (vLLM's API server imports lmc) exports no
    series stuck at 0."""
    with _ENGINE_LOCK:
        g = _POOL_GAUGES.get(name)
        if g is None:
            g = _POOL_GAUGES[name] = Gauge(name, _POOL_DOCS[name])
        return g


# ---------------------------------------------------------------- lower tiers
TIER_HITS = Counter("lmc_tier_hits", "Chunks a tier had, by op (lookup = contains, get = read)",
                    ["tier", "op"])
TIER_MISSES = Counter("lmc_tier_misses", "Chunks a tier did not have (or could not serve)",
                      ["tier", "op"])
TIER_BYTES = Counter("lmc_tier_bytes", "Payload bytes read from / written to a tier",
                     ["tier", "direction"])
TIER_SECONDS = Histogram("lmc_tier_seconds", "Latency of one batched tier call",
                         ["tier", "op"], buckets=_LAT_BUCKETS)
TIER_ERRORS = Counter("lmc_tier_errors", "Tier operations that failed (turned into misses or "
                      "skipped writes)", ["tier", "op", "reason"])
CHECKSUM_FAILURES = Counter("lmc_checksum_failures", "Stored values that failed their header, "
                            "key or payload check: served as misses and deleted", ["tier"])
PROMOTED = Counter("lmc_promoted_chunks", "Lower-tier hits copied into L1", ["tier"])
QUEUE_BYTES = Gauge("lmc_write_queue_bytes", "Bytes waiting in a tier's write-behind queue",
                    ["tier"])
QUEUE_CHUNKS = Gauge("lmc_write_queue_chunks", "Chunks waiting in a tier's write-behind queue",
                     ["tier"])
CODEC_BYTES = Counter("lmc_codec_bytes", "KV bytes through a tier's codec stage (lmc.storage."
                      "kvcodecs): raw = the chunks' own bytes, stored = what the tier holds",
                      ["tier", "op", "form"])
DROPPED_WRITES = Counter("lmc_write_dropped_chunks", "Chunks never written to a tier "
                         "(queue_full, closed, error)", ["tier", "reason"])


def codec_bytes(tier: str, op: str, form: str) -> Any:
    """The ``lmc_codec_bytes`` counter of one tier's ``op`` (write, read) and ``form`` (raw,
    stored): bytes before and after its codec stage."""
    return CODEC_BYTES.labels(tier, op, form)


class TierMetrics:
    """One tier's counters: Prometheus (process-wide, labelled by tier name) plus plain numbers
    for ``stats()``. The storage manager records lookups, reads, writes, queue state and drops
    for every lower tier; a tier records what only it can see (checksum failures, I/O errors)
    through the same object, so ``stats()`` shows one set of figures per tier.
    """

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self.counts: dict[str, float] = defaultdict(float)
        self._hit = {op: TIER_HITS.labels(tier, op) for op in ("lookup", "get")}
        self._miss = {op: TIER_MISSES.labels(tier, op) for op in ("lookup", "get")}
        self._bytes = {d: TIER_BYTES.labels(tier, d) for d in ("read", "write")}
        self._secs = {op: TIER_SECONDS.labels(tier, op) for op in ("lookup", "get", "put")}
        self._qbytes = QUEUE_BYTES.labels(tier)
        self._qchunks = QUEUE_CHUNKS.labels(tier)

    def _add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self.counts[k] += v

    def lookup(self, hits: int, misses: int, seconds: float) -> None:
        self._hit["lookup"].inc(hits)
        self._miss["lookup"].inc(misses)
        self._secs["lookup"].observe(seconds)
        self._add(lookup_hits=hits, lookup_misses=misses, lookup_seconds=seconds)

    def lookup_late(self, why: str, keys: int, seconds: float) -> None:
        """A lookup's existence check that did not answer within the lookup's deadline
        (``why``: ``late`` or ``busy``, :mod:`lmc.storage.timed_contains`): ``keys`` misses."""
        self._miss["lookup"].inc(keys)
        self._secs["lookup"].observe(seconds)
        self._add(**{f"lookup_{why}": 1, "lookup_misses": keys, "lookup_seconds": seconds})

    def read(self, hits: int, misses: int, nbytes: int, seconds: float) -> None:
        self._hit["get"].inc(hits)
        self._miss["get"].inc(misses)
        self._bytes["read"].inc(nbytes)
        self._secs["get"].observe(seconds)
        self._add(get_hits=hits, get_misses=misses, read_bytes=nbytes, get_seconds=seconds)

    def write(self, stored: int, nbytes: int, seconds: float) -> None:
        self._bytes["write"].inc(nbytes)
        self._secs["put"].observe(seconds)
        self._add(put_chunks=stored, write_bytes=nbytes, put_seconds=seconds)

    def skipped_present(self, n: int) -> None:
        """Chunks not written because the tier already held them."""
        if n:
            self._add(put_skipped_present=n)

    def error(self, op: str, reason: str, n: int = 1) -> None:
        if n:
            TIER_ERRORS.labels(self.tier, op, reason).inc(n)
            self._add(**{f"errors_{op}_{reason}": n})

    def checksum_failure(self, n: int = 1) -> None:
        if n:
            CHECKSUM_FAILURES.labels(self.tier).inc(n)
            self._add(checksum_failures=n)

    def promoted(self, n: int) -> None:
        if n:
            PROMOTED.labels(self.tier).inc(n)
            self._add(promoted=n)

    def queue(self, nbytes: int, chunks: int) -> None:
        self._qbytes.set(nbytes)
        self._qchunks.set(chunks)

    def dropped(self, reason: str, n: int) -> None:
        if n:
            DROPPED_WRITES.labels(self.tier, reason).inc(n)
            self._add(**{f"dropped_{reason}": n})

    def get(self, name: str) -> float:
        with self._lock:
            return self.counts.get(name, 0.0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counts)


# ------------------------------------------------------- across processes (vLLM)
PREFIX = "m:"


def _carried() -> dict[str, MetricWrapperBase]:
    """The counters and gauges :func:`values` reads and :func:`apply` feeds, by name."""
    m = engine_collectors()
    out: list[MetricWrapperBase] = [
        m.lookups, m.lookup_tokens, m.hit_tokens, m.op_bytes, m.op_tokens, m.skipped,
        m.pool_used, m.pool_capacity, EVICTIONS, TIER_HITS, TIER_MISSES, TIER_BYTES,
        TIER_ERRORS, CHECKSUM_FAILURES, PROMOTED, QUEUE_BYTES, QUEUE_CHUNKS, DROPPED_WRITES,
        CODEC_BYTES, FUNNEL_TOKENS, FUNNEL_FOUND, FUNNEL_MISSES,
        *(pool_gauge(n) for n in _POOL_DOCS)]
    return {c._name: c for c in out}  # noqa: SLF001 - the name it was made with


def values() -> dict[str, float]:
    """This process's lmc counters and gauges: ``{"m:lmc_tier_hits|disk,lookup": 12.0}``
    (a counter's value without ``_total``; label values in the metric's label order)."""
    out: dict[str, float] = {}
    for name, metric in _carried().items():
        for fam in metric.collect():
            for sample in fam.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = ",".join(sample.labels[k] for k in metric._labelnames)  # noqa: SLF001
                out[f"{PREFIX}{name}|{labels}"] = float(sample.value)
    return out


def apply(deltas: dict[str, float]) -> int:
    """Add ``deltas`` (changes of :func:`values` in another process, summed over its
    ranks) to this process's metrics; other keys are ignored. Returns how many applied;
    a key naming no lmc metric, the wrong number of labels or a negative counter change is
    skipped (a peer's stats are data, not code)."""
    carried = _carried()
    done = 0
    for key, delta in deltas.items():
        if not key.startswith(PREFIX) or not isinstance(delta, (int, float)) or not delta:
            continue
        name, _, labels = key[len(PREFIX):].partition("|")
        metric = carried.get(name)
        if metric is None:
            continue
        names = metric._labelnames  # noqa: SLF001
        parts = labels.split(",") if names else []
        if len(parts) != len(names) or not (isinstance(metric, Gauge) or delta > 0):
            continue
        child: Any = metric.labels(*parts) if names else metric
        child.inc(delta)
        done += 1
    return done
