"""Online speed estimates: how fast each tier loads and how fast the engine computes.

What the load-or-recompute decision (:mod:`lmc.connectors.core.load_policy`) needs is two
numbers per request: how long loading ``N`` prefix tokens takes, and how long computing the
rest takes. Both change at run time (a disk shared with another job, a link that fills, a
batch that grows), so they are measured from real work, not configured once:

* a tier's load: every lower-tier read the storage manager times (bytes moved, seconds from
  the call to the last byte) is one observation of ``seconds = latency + bytes / rate``;
  a read that failed (breaker, timeout) counts as its seconds for no bytes, so a tier that
  turns slow or dead is avoided by the next decisions. L1's "load" is the copy into the
  engine's KV, observed by the connector's worker on the CPU (on a GPU the prior stays:
  the host cannot see the copy's end without synchronising).
* the engine's prefill: each step whose forward the connector saw (from ``start_load`` to
  ``wait_for_save``, less its waits for loads: the host's on the CPU, the engine stream's
  on a GPU, bracketed by events) is one observation of
  ``seconds = c0 + c1 * tokens + c2 * attention + c3 * saved``, where ``attention`` is
  ``sum(end**2 - start**2)`` over the step's requests (attention makes later tokens dearer;
  the planner's prefill fit has the same form) and ``saved`` the new tokens lmc saved
  beside the forward (not part of a recompute: see :class:`PrefillSpeed`).

Why a fit over a window kept per size bucket rather than one moving average: decode steps
(a few tokens) far outnumber prefills (thousands), and an average of seconds per token
would be the decodes' fixed cost. Keeping the last few observations per power-of-two size
lets a long prefill's measurement survive thousands of decodes, and the fit separates the
fixed cost from the per-token one. The window is the smoothing: an old observation of a
size is replaced by the next one of that size. A tier's reads are also weighted by age
(half-life of 4 reads): a link or disk that turns slow must be followed within a few
reads, while a model's compute does not change. Everything is bounded (buckets x window).

Until a tier has been observed its prior is used (``load_policy_priors``; per medium
otherwise). Until the engine's compute has been observed there is no compute estimate and
the decision loads the whole hit (what lmc did before it decided at all).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_PRIOR_BYTES_PER_S = {
    "memory": 8 << 30,  # a host-to-KV copy (CPU numpy or PCIe)
    "local_storage": 1 << 30,
    "remote": 256 << 20,
    "peer": 4 << 30,
}
"""Tier speeds assumed before a tier's first read, by declared medium."""
RECENT_WEIGHT = 0.1  # a tier read weighing less (> 3 half-lives old) bounds no latency


_GAUGES: tuple[Any, Any, Any] | None = None
_GAUGES_LOCK = threading.Lock()


def _gauges() -> tuple[Any, Any, Any]:
    """The estimates as Prometheus gauges, registered with the first ``Speeds`` (a process
    without an engine exports none): bytes per second and latency per tier, the prefill's
    tokens per second at 1,024 and 8,192 tokens."""
    global _GAUGES
    with _GAUGES_LOCK:
        if _GAUGES is None:
            from prometheus_client import Gauge

            _GAUGES = (
                Gauge("lmc_load_speed_bytes_per_second",
                      "Measured load speed of each tier (L1: the copy into the KV)", ["tier"]),
                Gauge("lmc_load_latency_seconds", "Measured per-load latency of each tier",
                      ["tier"]),
                Gauge("lmc_prefill_tokens_per_second",
                      "The engine's measured prefill speed at a prompt length", ["tokens"]))
        return _GAUGES


