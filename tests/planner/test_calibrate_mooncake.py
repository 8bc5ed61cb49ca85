"""The planner knows a ``mooncake://`` tier: ``lmc plan --calibrate`` measures its load cost
through a real ``mooncake_master`` (hits counted as ``tokens_from_mooncake``), the profile
carries it under the tier's name, and a ``tiers:`` chain with a Mooncake entry is simulated
as a remote store of its segment and priced with that cost."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from lmc.cli import build_parser
from lmc.config import CacheConfig
from lmc.planner.calibrate import Calibrator
from lmc.planner.keys import key_trace
from lmc.planner.sim import chain_point, simulate
from lmc.planner.tiers import SimTier, chain_tiers
from lmc.reference import make_tiny_checkpoint
from lmc.workloads.trace import TraceRequest
from tests.storage.backends.mooncake.mooncake_cluster import MooncakeMaster, require_mooncake

pytestmark = pytest.mark.integration


@pytest.fixture
def master(tmp_path):
    require_mooncake()
    m = MooncakeMaster(tmp_path / "mc").start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", hidden=64, layers=2)


def test_calibration_measures_a_mooncake_tier_and_a_chain_is_priced_with_it(tiny_dir, master):
    cal = Calibrator(tiny_dir, lengths=[32, 64, 128], load_tokens=128, chunk_size=64,
                     remote_url=master.url)
    try:
        assert cal.sources["remote"] == "mooncake"
        cal.round()  # raises unless the remote hit loaded all 128 tokens from mooncake
        prof = cal.profile()
    finally:
        cal.close()
    assert len(cal.hits["remote"]) == 1
    assert prof.tiers["mooncake"] == prof.tiers["remote"]
    assert prof.tiers["mooncake"].bytes_per_s > 0

    # a chain with the same entry: simulated as a remote store (its segment up to the
    # master's 90 % watermark when no size is given), its hits priced by the profile
    cfg = CacheConfig(local_cpu_size="64KiB", chunk_size=64,
                      tiers=["memory", {"backend": master.url, "segment": "64MiB"}])
    assert chain_tiers(cfg) == [SimTier("mooncake", "memory", int(0.9 * (64 << 20)))]
    assert chain_tiers(cfg, {"mooncake": "1GiB"})[0].capacity == 1 << 30
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 30000) for _ in range(256)] for _ in range(6)]
    trace = key_trace([TraceRequest(float(i), f"r{i}", None, None, p, None, 1)
                       for i, p in enumerate(prompts + prompts)], chunk_size=64)
    r = simulate(trace, chain_point(cfg), bytes_per_token=prof.kv_bytes_per_token)
    assert list(r.hit_tokens) == ["L1", "mooncake"]
    assert r.hit_tokens["mooncake"] > 0, r.hit_tokens
    # every hit priced with the measured Mooncake load (the profile has no other name for it)
    hits = {t: np.asarray(r.per_request[t], dtype=np.float64) for t in r.hit_tokens}
    n = np.asarray([len(p) for p in prompts + prompts], dtype=np.float64)
    loaded = hits["L1"] + hits["mooncake"]
    want = (prof.prefill_s(loaded, n)
            + prof.tiers["L1"].seconds(hits["L1"] * prof.kv_bytes_per_token,
                                       np.ceil(hits["L1"] / 64))
            + prof.tiers["mooncake"].seconds(hits["mooncake"] * prof.kv_bytes_per_token,
                                             np.ceil(hits["mooncake"] / 64)))
    assert prof.ttft_s(n, hits, policy=False) == pytest.approx(want)


def test_the_remote_url_flag_takes_any_scheme_and_redis_is_its_old_name():
    p = build_parser("plan")
    for flag in ("--remote-url", "--redis"):
        args = p.parse_args(["plan", "--calibrate", flag, "mooncake://127.0.0.1:50051"])
        assert args.remote_url == "mooncake://127.0.0.1:50051"
