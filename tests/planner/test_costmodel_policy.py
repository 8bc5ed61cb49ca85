"""``lmc plan`` predicts with the connectors' own load-or-recompute rule: a hit in a tier
slower than compute is predicted as recomputed (never worse than no cache), one in a fast
tier as loaded, and the rule is the connectors' function itself."""

from __future__ import annotations

import numpy as np
import pytest

import lmc.connectors.core.load_policy as load_policy
import lmc.planner.costmodel as costmodel
from lmc.planner.costmodel import Profile, TierCost

BPT = 4096
CS = 256


def profile(disk_bytes_per_s: float) -> Profile:
    pts = [(n, 0.002 + 2e-5 * n + 1e-9 * n * n) for n in (256, 1024, 4096, 8192)]
    return Profile(model="t", kv_bytes_per_token=BPT, chunk_size=CS, prefill_points=pts,
                   tiers={"L1": TierCost(8 << 30), "disk": TierCost(disk_bytes_per_s, 1e-5)})


def test_the_planner_calls_the_connectors_rule() -> None:
    assert costmodel.choose_split is load_policy.choose_split


def test_slow_tier_predicted_recomputed_fast_tier_loaded() -> None:
    n = np.array([8192, 8192, 8192])
    # all from disk / half L1 half disk / all L1
    hits = {"L1": np.array([0, 4096, 8191]), "disk": np.array([8191, 4095, 0])}
    slow = profile(20e6)  # 4,900 tokens/s against ~14,000 computed
    none = slow.prefill_s(0, n)
    chosen = slow.ttft_s(n, hits)
    all_ = slow.ttft_s(n, hits, policy=False)
    assert chosen[0] == pytest.approx(none[0])  # never worse than no cache
    assert all_[0] > 2 * none[0]
    # half in L1: that half is loaded, the disk half recomputed
    assert chosen[1] == pytest.approx(float(slow.ttft_s([8192], {"L1": [4096]})[0]))
    assert chosen[2] == pytest.approx(all_[2])  # L1 only: the whole hit, as before
    fast = profile(4 << 30)
    assert fast.ttft_s(n, hits) == pytest.approx(fast.ttft_s(n, hits, policy=False))


def test_costs_charge_the_profiles_per_token_cost() -> None:
    p = profile(100e6)
    c = p.costs(["L1", "disk"])
    assert c.num_layers == 1 and [t.name for t in c.tiers] == ["copy", "L1", "disk"]
    per_token = BPT / 100e6 + 1e-5 / CS
    assert BPT / c.tiers[2].bytes_per_s == pytest.approx(per_token)
