"""``lmc plan --calibrate``: measure what the cost model needs, on this machine, through lmc.

Every figure is a TTFT the reference engine reports for one request at a time, with lmc's
connector attached (layer-wise loads, chunks stored as the prompt is computed, write-behind
queues drained between requests, as the planner replays a trace): the planner predicts the
TTFT of requests served *with* lmc, and a miss with lmc is dearer than the engine alone (it
looks the prompt up, gathers every new chunk out of the KV cache into L1 and queues it for
the tiers below). Here, for the 4-layer hidden-256 model of ``bench_plan.py --ttft``, a miss
took 25.3 ms with lmc against 18.4 ms alone at 128 tokens and 162.5 against 144.6 ms at 1024;
a profile of the engine alone predicted 0.82-0.84 of a replay's measured mean TTFT.

* **Prefill**: fresh random prompts (every one a miss) at a few lengths, ``max_tokens=1``,
  after one unmeasured request at the longest (a process's first long prefill also pays page
  faults on fresh temporaries). Each round goes over every length and every tier (so a burst
  of load from elsewhere on the machine lands on all figures, not on one).

**The quiet rounds.** Load from elsewhere only ever adds time, so each figure is the median
of its quietest half of the rounds (:func:`quiet`), not of all of them; and when ``reps``
rounds give a profile that must be refused (below), more are measured, up to
:data:`MAX_EXTRA_ROUNDS` more, before it is. How noisy it was is said: each figure's slowest
round against its quiet value. On a 2-core machine running other test suites, the median of
three rounds was refused twice in a row (a fit missing its points by 73%).
* **Tier loads**: a fresh prompt of ``load_tokens + 1`` tokens is sent twice: the first time
  it is a miss that stores its chunks; the second loads ``load_tokens`` from the tier (for
  the disk and remote tiers L1 is emptied first, so the chunks come from there and are
  promoted) and computes the last token. The tier's cost is that hit's median TTFT minus the
  fitted prefill of that last token: what the engine pays for the load through the connector,
  after layer-wise loading hid what it could behind compute (not ``CacheEngine.retrieve``'s
  bare copy time; a fully hidden load is stored as a bandwidth of 1 PB/s). The disk tier is
  measured on its own engine (L1 over the disk), the remote one likewise: any remote URL
  (``redis://``, ``lmc://``, ``mooncake://``...). Its hits are counted under the tier's own
  name (``tokens_from_redis``, ``tokens_from_mooncake``), and its cost is saved under that
  name, which a ``tiers:`` chain's simulation looks up, and as ``remote``, which the fixed
  grid's remote tier looks up.

**What is refused** (:func:`refusals`; the CLI then keeps the previous profile and says why):
a prefill fit whose worst error on its own points exceeds ``MAX_FIT_ERROR`` (the planner
promises mean TTFT within 20%, which a fit that misses its own measurements by more cannot
keep), a fit that does not grow with the prompt's length, and a tier hit faster than
``1 - LOAD_SLACK`` of the fitted time of computing its one last token (a hit computes that
token, so such a figure says the fit's per-request cost is wrong, not that the load was
free; a burst of load from elsewhere on the machine during the short prompts does it: once
measured, 3.3 s at 256 tokens and 4.6 s at 2048, a fit of 3.69 s per request, and hits of
0.29 s, i.e. "load -3396 ms"). A load within that slack is hidden behind compute, as above.

The model is ``--model DIR`` (a Llama-family checkpoint the reference engine loads) or a small
random-weight checkpoint made on first use, which is right for trying the planner and wrong
for sizing a deployment: the profile records which model it measured.
"""

from __future__ import annotations

import random
import shutil
import socket
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lmc import units
from lmc.planner.costmodel import Profile, TierCost, stamp

BLOCK = 16
HIDDEN_LOAD_BYTES_PER_S = 1e15  # a load layer-wise loading hid entirely behind compute
MAX_EXTRA_ROUNDS = 6  # rounds measured past ``reps`` while the profile must be refused
MAX_FIT_ERROR = 0.15  # worst relative error of the prefill fit on its measured points
LOAD_SLACK = 0.25  # a hit may undercut its last token's fitted compute by this share (noise)


