"""The planner against the engine: replay a trace on the reference engine with lmc and put
the measured hit rate and mean TTFT beside the planner's prediction for the same tiers.

Requests run one at a time, each followed by draining lmc's write-behind queues (the
planner's model of the writer threads). Within a request (``step_tokens``) the simulation
drains them after each step; the engine's writer may fall behind under this machine's load
of the moment, so passes can differ by a dropped write, and the pass that loaded the most
is compared (draining inside the replay instead put its waits into the measured TTFT).
A warm-up request (a process's first prefill pays page faults and kernel set-up) is sent
first and is part of the trace both sides see, so the cache state stays identical; it is
left out of both figures. TTFT on a shared machine is noisy, so the trace is replayed
``passes`` times, each on a fresh engine, cache and disk directory, and each request's median TTFT is kept: a burst of load
from elsewhere then moves a request's figure only if it lands on most passes. The
calibration's rounds are taken between the passes, so the profile and the replay are
measured under the same conditions (on a shared machine the load from elsewhere drifts by
tens of percent between minutes).

``step_tokens`` (``lmc plan --step-tokens``) is the replay engine's per-step token budget
(its ``max_num_batched_tokens``, which its scheduler hands lmc's connector through
``KVConnector.set_step_budget``), so a validation of a chunked-prefill prediction measures
an engine that chunks; the calibration rounds stay unchunked (the profile's fit is one
step's cost, and the prediction applies the budget).
"""

from __future__ import annotations

import logging
import random
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmc.planner.calibrate import Calibrator
from lmc.planner.costmodel import Profile
from lmc.planner.keys import key_trace
from lmc.planner.report import as_numpy
from lmc.planner.sim import GridPoint, simulate
from lmc.workloads.trace import TraceRequest

log = logging.getLogger(__name__)
TIER_COUNTERS = {"L1": "cpu", "disk": "disk", "remote": "remote"}
TierFactory = Callable[[Any, Any], Any]  # (CacheConfig, pool) -> StorageBackend


@dataclass
class Comparison:
    requests: int
    prompt_tokens: int
    hit_measured: float
    hit_predicted: float
    ttft_measured_s: float  # mean over requests of each request's median over passes
    ttft_predicted_s: float
    hits_measured: dict[str, int]
    hits_predicted: dict[str, int]

    @property
    def ttft_ratio(self) -> float:
        return self.ttft_predicted_s / self.ttft_measured_s

    def __str__(self) -> str:
        return (f"hit rate: engine {self.hit_measured:.4f}, planner {self.hit_predicted:.4f} "
                f"({self.hits_measured} vs {self.hits_predicted} of {self.prompt_tokens} "
                f"tokens); mean TTFT: engine {self.ttft_measured_s * 1e3:.1f} ms, planner "
                f"{self.ttft_predicted_s * 1e3:.1f} ms (ratio {self.ttft_ratio:.2f})")


def mixed_trace(n: int = 60, seed: int = 7) -> list[TraceRequest]:
    """Shared system prompts, growing conversations and one-off prompts, interleaved: a
    trace that exercises L1, eviction and the disk tier at small sizes (the planner's
    validation test and ``bench_plan.py --ttft`` replay it)."""
    rng = random.Random(seed)

    def toks(k: int) -> list[int]:
        return [rng.randrange(2, 2000) for _ in range(k)]

    systems = [toks(300), toks(520)]
    convs: dict[str, list[int]] = {}
    out = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.5:
            sid = f"c{rng.randrange(4)}"
            hist = convs.get(sid) or systems[int(sid[1:]) % 2][:]
            prompt = hist + toks(rng.randrange(40, 200))
            if len(prompt) > 1000:
                prompt = systems[0] + toks(100)
            convs[sid] = prompt + toks(30)
            out.append(TraceRequest(float(i), f"r{i}", sid, None, prompt, None, 1))
        elif kind < 0.85:
            g = rng.randrange(2)
            out.append(TraceRequest(float(i), f"r{i}", None, f"g{g}",
                                    systems[g] + toks(rng.randrange(10, 300)), None, 1))
        else:
            out.append(TraceRequest(float(i), f"r{i}", None, None, toks(rng.randrange(100, 700)),
                                    None, 1))
    return out


def warmup_request(length: int, vocab: int, seed: int = 99) -> TraceRequest:
    rng = random.Random(seed)
    return TraceRequest(0.0, "warm-up", None, None,
                        [rng.randrange(2, vocab) for _ in range(length)], None, 1)


