"""``lmc plan`` under chunked prefill predicts what lmc decides: with the engine's per-step
token budget the planner's TTFT is the load-or-recompute rule's own figure, its compute is
the rule's model (each step paying the per-step cost), and the tokens it loads are what
:class:`LoadPolicy` answers for the same speeds and budget."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from lmc.connectors.core.load_policy import Costs, LoadPolicy, choose_split
from lmc.planner.costmodel import Profile, TierCost
from lmc.storage.lookup import LookupResult
from lmc.storage.speeds import PrefillRate, TierRate

BPT = 4096
CS = 256
FIT = (0.02, 1 / 20_000, 1e-10)  # 20 ms a step, 20k tokens/s, a little attention
N = 8192


def profile(disk_tokens_per_s: float, per_chunk_s: float = 0.0) -> Profile:
    pts = [(n, FIT[0] + FIT[1] * n + FIT[2] * n * n) for n in (256, 1024, 4096, 8192)]
    return Profile(model="t", kv_bytes_per_token=BPT, chunk_size=CS, prefill_points=pts,
                   tiers={"L1": TierCost(BPT * 400_000.0),
                          "disk": TierCost(BPT * disk_tokens_per_s, per_chunk_s)}, fit=FIT)


def sources(counts: list[int]) -> bytes:
    """The chunks of a hit, tier ``t`` of the planner's costs at index ``t + 1``, fastest
    tier first (as the planner lays them out)."""
    return b"".join(bytes([t + 1]) * -(-k // CS) for t, k in enumerate(counts) if k)


def test_ttft_under_a_step_budget_is_the_rules() -> None:
    """A disk tier slower than compute, a 512-token budget: every request's predicted TTFT
    is exactly ``choose_split(..., step_tokens=512)``'s, and the budget does change it."""
    prof = profile(6_000.0, 1e-5)
    budget = 512
    n = np.array([N, N, N, N, 5000, 700])
    hits = {"L1": np.array([0, 2048, 4096, 0, 1024, 0]),
            "disk": np.array([N - 1, 4096, 2048, 0, 3000, 0])}
    got = prof.ttft_s(n, hits, step_tokens=budget)
    costs = prof.costs(["L1", "disk"])
    cut = 0
    for i in range(len(n)):
        counts = [int(hits["L1"][i]), int(hits["disk"][i])]
        split = choose_split(costs, sources(counts), CS, 0, sum(counts), int(n[i]),
                             step_tokens=budget)
        if sum(counts) == 0:
            assert got[i] == split.load_none_s  # no hit: the rule's compute, exactly
        elif split.end < split.hit_end:
            cut += 1
            assert got[i] == split.ttft_s, i  # exactly the rule's figure
        else:  # the whole hit: its exact per-chunk load + the rule's compute of the rest
            assert got[i] == pytest.approx(split.ttft_s, rel=1e-9), i
    assert cut >= 3  # the slow disk's chunks are recomputed by choice
    unchunked = prof.ttft_s(n, hits)
    assert np.all(got > unchunked)  # every prompt here takes several 512-token steps
    # a budget past every prompt changes nothing
    assert prof.ttft_s(n, hits, step_tokens=1 << 20) == pytest.approx(unchunked, rel=1e-12)


def test_compute_is_the_rules_with_nothing_loaded() -> None:
    prof = profile(6_000.0)
    starts, ends = np.array([0, 0, 100, 4096, 0]), np.array([N, 512, 3000, N, 1])
    costs = prof.costs(["disk"])
    for budget in (1, 256, 512, 3000):
        got = prof.compute_s(starts, ends, budget)
        for s, e, g in zip(starts, ends, got):
            hit = int(s)  # the engine has [0, s): nothing of it to load
            want = choose_split(costs, b"", CS, hit, hit, int(e), step_tokens=budget)
            assert g == want.load_none_s
    # each step pays the per-step cost: 8192 tokens in 512-token steps is 16 steps
    assert float(prof.compute_s(0, N, 512)) == pytest.approx(
        float(prof.prefill_s(0, N)) + 15 * FIT[0])
    assert prof.compute_s(starts, ends, 0) == pytest.approx(prof.prefill_s(starts, ends))
    assert prof.compute_s(np.array([], dtype=np.int64), np.array([], dtype=np.int64),
                          512).shape == (0,)


def _policy_costs(prof: Profile, names: list[str]) -> Costs:
    """The speeds a live LoadPolicy would be given for the profile's figures, built here from
    the numbers (not by the planner): a zero-cost copy, each tier serial at its measured
    cost per token, the fitted compute, one layer (load, then compute)."""
    rates = [TierRate("copy", 1e30)]
    for name in names:
        t = prof.tiers[name]
        rates.append(TierRate(name, BPT / (BPT / t.bytes_per_s + t.per_chunk_s / CS),
                              overlaps=False))
    return Costs(tuple(rates), PrefillRate(*FIT), float(BPT), 1)


def fixed(costs: Costs) -> Callable[[], Costs]:
    """Deterministic rates: the speeds a LoadPolicy decides with never move."""
    return lambda: costs


def test_planner_loads_what_load_policy_decides() -> None:
    """For disk speeds around the compute's, budgets from none to past the prompt and hits
    of every mix, the planner's loaded tokens equal LoadPolicy's decision for the same
    speeds and budget -- and the budget moves that decision in some of them."""
    names = ["L1", "disk"]
    mixes = [(0, N - 1), (1024, N - 1025), (4096, 2048), (0, 3000), (2048, 0)]
    moved = 0
    for speed, per_chunk in itertools.product((2_000.0, 12_000.0, 18_000.0, 60_000.0),
                                              (0.0, 2e-4)):
        prof = profile(speed, per_chunk)
        costs = _policy_costs(prof, names)
        n = np.full(len(mixes), N)
        hits = {t: np.array([m[k] for m in mixes]) for k, t in enumerate(names)}
        per_budget = {}
        for budget in (0, 256, 512, 2048, 1 << 20):
            planned = prof.loaded_tokens(n, hits, step_tokens=budget)
            policy = LoadPolicy(fixed(costs), step_tokens=budget)
            decided = []
            for i, mix in enumerate(mixes):
                hit = sum(mix)
                found = LookupResult(hit, CS, ("copy", *names), sources(list(mix)))
                decided.append(policy.decide(f"r{i}", found, 0, hit, N))
            assert planned.tolist() == decided, (speed, per_chunk, budget)
            per_budget[budget] = decided
        moved += sum(per_budget[b] != per_budget[0] for b in (256, 512, 2048))
        assert per_budget[1 << 20] == per_budget[0]  # a budget past the prompt: no change
    assert moved >= 3, moved  # the budget matters, so the test can tell it was passed


def test_budget_turns_a_cut_into_a_whole_load() -> None:
    """Why it matters: a disk a little slower than compute is cut without a budget (its
    chunks past the near-tie band recomputed in one step) but loaded whole with a 512-token
    budget (each 512 tokens loaded save a 20 ms step)."""
    prof = profile(18_000.0)
    n, hits = [N], {"disk": [N - 1]}
    assert prof.loaded_tokens(n, hits)[0] < N // 2
    assert prof.loaded_tokens(n, hits, step_tokens=512)[0] == N - 1
    whole = prof.ttft_s(n, hits, step_tokens=512)[0]
    assert whole == pytest.approx(prof.ttft_s(n, hits, policy=False, step_tokens=512)[0])
    assert whole < prof.compute_s(0, N, 512) * 0.8