class CalibrationRefused(ValueError):
    """The measurements make no physical sense (module doc): nothing is saved."""
SOURCE = {"L1": "cpu", "disk": "disk"}  # planner tier -> the worker's tokens_from_<tier>


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def quiet(samples: Sequence[float]) -> float:
    """A figure's value under load from elsewhere: the median of its quietest half."""
    s = sorted(samples)
    return statistics.median(s[:max(1, (len(s) + 1) // 2)])


def spread(samples: Sequence[float]) -> float:
    """How much slower a figure's slowest round was than its quiet value (0.5: +50%)."""
    q = quiet(samples)
    return max(samples) / q - 1 if q > 0 else 0.0


DEFAULT_MODEL = {"hidden": 512, "layers": 4, "heads": 8, "kv_heads": 4}
DEFAULT_KV_BYTES_PER_TOKEN = (DEFAULT_MODEL["layers"] * 2 * DEFAULT_MODEL["kv_heads"]
                              * DEFAULT_MODEL["hidden"] // DEFAULT_MODEL["heads"] * 4)
"""The default model's KV a token (fp32, K and V of every layer): 8 KiB."""


def default_model() -> Path:
    """The random-weight checkpoint calibration uses when no ``--model`` is given."""
    from lmc.reference.tiny import cached_checkpoint

    m = DEFAULT_MODEL
    return cached_checkpoint("plan-calibrate-h512-l4-kv4", hidden=m["hidden"],
                             layers=m["layers"], heads=m["heads"], kv_heads=m["kv_heads"],
                             max_position_embeddings=8192)


class LMCEngine:
    """The reference engine with lmc's connector, one request at a time."""

    def __init__(self, model: Path, config: Any, longest: int) -> None:
        from lmc.connectors.reference import LMCReferenceConnector
        from lmc.reference import LLM

        self.conn = LMCReferenceConnector(config, model_dir=model)
        self.llm = LLM(model, block_size=BLOCK, max_num_batched_tokens=longest + BLOCK,
                       max_num_seqs=1, max_model_len=longest + 2 * BLOCK,
                       kv_cache_memory=1 << 62,  # capped by max_model_len's blocks
                       kv_connector=self.conn)
        if self.llm.max_model_len < longest + 1:
            self.llm.close()
            raise ValueError(f"{model} allows {self.llm.max_model_len} tokens; calibrate with "
                             f"shorter --lengths / --load-tokens (longest asked: {longest})")
        self.vocab = int(self.llm.config.vocab_size)

    def request(self, prompt: list[int]) -> tuple[float, dict[str, int]]:
        """TTFT of one request and the tokens it loaded per source tier; the write-behind
        queues are drained after it (not counted)."""
        before = self.conn.stats()
        ttft = self.llm.generate([prompt], max_tokens=1)[0].ttft_s
        if ttft is None:
            raise RuntimeError("calibration: the request finished without a first token")
        if not self.conn.cache.flush(timeout=120):
            raise RuntimeError("calibration: lmc's tier writes did not finish in 120 s")
        after = self.conn.stats()
        loaded = {k[len("worker.tokens_from_"):]: after[k] - before.get(k, 0) for k in after
                  if k.startswith("worker.tokens_from_") and after[k] != before.get(k, 0)}
        return ttft, loaded

    def close(self) -> None:
        self.llm.close()


def kv_bytes_per_token(model: Path) -> int:
    """KV bytes per token of ``model`` in the reference engine (fp32, every layer, K and V)."""
    from lmc.reference.kv_cache import bytes_per_block
    from lmc.reference.model_config import ModelConfig

    return bytes_per_block(ModelConfig.from_file(model / "config.json"), 1, torch.float32)


def hybrid_bytes_per_token(model: Path, chunk_size: int, lengths: Sequence[int],
                           interval: int = 0) -> tuple[float, int, str] | None:
    """A hybrid sliding-window/full checkpoint's KV bytes stored per prompt token under
    lmc's rule (:mod:`lmc.hybrid.rules`: sliding layers kept only around each prompt's
    checkpoints), over prompts of ``lengths``; with every layer's bytes per token and the
    groups in words. ``None`` for a plain model."""
    from lmc.connectors.reference.connector import window_groups
    from lmc.hybrid.rules import HitRule, default_interval, kept_positions
    from lmc.reference.model_config import ModelConfig

    cfg = ModelConfig.from_file(model / "config.json")
    if not cfg.sliding_windows or not lengths:
        return None
    groups = window_groups([cfg.layer_window(i) for i in range(cfg.num_hidden_layers)])
    rule = HitRule(groups, chunk_size, interval or default_interval(chunk_size, groups))
    per_layer = kv_bytes_per_token(model) // cfg.num_hidden_layers
    total = sum(lengths)
    stored = sum(g.num_layers * per_layer * sum(kept_positions(rule, g, n) for n in lengths)
                 for g in groups)
    words = ", ".join(g.describe() for g in groups)
    return stored / total, per_layer * cfg.num_hidden_layers, words


class Calibrator:
    """The engines a calibration measures (one per tier: L1 alone, L1 over a disk tier, L1
    over the remote tier) and the samples taken so far. :meth:`round` takes one sample of
    every figure; :meth:`profile` turns the medians into a :class:`Profile`. Rounds can be
    interleaved with other work (``lmc.planner.validate`` puts one before and after each
    pass of a replay, so both see the same load from elsewhere on the machine)."""

    def __init__(self, model: Path, *, lengths: Sequence[int], load_tokens: int,
                 chunk_size: int = 256, disk_dir: str | None = None,
                 remote_url: str | None = None, seed: int = 0) -> None:
        from lmc.config import CacheConfig

        if not lengths or min(lengths) < 1:
            raise ValueError(f"--lengths must be positive token counts, got {list(lengths)}")
        if load_tokens <= 0 or load_tokens % chunk_size:
            raise ValueError(f"--load-tokens must be a positive multiple of the chunk size "
                             f"{chunk_size}, got {load_tokens}")
        self.model, self.lengths, self.load_tokens = model, sorted(lengths), load_tokens
        self.chunk_size = chunk_size
        self.bpt = kv_bytes_per_token(model)
        self.rng = random.Random(seed)
        self.prefill: dict[int, list[float]] = {n: [] for n in self.lengths}
        self.hits: dict[str, list[float]] = {}
        # per tier of the last profile(): (hit's median TTFT, fitted compute of its last token)
        self.hit_vs_compute: dict[str, tuple[float, float]] = {}
        longest = max(max(lengths), load_tokens + 1)
        # L1 holds the two longest prompts (a hit's chunks stay until it is sent again)
        # tier costs are measured on whole hits: the load policy must not cut them short
        l1: dict[str, Any] = {"chunk_size": chunk_size, "local_cpu_prefault": "off",
              "load_policy": "load_all",
              "local_cpu_size": max(64 << 20, 4 * self.bpt * longest)}
        self._tmp = tempfile.mkdtemp(prefix="lmc-plan-disk-", dir=disk_dir)
        configs = {"L1": CacheConfig(**l1),
                   "disk": CacheConfig(**l1, local_disk=self._tmp, local_disk_size=(
                       8 * (load_tokens + chunk_size) * self.bpt + (64 << 20)))}
        if remote_url:
            configs["remote"] = CacheConfig(**l1, remote_url=remote_url)
        self.engines: dict[str, LMCEngine] = {}
        self.sources = dict(SOURCE)
        try:
            for name, cfg in configs.items():
                self.engines[name] = LMCEngine(model, cfg, longest)
                self.hits[name] = []
            if "remote" in self.engines:  # counted by its backend's name: redis, mooncake...
                self.sources["remote"] = self.engines["remote"].conn.cache.tier_names[-1]
            for eng in self.engines.values():  # a first long prefill pays page faults
                eng.request(self._prompt(eng, longest))
        except BaseException:
            self.close()
            raise

    def _prompt(self, eng: LMCEngine, n: int) -> list[int]:
        return [self.rng.randrange(2, eng.vocab) for _ in range(n)]

    def round(self) -> None:
        """One fresh (all-miss) prompt per length, then one hit per tier (module doc)."""
        eng = self.engines["L1"]
        for n in self.lengths:
            t, loaded = eng.request(self._prompt(eng, n))
            if any(loaded.values()):
                raise RuntimeError(f"calibration: a fresh prompt hit the cache ({loaded})")
            self.prefill[n].append(t)
        for name, eng in self.engines.items():
            prompt = self._prompt(eng, self.load_tokens + 1)  # the last token is computed
            eng.request(prompt)
            if name != "L1":
                eng.conn.cache.storage.l1.clear()  # type: ignore[attr-defined]  # the CPU tier has clear(); MemoryTier does not list it
            t, loaded = eng.request(prompt)
            if loaded != {self.sources[name]: self.load_tokens}:
                raise RuntimeError(f"calibration: the {name} tier's hit loaded {loaded}, "
                                   f"expected {self.load_tokens} tokens from it")
            self.hits[name].append(t)

    @property
    def rounds(self) -> int:
        return len(self.prefill[self.lengths[0]])

    def profile(self, say: bool = True) -> Profile:
        """The quiet values so far (:func:`quiet`) as a profile: the prefill fit, then each
        tier's load as its hit's quiet TTFT minus the fitted prefill of the one computed
        token; ``say``: log the figures and how noisy they were."""
        reps = self.rounds
        if not reps:
            raise RuntimeError("calibration: no round was measured")
        points = [(n, quiet(ts)) for n, ts in self.prefill.items()]
        noise = max(spread(ts) for ts in [*self.prefill.values(), *self.hits.values()])
        prof = Profile(model=str(self.model), kv_bytes_per_token=self.bpt,
                       chunk_size=self.chunk_size, prefill_points=points, tiers={},
                       created=stamp(), host=socket.gethostname(),
                       notes={"torch_threads": torch.get_num_threads(), "reps": reps,
                              "load_tokens": self.load_tokens, "noise": round(noise, 3),
                              "measured": "TTFT of the reference engine with lmc's connector"})
        of = f"the quieter half of {reps} rounds" if reps > 1 else "1 round"
        lines = [f"prefill with lmc: {n} tokens {units.seconds(t)} ({of}; slowest round "
                 f"+{spread(self.prefill[n]):.0%})" for n, t in points]
        n = self.load_tokens
        compute = float(prof.prefill_s(n, n + 1))
        nbytes = n * self.bpt
        for name, ts in self.hits.items():
            hit = quiet(ts)
            self.hit_vs_compute[name] = (hit, compute)
            load = hit - compute
            prof.tiers[name] = TierCost(
                bytes_per_s=nbytes / load if load > 0 else HIDDEN_LOAD_BYTES_PER_S)
            label = name
            if name == "remote":  # a tiers: chain names it by its backend (module doc)
                prof.tiers[self.sources[name]] = prof.tiers[name]
                label = f"remote ({self.sources[name]})"
            how = (f"load {units.seconds(load)} = {units.size(nbytes / load)}/s" if load > 0
                   else "the load was hidden behind compute")
            lines.append(f"{label}: a hit of {n} tokens ({units.size(nbytes)}) took "
                         f"{units.seconds(hit)} ({of}; slowest round +{spread(ts):.0%}), its "
                         f"last token {units.seconds(compute)}: {how}")
        lines.append(f"prefill fit: {units.seconds(prof.fit[0])} a request, "
                     f"{prof.fit[1] * 1e6:.2f} us/token, {prof.fit[2] * 1e9:.4f} ns/token^2; "
                     f"worst error on the points {prof.fit_error() * 100:.1f}%")
        lines.append(f"noise: a figure's slowest round was up to {noise:.0%} slower than its "
                     f"quiet value" + (" (a busy machine: the quiet rounds were kept)"
                                       if noise > 0.25 else ""))
        if say:
            for line in lines:
                log(line)
        return prof

    def refusals(self, prof: Profile) -> list[str]:
        """Why ``prof`` (this calibrator's last :meth:`profile`) must not be saved; empty
        when it is physically plausible (module doc)."""
        return refusals(prof, self.hit_vs_compute)

    def close(self) -> None:
        for eng in self.engines.values():
            eng.close()
        self.engines = {}
        shutil.rmtree(self._tmp, ignore_errors=True)


def refusals(prof: Profile, hit_vs_compute: dict[str, tuple[float, float]] | None = None
             ) -> list[str]:
    """Reasons a profile is outside physical bounds or fits its points badly, each saying
    what was measured; ``hit_vs_compute`` (tier -> (hit TTFT, fitted compute of its last
    token), seconds) adds the tier loads' check. Empty: plausible."""
    out = []
    err = prof.fit_error()
    pts = ", ".join(f"{n} tokens {units.seconds(t)}" for n, t in prof.prefill_points)
    if not err <= MAX_FIT_ERROR:  # NaN too
        out.append(f"the prefill fit misses its own measurements by up to {err:.1%} (at most "
                   f"{MAX_FIT_ERROR:.0%} is usable; measured {pts})")
    lengths = [n for n, _ in prof.prefill_points]
    lo, hi = min(lengths), max(lengths)
    t_lo, t_hi = (float(prof.prefill_s(0, n)) for n in (lo, hi))
    if not t_hi - t_lo > 0.01 * t_hi:  # flat within rounding, or NaN
        out.append(f"the prefill fit does not grow with prompt length (measured {pts}): "
                   "longer prompts cannot be cheaper")
    for name, (hit, compute) in (hit_vs_compute or {}).items():
        if hit < (1 - LOAD_SLACK) * compute:
            out.append(f"the {name} tier's hit took {units.seconds(hit)}, "
                       f"{units.seconds(compute - hit)} less than the "
                       f"{units.seconds(compute)} the fit predicts for computing its one last "
                       f"token alone: the fit's per-request cost {units.seconds(prof.fit[0])} "
                       f"is wrong")
    return out


def calibrate(model_dir: str | Path | None = None, *, lengths: Sequence[int] = (256, 1024, 2048,
              4096), reps: int = 3, load_tokens: int = 4096, chunk_size: int = 256,
              disk_dir: str | None = None, remote_url: str | None = None,
              threads: int = 0) -> Profile:
    """Measure and return a :class:`Profile` (the caller saves it); :class:`CalibrationRefused`
    when the measurements are outside physical bounds (:func:`refusals`)."""
    if reps < 1:
        raise ValueError(f"--reps must be at least 1, got {reps}")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _measure(model_dir, lengths, reps, load_tokens, chunk_size, disk_dir, remote_url)
    finally:
        torch.set_num_threads(before)  # a caller's own engines keep theirs


def _measure(model_dir: str | Path | None, lengths: Sequence[int], reps: int, load_tokens: int,
             chunk_size: int, disk_dir: str | None, remote_url: str | None) -> Profile:
    path = Path(model_dir) if model_dir else default_model()
    log(f"calibrating with {path} ({torch.get_num_threads()} torch threads), lmc attached")
    cal = Calibrator(path, lengths=lengths, load_tokens=load_tokens, chunk_size=chunk_size,
                     disk_dir=disk_dir, remote_url=remote_url)
    try:
        for _ in range(reps):
            cal.round()
        while True:  # more rounds while the quiet values do not make sense yet
            prof = cal.profile(say=False)
            why = cal.refusals(prof)
            if not why or cal.rounds >= reps + MAX_EXTRA_ROUNDS:
                break
            log(f"calibration: after {cal.rounds} rounds {why[0]}; measuring another round "
                f"(load from elsewhere only adds time: the quiet rounds are kept)")
            cal.round()
        cal.profile()
        if why:
            raise CalibrationRefused("; ".join(why))
        return prof
    finally:
        cal.close()