class LinearFit:
    """``y ~ sum(c_k * x_k)`` with every ``c_k >= 0``, least squares over the most recent
    ``per_bucket`` observations of each size bucket (``bucket`` = ``floor(log2(size))``).

    A negative coefficient would predict a negative cost somewhere, so terms that come out
    negative are dropped and the rest refitted (as the planner's prefill fit does). Fewer
    buckets than terms cannot separate the terms: ``solve`` then answers ``None`` and the
    caller falls back to a simpler estimate."""

    def __init__(self, num_terms: int, per_bucket: int = 8, buckets: int = 48,
                 half_life: float | None = None) -> None:
        """``half_life``: an observation's weight halves every this many later observations
        (any bucket); ``None``: every kept observation weighs the same."""
        self.num_terms = num_terms
        self.per_bucket = per_bucket
        self.buckets = buckets
        self.half_life = half_life
        self._obs: dict[int, deque[tuple[tuple[float, ...], float, int]]] = {}
        self._lock = threading.Lock()
        self._solved: tuple[float, ...] | None = None
        self._dirty = True
        self.count = 0

    def add(self, size: float, x: Sequence[float], y: float) -> None:
        if len(x) != self.num_terms:
            raise ValueError(f"{len(x)} terms, the fit has {self.num_terms}")
        if not (math.isfinite(y) and y >= 0 and all(math.isfinite(v) and v >= 0 for v in x)):
            return  # a clock jump or a bad count: never poison the estimate
        b = min(self.buckets - 1, max(0, int(math.log2(size)) + 1 if size >= 1 else 0))
        with self._lock:
            q = self._obs.get(b)
            if q is None:
                q = self._obs[b] = deque(maxlen=self.per_bucket)
            q.append((tuple(float(v) for v in x), float(y), self.count))
            self.count += 1
            self._dirty = True

    def _weight(self, seq: int) -> float:
        if self.half_life is None:
            return 1.0
        return 0.5 ** ((self.count - 1 - seq) / self.half_life)

    def observations(self) -> list[tuple[tuple[float, ...], float, float]]:
        """(terms, value, weight) of every kept observation."""
        with self._lock:
            return [(x, y, self._weight(i)) for q in self._obs.values() for x, y, i in q]

    @property
    def num_buckets(self) -> int:
        return len(self._obs)

    def solve(self) -> tuple[float, ...] | None:
        """The coefficients, or ``None`` with fewer size buckets observed than terms."""
        with self._lock:
            if not self._dirty:
                return self._solved
            obs = [o for q in self._obs.values() for o in q]
            enough = len(self._obs) >= self.num_terms
            self._dirty = False
            self._solved = nonneg_lstsq([x for x, _, _ in obs], [y for _, y, _ in obs],
                                        [self._weight(i) for _, _, i in obs]) \
                if enough else None
            return self._solved


def nonneg_lstsq(xs: Sequence[Sequence[float]], ys: Sequence[float],
                 weights: Sequence[float] | None = None) -> tuple[float, ...]:
    """(Weighted) least squares with negative terms dropped and the rest refitted."""
    a = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if weights is not None:
        w = np.sqrt(np.asarray(weights, dtype=np.float64))
        a, y = a * w[:, None], y * w
    keep = list(range(a.shape[1]))
    coef = np.zeros(0)
    while keep:
        # columns scaled to one so seconds-per-byte and a fixed cost are fitted alike
        cols = a[:, keep]
        scale = np.maximum(np.abs(cols).max(axis=0), 1e-30)
        coef, *_ = np.linalg.lstsq(cols / scale, y, rcond=None)
        coef = coef / scale
        neg = [k for k, c in zip(keep, coef) if c < 0]
        if not neg:
            break
        keep = [k for k in keep if k not in neg]
    out = [0.0] * a.shape[1]
    for k, c in zip(keep, coef):
        out[k] = max(0.0, float(c))
    return tuple(out)


@dataclass(frozen=True)
class TierRate:
    """A tier's load speed as the decision uses it: ``latency_s + bytes / bytes_per_s`` per
    load touching it. ``overlaps``: it fills chunks layer by layer under the engine's
    compute (a tier with layered reads, and L1's copy); otherwise its reads finish before
    the forward starts. ``observed``: reads behind the figure (0: the prior)."""

    name: str
    bytes_per_s: float
    latency_s: float = 0.0
    overlaps: bool = True
    observed: int = 0

    def __post_init__(self) -> None:
        if not (self.bytes_per_s > 0 and self.latency_s >= 0):
            raise ValueError(f"tier {self.name}: bytes_per_s must be > 0 and latency_s >= 0, "
                             f"got {self.bytes_per_s}, {self.latency_s}")


