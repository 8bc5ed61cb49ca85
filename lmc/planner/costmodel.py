"""TTFT from hits: a cost model whose every number was measured on this machine, with lmc.

A profile (``lmc plan --calibrate``, stored as JSON) holds the TTFT of a request that misses,
served by the reference engine *with lmc's connector* (so it includes lmc's lookup and the
saving of the new chunks), at a few prompt lengths, and, per tier, what loading a chunk's KV
from it adds to a request's TTFT through the connector (see :mod:`lmc.planner.calibrate`).
Prefill time is fitted as ``t(L) = c0 + c1*L + c2*L**2`` (attention makes later tokens
dearer), so computing the suffix ``[p, n)`` of a prompt whose first ``p`` tokens were loaded
costs ``c0 + (t(n) - c0) - (t(p) - c0)``: ``c0`` is the per-request cost (scheduling, lookup,
sampling) paid once. A request's predicted TTFT is that plus each tier's load time; since a
tier's cost is measured as a hit's TTFT minus the fitted prefill of its computed token, what
layer-wise loading hides behind compute is already left out of it. Why a fit rather than the
points: traces have every length, and the fit's residual on the measured points is kept in
the profile so a bad fit is visible. ``tests/planner/test_validate.py`` checks the predicted
mean TTFT against a replay within 20%.

**Load or recompute.** lmc does not always load a whole hit: its connectors load the part
that beats recomputing (:mod:`lmc.connectors.core.load_policy`), so a prediction that
charged every hit's load would overstate a slow tier's cost. :meth:`Profile.ttft_s` asks the
same rule (:func:`~lmc.connectors.core.load_policy.choose_split`, imported, not copied) how
much of each request's hit to load, with the profile's costs (:meth:`Profile.costs`): each
tier's measured cost is what a hit adds to TTFT through the connector, layer-wise overlap
already in it, so the rule sees them as additive (``num_layers = 1``: TTFT = loads +
compute). The sim gives hits by tier, not their order along the prompt; they are taken as
lying fastest tier first (L1, disk, remote), the usual shape of a shared prefix.

**Chunked prefill.** An engine with a per-step token budget (``lmc plan --step-tokens``:
vLLM's ``max_num_batched_tokens``, the reference engine's, which reaches lmc through
``KVConnector.set_step_budget``) computes a long rest in several steps, each paying the
per-step cost ``c0``; only the first hides a load. The rule is told the budget
(``choose_split(step_tokens=...)``, as :class:`~lmc.connectors.core.load_policy.LoadPolicy`
is), and the compute of a request that loads its whole hit, or nothing, is the rule's own
model with nothing loaded (:meth:`Profile.compute_s`), so both ends and every split are
priced alike. The profile itself is measured in one step per prompt (the fit is one step's
cost); the budget is applied when predicting, so one profile serves every budget.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmc.connectors.core.load_policy import Costs, Split, choose_split
from lmc.connectors.core.load_policy import ttft_s as rule_ttft_s
from lmc.storage.speeds import PrefillRate, TierRate
from lmc.user_cache import cache_dir
from lmc.workloads.inputs import InputError, parse_json, read_text

PROFILE_VERSION = 2  # 2: measured with lmc attached (1 measured the engine alone)


def default_profile_path() -> Path:
    return cache_dir() / "plan-profile.json"


class MissingProfile(FileNotFoundError):
    """No calibration profile where one was expected; the message says how to make one."""


@dataclass
class TierCost:
    """Loading ``b`` bytes in ``c`` chunks from a tier takes ``b / bytes_per_s + c * per_chunk_s``."""

    bytes_per_s: float
    per_chunk_s: float = 0.0

    def seconds(self, nbytes: Any, chunks: Any) -> Any:
        return nbytes / self.bytes_per_s + chunks * self.per_chunk_s


@dataclass
class Profile:
    model: str
    kv_bytes_per_token: int
    chunk_size: int
    prefill_points: list[tuple[int, float]]  # (prompt tokens, full-prefill seconds), measured
    tiers: dict[str, TierCost]
    fit: tuple[float, float, float] = (0.0, 0.0, 0.0)
    created: str = ""
    host: str = ""
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not any(self.fit):
            self.fit = fit_prefill(self.prefill_points)

    # ------------------------------------------------------------------ predictions
    def prefill_s(self, start: Any, end: Any) -> Any:
        """Seconds to compute tokens ``[start, end)`` of a prompt (``start`` already loaded)."""
        c0, c1, c2 = self.fit
        start = np.asarray(start, dtype=np.float64)
        end = np.asarray(end, dtype=np.float64)
        return c0 + c1 * (end - start) + c2 * (end * end - start * start)

    def compute_s(self, start: Any, end: Any, step_tokens: int = 0) -> Any:
        """Seconds to compute ``[start, end)`` (``start < end``) in steps of at most
        ``step_tokens`` positions (chunked prefill, each step paying the per-step cost; 0:
        one step, :meth:`prefill_s`). Under a budget this is the load-or-recompute rule's
        own model with nothing loaded, asked once per distinct ``(start, end)``."""
        if step_tokens <= 0:
            return self.prefill_s(start, end)
        s, e = np.broadcast_arrays(np.asarray(start, dtype=np.int64),
                                   np.asarray(end, dtype=np.int64))
        if s.size == 0:
            return np.zeros(s.shape, dtype=np.float64)
        pairs, inv = np.unique(np.stack([s.ravel(), e.ravel()], axis=1), axis=0,
                               return_inverse=True)
        costs = self.costs([])
        each = np.array([rule_ttft_s(costs, (0,), int(a), int(a), int(b), step_tokens)
                         for a, b in pairs], dtype=np.float64)
        return each[inv.reshape(-1)].reshape(s.shape)

    def ttft_s(self, num_tokens: Any, hits: dict[str, Any], *, policy: bool = True,
               step_tokens: int = 0) -> Any:
        """Predicted TTFT per request: ``hits`` maps a tier to hit tokens per request. With
        ``policy`` (lmc's default, ``load_policy: auto``) each request loads only the part
        of its hit the load-or-recompute rule chooses (see the module doc); without, all.
        ``step_tokens``: the engine's per-step token budget (chunked prefill; 0: none)."""
        n = np.asarray(num_tokens, dtype=np.float64)
        loaded = np.zeros_like(n)
        load = np.zeros_like(n)
        for tier, tok in hits.items():
            tok = np.asarray(tok, dtype=np.float64)
            loaded += tok
            load += self.tier(tier).seconds(tok * self.kv_bytes_per_token,
                                            np.ceil(tok / self.chunk_size))
        full = self.compute_s(loaded, n, step_tokens) + load
        if not policy or not hits or not np.any(loaded > 0):
            return full
        out = np.array(full, dtype=np.float64, copy=True)
        for i, split in self._splits(n, hits, step_tokens):
            if split.end < split.hit_end:  # the whole hit keeps its exact (per-chunk) cost
                out[i] = split.ttft_s
        return out

    def loaded_tokens(self, num_tokens: Any, hits: dict[str, Any], *,
                      step_tokens: int = 0) -> Any:
        """Per request, the hit tokens the rule loads (the rest of the hit is recomputed
        by choice): what lmc's connectors report as the hit for the same speeds."""
        n = np.asarray(num_tokens, dtype=np.float64)
        out = np.zeros(n.shape, dtype=np.int64)
        for i, split in self._splits(n, hits, step_tokens):
            out[i] = split.end
        return out

    def _splits(self, n: np.ndarray, hits: dict[str, Any], step_tokens: int
                ) -> Iterator[tuple[int, Split]]:
        """``(index, the rule's split)`` for every request with a hit, its hit's chunks in
        ``hits``' tier order (module doc)."""
        names = list(hits)
        if not names:
            return
        costs = self.costs(names)
        cols = [np.broadcast_to(np.asarray(hits[t], dtype=np.int64), n.shape) for t in names]
        cs = self.chunk_size
        for i in np.flatnonzero(sum(cols) > 0):
            counts = [int(c[i]) for c in cols]
            sources = b"".join(bytes([t + 1]) * -(-k // cs) for t, k in enumerate(counts) if k)
            yield int(i), choose_split(costs, sources, cs, 0, sum(counts), int(n[i]),
                                       step_tokens=step_tokens)

    def costs(self, tiers: list[str]) -> Costs:
        """The rule's view of this profile for hits from ``tiers`` (their order along a
        prompt): index 0 is a zero-cost copy, each tier then charges its whole measured
        cost per token (bytes and per-chunk) before the compute (``num_layers = 1``)."""
        bpt = float(self.kv_bytes_per_token)
        rates = [TierRate("copy", 1e30)]
        for name in tiers:
            t = self.tier(name)
            per_token = bpt / t.bytes_per_s + t.per_chunk_s / self.chunk_size
            rates.append(TierRate(name, bpt / per_token if per_token > 0 else 1e30,
                                  overlaps=False))
        c0, c1, c2 = self.fit
        return Costs(tuple(rates), PrefillRate(c0, c1, c2), bpt, 1)

    def tier(self, name: str) -> TierCost:
        cost = self.tiers.get(name)
        if cost is None:
            raise ValueError(f"the calibration profile has no load cost for the {name} tier "
                             f"(it has {', '.join(self.tiers) or 'none'}); run lmc plan "
                             f"--calibrate{'' if name in ('L1', 'disk') else ' --remote-url URL'} again")
        return cost

    def fit_error(self) -> float:
        """Largest relative error of the fit on the measured points."""
        pts = np.asarray(self.prefill_points, dtype=np.float64)
        pred = self.prefill_s(0, pts[:, 0])
        return float(np.max(np.abs(pred - pts[:, 1]) / pts[:, 1]))

    # ------------------------------------------------------------------ storage
    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = PROFILE_VERSION
        d["tiers"] = {k: asdict(v) for k, v in self.tiers.items()}
        return d

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> Profile:
        path = Path(path) if path is not None else default_profile_path()
        if not path.is_file():
            raise MissingProfile(
                f"no calibration profile at {path}: make one with `lmc plan --calibrate` "
                f"(add --model DIR to measure your checkpoint, --profile PATH to store it "
                f"elsewhere)")
        try:
            d = parse_json(read_text(path, "calibration profile", 1 << 20), str(path),
                           document=True)
            if not isinstance(d, dict):
                raise ValueError(f"expected a JSON object, got {type(d).__name__}")
            if d.get("version") != PROFILE_VERSION:
                raise ValueError(f"version {d.get('version')!r}, expected {PROFILE_VERSION}")
            tiers = {k: TierCost(float(v["bytes_per_s"]), float(v.get("per_chunk_s", 0.0)))
                     for k, v in d["tiers"].items()}
            prof = cls(model=str(d["model"]), kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                       chunk_size=int(d["chunk_size"]),
                       prefill_points=[(int(a), float(b)) for a, b in d["prefill_points"]],
                       tiers=tiers, fit=tuple(float(x) for x in d["fit"]),  # type: ignore[arg-type]
                       created=str(d.get("created", "")), host=str(d.get("host", "")),
                       notes=dict(d.get("notes", {})))
            _check_profile(prof)
            return prof
        except InputError as e:
            raise InputError(f"calibration profile {e}; make it again with `lmc plan "
                             f"--calibrate`") from None
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError,
                np.linalg.LinAlgError) as e:
            raise ValueError(f"calibration profile {path} is not readable ({e}); make it "
                             f"again with `lmc plan --calibrate`") from None


def _check_profile(prof: Profile) -> None:
    """Refuse values a hand-edited profile may hold that would predict nonsense (a zero
    bandwidth divides by zero, a huge chunk size overflows the simulation's arrays)."""
    if not 1 <= prof.kv_bytes_per_token <= 1 << 30:
        raise ValueError(f"kv_bytes_per_token: expected [1, 2**30], got {prof.kv_bytes_per_token}")
    if not 1 <= prof.chunk_size <= 1 << 20:
        raise ValueError(f"chunk_size: expected [1, 2**20], got {prof.chunk_size}")
    for name, t in prof.tiers.items():
        if not (0 < t.bytes_per_s < math.inf and 0 <= t.per_chunk_s < math.inf):
            raise ValueError(f"tiers.{name}: expected bytes_per_s > 0 and per_chunk_s >= 0, "
                             f"both finite")
    if not all(0 <= x < math.inf for x in prof.fit):
        raise ValueError(f"fit: expected finite coefficients >= 0, got {prof.fit}")


def fit_prefill(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least-squares ``c0 + c1*L + c2*L**2`` with no negative coefficient (a negative one
    would predict negative cost somewhere): terms that come out negative are dropped and the
    rest refitted."""
    if len(points) < 2:
        raise ValueError(f"the prefill fit needs at least 2 measured lengths, got {len(points)}")
    pts = np.asarray(points, dtype=np.float64)
    L, t = pts[:, 0], pts[:, 1]
    cols = {0: np.ones_like(L), 1: L, 2: L * L}
    keep = [0, 1, 2] if len(points) >= 3 else [0, 1]
    while True:
        a = np.stack([cols[k] for k in keep], axis=1)
        coef, *_ = np.linalg.lstsq(a, t, rcond=None)
        neg = [k for k, c in zip(keep, coef) if c < 0]
        if not neg or len(keep) == 1:
            break
        keep = [k for k in keep if k not in neg]
    out = [0.0, 0.0, 0.0]
    for k, c in zip(keep, coef):
        out[k] = max(0.0, float(c))
    return out[0], out[1], out[2]


def stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