def replay_pass(model: Path, reqs: Sequence[TraceRequest], point: GridPoint, *,
                disk_tier: Callable[[str, int], TierFactory] | None = None,
                max_model_len: int = 2048, step_tokens: int = 0
                ) -> tuple[list[float], list[dict[str, int]]]:
    """One pass on a fresh engine and cache: each request's TTFT and loaded tokens per tier.
    ``point``'s disk size, if any, is a disk tier in a fresh directory
    (``disk_tier(path, capacity)`` builds it; default: lmc's own from the config).
    ``step_tokens``: the engine's per-step budget (0: ``max_model_len``, no chunking)."""
    from lmc.config import CacheConfig
    from lmc.connectors.reference import LMCReferenceConnector
    from lmc.reference import LLM

    if point.remote:
        raise ValueError("replay: a remote tier is not supported here (give remote=0)")
    ttfts: list[float] = []
    hits: list[dict[str, int]] = []
    with tempfile.TemporaryDirectory(prefix="lmc-plan-replay-") as d:
        # the planner predicts which tier holds each chunk: every hit is loaded, none cut by
        # the load policy (whose choice depends on this machine's speeds of the moment)
        kw: dict[str, Any] = {"local_cpu_size": point.l1, "write_policy": point.policy,
                              "local_cpu_prefault": "off", "load_policy": "load_all"}
        tiers = None
        if point.disk and disk_tier is not None:
            tiers = [disk_tier(d, point.disk)]
        elif point.disk:
            kw.update(local_disk=d, local_disk_size=point.disk)
        conn = LMCReferenceConnector(CacheConfig(**kw), model_dir=model, tiers=tiers)
        # the engine's scheduler passes its budget to the connector (set_step_budget)
        llm = LLM(model, block_size=16, max_num_batched_tokens=step_tokens or max_model_len,
                  max_num_seqs=1, max_model_len=max_model_len, kv_connector=conn)
        try:
            for r in reqs:
                before = conn.stats()
                if r.prompt_tokens is None:
                    raise ValueError(f"replay: request {r.request_id} has text, not token ids "
                                     "(tokenize the trace first)")
                ttft = llm.generate([r.prompt_tokens], max_tokens=1)[0].ttft_s
                if ttft is None:
                    raise RuntimeError(f"replay: request {r.request_id} gave no first token")
                ttfts.append(ttft)
                if not conn.cache.flush(timeout=60):
                    raise RuntimeError("replay: lmc's tier writes did not finish in 60 s")
                after = conn.stats()
                hits.append({t: after.get(f"worker.tokens_from_{c}", 0)
                             - before.get(f"worker.tokens_from_{c}", 0)
                             for t, c in TIER_COUNTERS.items()})
        finally:
            llm.close()
    return ttfts, hits


def validate(model: Path, reqs: Sequence[TraceRequest], points: Sequence[GridPoint], *,
             passes: int = 3, lengths: Sequence[int] = (128, 256, 512, 1024),
             load_tokens: int = 768, disk_tier: Callable[[str, int], TierFactory] | None = None,
             max_model_len: int = 2048, step_tokens: int = 0
             ) -> tuple[Profile, list[Comparison]]:
    """Calibrate and replay, interleaved: a calibration round, then one pass of the trace
    per point, then another round, ``passes`` times. Each point's TTFTs are the per-request
    medians over the passes; its hits are the pass's that loaded the most (passes differ
    only where a writer fell behind under load: see the comment at the choice).
    ``step_tokens``: the replay engine's per-step budget, predicted for alike (module doc)."""
    cal = Calibrator(model, lengths=lengths, load_tokens=load_tokens)
    runs: list[list[tuple[list[float], list[dict[str, int]]]]] = [[] for _ in points]
    try:
        cal.round()
        for _ in range(passes):
            for i, point in enumerate(points):
                runs[i].append(replay_pass(model, reqs, point, disk_tier=disk_tier,
                                           max_model_len=max_model_len,
                                           step_tokens=step_tokens))
            cal.round()
        prof = cal.profile()
    finally:
        cal.close()
    out = []
    for point, rs in zip(points, runs):
        # the pass that loaded the most: one whose writer fell behind under this machine's
        # load of the moment dropped a write the model's writer (draining between steps)
        # makes (a loaded CI host once did, in one pass of three)
        hits = max((h for _, h in rs), key=lambda h: sum(sum(d.values()) for d in h))
        if any(h != hits for _, h in rs):
            log.info("replay at %s: the passes loaded different tokens; comparing the one "
                     "that loaded the most", point)
        ttfts = [statistics.median(t) for t in zip(*(t for t, _ in rs))]
        out.append(compare(prof, reqs, point, ttfts, hits, step_tokens=step_tokens))
    return prof, out


def compare(profile: Profile, reqs: Sequence[TraceRequest], point: GridPoint,
            ttfts: Sequence[float], hits: Sequence[dict[str, int]], skip: int = 1, *,
            step_tokens: int = 0) -> Comparison:
    """The planner's prediction for ``reqs`` at ``point`` (an engine computing at most
    ``step_tokens`` positions a step) beside a :func:`replay`'s figures, over the requests
    after the first ``skip`` (the warm-up)."""
    kt = key_trace(list(reqs))
    sim = simulate(kt, point, bytes_per_token=profile.kv_bytes_per_token,
                   step_tokens=step_tokens)
    n = as_numpy(kt.num_tokens)
    pred = profile.ttft_s(n, {t: as_numpy(a) for t, a in sim.per_request.items()},
                          step_tokens=step_tokens)
    total = int(n[skip:].sum())
    got = {t: sum(h.get(t, 0) for h in hits[skip:]) for t in sim.per_request}
    want = {t: int(as_numpy(a)[skip:].sum()) for t, a in sim.per_request.items()}
    return Comparison(len(reqs) - skip, total, sum(got.values()) / total,
                      sum(want.values()) / total, statistics.mean(ttfts[skip:]),
                      float(pred[skip:].mean()), got, want)