@dataclass(frozen=True)
class KVBytes:
    """The bytes a load of ``n`` prefix positions moves, by KV group kind (a hybrid model,
    :mod:`lmc.hybrid`): ``per_token`` for every position (full attention); per sliding
    group ``(reach, bytes per position)``, at most ``reach`` positions (its window and the
    chunk it starts in); ``fixed`` once (state rows). A plain model has ``per_token`` only,
    so a load moves ``n * per_token``."""

    per_token: float
    windows: tuple[tuple[int, float], ...] = ()
    fixed: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.per_token) and self.per_token >= 0
                and math.isfinite(self.fixed) and self.fixed >= 0) or any(
                w < 1 or not (math.isfinite(b) and b >= 0) for w, b in self.windows):
            raise ValueError(f"KVBytes: bytes must be finite and >= 0, windows >= 1, got "
                             f"{self.per_token}, {self.windows}, {self.fixed}")

    def load(self, n: int) -> float:
        """Bytes of a load of ``n`` positions (0 for none)."""
        if n <= 0:
            return 0.0
        return n * self.per_token + sum(b * min(n, w) for w, b in self.windows) + self.fixed

    @property
    def hybrid(self) -> bool:
        return bool(self.windows) or self.fixed > 0


@dataclass(frozen=True)
class PrefillRate:
    """Seconds to compute positions ``[start, end)`` of one request:
    ``c0 + c1 * (end - start) + c2 * (end**2 - start**2)``. ``observed``: steps behind it."""

    c0: float
    c1: float
    c2: float = 0.0
    observed: int = 0

    def seconds(self, start: float, end: float) -> float:
        if end <= start:
            return 0.0
        return self.c0 + self.c1 * (end - start) + self.c2 * (end * end - start * start)

    def tokens_per_s(self, tokens: int) -> float:
        """The rate of a prefill of ``tokens`` from an empty context (stats)."""
        s = self.seconds(0, tokens)
        return tokens / s if s > 0 else math.inf


class TierSpeed:
    """One tier's load observations; :meth:`rate` the current estimate."""

    def __init__(self, name: str, prior_bytes_per_s: float, overlaps: bool,
                 prior_latency_s: float = 0.0) -> None:
        self.name = name
        self.prior = TierRate(name, prior_bytes_per_s, prior_latency_s, overlaps)
        self.overlaps = overlaps
        # seconds = latency + bytes * seconds_per_byte; recent reads weigh most (a tier
        # that turns slow is followed within a few reads), sizes kept apart so latency and
        # rate stay separable
        self.fit = LinearFit(2, per_bucket=4, half_life=4.0)
        self.failures = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        self.fit.add(nbytes, (1.0, float(nbytes)), seconds)

    def observe_failure(self, seconds: float) -> None:
        """A read that failed after ``seconds``: a call that cost time and moved nothing."""
        self.failures += 1
        self.fit.add(0, (1.0, 0.0), seconds)

    def _bounded(self, latency: float, s_per_byte: float) -> tuple[float, float]:
        """The fit's (latency, seconds per byte), unless it misses a recent read by over
        20% with a latency over half the quickest of them: then the prior's latency and the
        rate refitted through it. While a tier's speed changes, its size buckets hold reads
        of the old speed and the new, and a line through both can put the intercept
        anywhere (a Redis link turned 4x faster read as 333 ms of latency, so a small load
        looked dear and was not made). A recent failure's time is latency by definition (a
        failing tier must look slow): then the fit stands."""
        obs = [(x[1], y, w) for x, y, w in self.fit.observations() if w >= RECENT_WEIGHT]
        if not obs or any(b <= 0 or y <= 0 for b, y, _ in obs):
            return latency, s_per_byte
        worst = max(abs(latency + b * s_per_byte - y) / y for b, y, _ in obs)
        half_quickest = 0.5 * min(y for _, y, _ in obs)
        if worst <= 0.2 or latency <= half_quickest:
            return latency, s_per_byte
        lat = min(self.prior.latency_s, half_quickest)
        num = sum(w * b * (y - lat) for b, y, w in obs)
        den = sum(w * b * b for b, _, w in obs)
        if num <= 0 or den <= 0:
            return latency, s_per_byte
        return lat, num / den

    def rate(self) -> TierRate:
        n = self.fit.count
        if n == 0:
            return self.prior
        coef = self.fit.solve()
        if coef is not None and coef[1] > 0:
            lat, spb = self._bounded(coef[0], coef[1])
            return TierRate(self.name, 1.0 / spb, lat, self.overlaps, n)
        # reads of one size only (or all failed): latency from the prior, rate from the rest
        obs = self.fit.observations()
        weight = sum(w for _, _, w in obs)
        nbytes = sum(x[1] * w for x, _, w in obs)
        seconds = sum(y * w for _, y, w in obs) - weight * self.prior.latency_s
        if nbytes <= 0:  # nothing but failures: their time is all latency
            lat = sum(y * w for _, y, w in obs) / weight
            return TierRate(self.name, self.prior.bytes_per_s, lat, self.overlaps, n)
        if seconds <= 0:
            return TierRate(self.name, self.prior.bytes_per_s, self.prior.latency_s,
                            self.overlaps, n)
        return TierRate(self.name, nbytes / seconds, self.prior.latency_s, self.overlaps, n)


LEAN_MIN_TOKENS = 128  # a step this long that saved under half of it tells compute from saves


class PrefillSpeed:
    """The engine's compute, from the steps the connector saw; :meth:`rate` the estimate
    (``None`` until observed and no prior).

    A step that saved new chunks also paid for lmc's saves (gathers beside the forward, the
    commit): on an H100 a cold 16k-token prefill with lmc took 1.7x the engine alone, and a
    fit over such steps put compute at 78k tokens/s against the engine's 168k -- so a hit was
    loaded from disk where recomputing it was 3x faster. The tokens a step saved are a fourth
    term, ``c3 * saved``, kept out of :meth:`rate`: recomputing a hit saves nothing (its
    chunks are held already). The term is fitted only once some steps saved little (else it
    cannot be told from compute, and the saves stay in, as before): two sizes of such
    steps, of at least ``LEAN_MIN_TOKENS`` each."""

    def __init__(self, prior_tokens_per_s: float | None = None) -> None:
        self.prior = (PrefillRate(0.0, 1.0 / prior_tokens_per_s) if prior_tokens_per_s
                      else None)
        self.fit = LinearFit(4)
        self.save_s_per_token = 0.0  # c3 of the last rate(): stats
        self._rate: tuple[int, PrefillRate | None] | None = None  # (fit.count, its rate)
        self.floor: PrefillRate | None = None
        """The fastest the engine could compute (its model's arithmetic at the device's
        measured matmul rate; set by a connector at registration). Only a load watching
        itself (:mod:`lmc.storage.load_watch`) uses it, and only before anything was
        measured: never a decision to recompute, only a limit on how long a load that
        turns out slow may go on."""

    def estimate(self) -> PrefillRate | None:
        """What a running load compares itself with: :meth:`rate`, else :attr:`floor`."""
        return self.rate() or self.floor

    def observe(self, tokens: int, attention: float, seconds: float, saved: int = 0) -> None:
        """A step that computed ``tokens`` positions, ``attention`` = sum of
        ``end**2 - start**2`` over its requests, and saved ``saved`` new tokens, in
        ``seconds``."""
        if tokens > 0:
            self.fit.add(tokens, (1.0, float(tokens), float(attention), float(max(0, saved))),
                         seconds)

    def rate(self) -> PrefillRate | None:
        n = self.fit.count
        if n == 0:
            return self.prior
        cached = self._rate
        if cached is not None and cached[0] == n:  # asked by every lookup and decision:
            return cached[1]  # a fit (numpy, ~0.1-5 ms) only after a new step
        out = self._fit_rate(n)
        self._rate = (n, out)
        return out

    def _fit_rate(self, n: int) -> PrefillRate | None:
        obs = self.fit.observations()
        # prefill-sized steps that saved little (a decode's few tokens say nothing of c1)
        lean = {int(math.log2(x[1])) for x, _, _ in obs
                if x[1] >= LEAN_MIN_TOKENS and x[3] < 0.5 * x[1]}
        coef: tuple[float, ...] | None = None
        if len(lean) >= 2 and self.fit.num_buckets >= 4:
            coef = self.fit.solve()
        if coef is None and self.fit.num_buckets >= 3:  # the saves inseparable: as compute
            coef = (*nonneg_lstsq([x[:3] for x, _, _ in obs], [y for _, y, _ in obs],
                                  [w for _, _, w in obs]), 0.0)
        if coef is not None and (coef[1] > 0 or coef[2] > 0):
            self.save_s_per_token = coef[3]
            return PrefillRate(coef[0], coef[1], coef[2], n)
        # one size only: a plain rate through the origin
        tokens = sum(x[1] for x, _, _ in obs)
        seconds = sum(y for _, y, _ in obs)
        if tokens <= 0 or seconds <= 0:
            return self.prior
        return PrefillRate(0.0, seconds / tokens, 0.0, n)


@dataclass(frozen=True)
class SpeedSnapshot:
    """Every estimate at one moment: ``tiers`` in chain order (L1 first), ``prefill`` the
    engine's compute (``None``: not known yet)."""

    tiers: tuple[TierRate, ...]
    prefill: PrefillRate | None


class Speeds:
    """A cache engine's estimates: one :class:`TierSpeed` per tier (chain order) and the
    engine's :class:`PrefillSpeed`. Thread-safe (each fit locks itself)."""

    def __init__(self, tiers: Sequence[tuple[str, str, bool]],
                 priors: Mapping[str, float] | None = None) -> None:
        """``tiers``: (name, medium, overlaps) per tier, L1 first; ``priors``: bytes per
        second by tier name or medium, and ``prefill`` in tokens per second."""
        priors = dict(priors or {})
        self.tiers = [TierSpeed(name, float(priors.get(name) or priors.get(medium)
                                            or DEFAULT_PRIOR_BYTES_PER_S.get(medium, 1 << 28)),
                                overlaps)
                      for name, medium, overlaps in tiers]
        self.prefill = PrefillSpeed(priors.get("prefill") or None)
        # numpy's least squares loads LAPACK on first use (~5 ms): here, not in the first
        # request's decision
        nonneg_lstsq([(1.0, 1.0), (1.0, 2.0)], [1.0, 2.0])

    def snapshot(self) -> SpeedSnapshot:
        return SpeedSnapshot(tuple(t.rate() for t in self.tiers), self.prefill.rate())

    def export(self, snap: SpeedSnapshot | None = None) -> SpeedSnapshot:
        """Set the Prometheus gauges from ``snap`` (taken now if not given)."""
        snap = snap or self.snapshot()
        rate, latency, prefill = _gauges()
        for t in snap.tiers:
            rate.labels(t.name).set(t.bytes_per_s)
            latency.labels(t.name).set(t.latency_s)
        if snap.prefill is not None:
            for n in (1024, 8192):
                prefill.labels(str(n)).set(snap.prefill.tokens_per_s(n))
        return snap

    def stats(self) -> dict[str, float]:
        """``speed.<tier>.bytes_per_s`` / ``latency_s`` / ``observed`` and the prefill fit
        (``speed.prefill.*``; the rate of a 1,024-token and an 8,192-token prefill); the
        Prometheus gauges are set from the same snapshot."""
        snap = self.export()
        out: dict[str, float] = {}
        for t in snap.tiers:
            out[f"speed.{t.name}.bytes_per_s"] = t.bytes_per_s
            out[f"speed.{t.name}.latency_s"] = t.latency_s
            out[f"speed.{t.name}.observed"] = t.observed
        p = snap.prefill
        if p is not None:
            out.update({"speed.prefill.c0_s": p.c0, "speed.prefill.c1_s": p.c1,
                        "speed.prefill.c2_s": p.c2, "speed.prefill.observed": p.observed,
                        "speed.prefill.save_s_per_token": self.prefill.save_s_per_token,
                        "speed.prefill.tokens_per_s_1k": p.tokens_per_s(1024),
                        "speed.prefill.tokens_per_s_8k": p.tokens_per_s(8192)})
        return out
