"""Wrapper tiers (:mod:`lmc.storage.wrappers`): the tier contract holds through them,
they compose in ``tiers:``, count what passes, pace it, and never hold a call past their
bound or past ``close()`` (docs/design.md, "The tier kit")."""

from __future__ import annotations

import itertools
import shutil
import threading
import time

import pytest
import torch

import tests.storage.backends.disk.test_contract_disk as disk_contract
from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.settings import ConfigError
from lmc.storage.backends.disk.backend import DiskBackend
from lmc.storage.chain import build_storage, check_chain
from lmc.storage.tier import Medium, create_backend
from lmc.storage.wrappers import CountingTier, RateLimitTier
from lmc.testing import (
    BasicContract,
    BatchContract,
    ConcurrencyContract,
    FailureContract,
    IntegrityContract,
    ModelContract,
    ReferenceContract,
    TierSpec,
)
from tests.kvutil import assert_bits_equal, random_bits

SHAPE = (2, 2, 16, 64)  # bf16: 8 KiB a chunk


def _disk_spec(tmp_path, wrapper: str, **kw) -> TierSpec:
    dirs = (tmp_path / f"disk{i}" for i in itertools.count())
    return TierSpec(wrapper, config=lambda: {"local_disk": str(next(dirs)),
                                             "local_disk_size": "512KiB"},
                    kwargs={"tier": "disk", **kw},
                    corrupt=lambda tier, key: disk_contract._flip_payload_byte(tier.inner, key),
                    kill=lambda tier: shutil.rmtree(tier.path),  # the device is gone
                    reopen=lambda tier: {"local_disk": tier.path})


class _Contract(BasicContract, BatchContract, ModelContract, ReferenceContract,
                ConcurrencyContract, IntegrityContract, FailureContract):
    """What the disk tier passes, through the wrapper."""


class TestCountingContract(_Contract):
    @pytest.fixture
    def tier_spec(self, tmp_path):
        return _disk_spec(tmp_path, "counting", log_calls=True)


class TestRateLimitContract(_Contract):
    @pytest.fixture
    def tier_spec(self, tmp_path):
        return _disk_spec(tmp_path, "rate_limit", bytes_per_second="4GiB")


# ------------------------------------------------------------------------- composition
def _chunks(sm, n, gen):
    objs = sm.allocate_many(SHAPE, torch.bfloat16, n, 16)
    for o in objs:
        o.tensor.copy_(random_bits(SHAPE, torch.bfloat16, gen))
    return objs


def test_wrappers_compose_in_the_chain_and_count_round_trips(tmp_path):
    cfg = CacheConfig(local_cpu_size="1MiB", tiers=[
        "memory", {"wrap": "rate_limit", "bytes_per_second": "1GiB",
                   "tier": {"wrap": "counting", "tier": {"backend": "disk",
                                                         "path": str(tmp_path)}}}])
    sm = build_storage(cfg, MemoryPool(1 << 20, pin_memory=False))
    keys = [bytes([9, i]) * 8 for i in range(4)]
    try:
        outer = sm.tiers[1]
        assert isinstance(outer, RateLimitTier) and isinstance(outer.inner, CountingTier)
        assert isinstance(outer.inner.inner, DiskBackend)
        # the wrapped tier's name and medium: stats, lookups and events name the disk
        assert (outer.name, outer.medium, sm.infos[1].medium) == (
            "disk", Medium.LOCAL_STORAGE, Medium.LOCAL_STORAGE)
        objs = _chunks(sm, 4, torch.Generator().manual_seed(2))
        want = [o.tensor.clone() for o in objs]
        sm.put(keys, objs)
        for o in objs:
            o.release()
        assert sm.flush(10)
        counts = outer.inner.counts
        assert (counts["put_keys"], counts["put_hits"]) == (4, 4)
        assert counts["put_bytes"] == 4 * 8192
        sm.clear_l1()
        before = counts["contains_calls"]
        assert sm.prefix_sources(keys) == [1] * 4
        assert counts["contains_calls"] == before + 1, "one round trip for a whole prompt"
        got, where = sm.fetch_prefix(keys)
        assert where == [1] * 4
        for g, w in zip(got, want):
            assert_bits_equal(g.tensor, w, "through two wrappers")
            g.release()
        assert counts["get_calls"] == 1 and counts["get_hits"] == 4
        assert counts["get_layers_calls"] == 0  # the rate limiter reads whole chunks
        st = outer.stats()
        assert st["wrapped_get_bytes"] == 4 * 8192 and "rate_limit_delayed_seconds" in st
    finally:
        sm.close()


def test_listeners_see_the_wrapped_disks_evictions(tmp_path):
    """``on_evicted`` set on a wrapper reaches the tier that evicts."""
    cfg = CacheConfig(local_cpu_size="1MiB", tiers=[
        "memory", {"wrap": "counting", "tier": {"backend": "disk", "path": str(tmp_path),
                                                "capacity": "32KiB"}}])
    sm = build_storage(cfg, MemoryPool(1 << 20, pin_memory=False))
    seen: list = []

    class L:
        observes_stores = False

        def on_removed(self, keys, tier, reason, objs=None):
            seen.append((tier.name, reason, len(keys)))

    try:
        sm.add_listener(L())  # type: ignore[arg-type]
        assert sm.tiers[1].inner.on_evicted is not None
        for i in range(3):
            objs = _chunks(sm, 2, torch.Generator().manual_seed(i))
            sm.put([bytes([i, j]) * 8 for j in range(2)], objs)
            for o in objs:
                o.release()
            assert sm.flush(10)
        assert any(name == "disk" and reason == "evicted" for name, reason, _ in seen)
    finally:
        sm.close()


def test_the_eviction_order_hints_reach_the_wrapped_disk(tmp_path):
    """``demote``, ``refresh`` and ``rank_arrivals`` are optional no-ops on the base class:
    a wrapper must pass them on, or a codec-wrapped disk never hears them."""
    pool = MemoryPool(1 << 20, pin_memory=False)
    cfg = CacheConfig(local_cpu_size="1MiB", local_disk=str(tmp_path))
    tier = create_backend("counting", cfg, pool, tier="disk")
    try:
        keys = [bytes([j]) * 16 for j in range(3)]
        objs = pool.allocate_many(SHAPE, torch.bfloat16, 3, 16)
        assert tier.put(keys, objs) == 3
        for o in objs:
            o.release()
        policy = tier.inner.index.policy
        tier.demote([keys[2]])
        assert policy.keys_in_order()[0] == keys[2]
        tier.refresh([keys[2]])
        assert policy.keys_in_order()[-1] == keys[2]
        tier.rank_arrivals(lambda k: 4)
        assert policy.arrival is not None and policy.arrival(keys[0]) == 4
    finally:
        tier.close()
        pool.close()


@pytest.mark.parametrize("tiers, message", [
    (["memory", "counting"], r"tiers\[1\]: 'counting' is a wrapper tier: write \{wrap"),
    (["memory", {"wrap": "disk", "tier": "redis://127.0.0.1:9"}],
     r"tiers\[1\]: 'disk' is not a wrapper tier"),
    (["memory", {"wrap": "counting", "tier": "memory"}], r"the memory tier cannot be wrapped"),
    (["memory", {"wrap": "counting", "tier": {"backend": "disk"}}],
     r"tiers\[1\]\.tier: the disk tier needs its directory"),
])
def test_malformed_wrappers_are_refused_naming_the_entry(tiers, message):
    with pytest.raises(ConfigError, match=message):
        check_chain(CacheConfig(tiers=tiers))


def test_a_bad_wrapper_option_names_the_entry(tmp_path):
    cfg = CacheConfig(tiers=["memory", {"wrap": "rate_limit", "bytes_per_secnd": 5,
                                        "tier": {"backend": "disk", "path": str(tmp_path)}}])
    with pytest.raises(ConfigError, match=r"tiers\[1\].*did you mean 'bytes_per_second'"):
        build_storage(cfg, MemoryPool(1 << 20, pin_memory=False))
    cfg = CacheConfig(tiers=["memory", {"wrap": "rate_limit", "bytes_per_second": -1,
                                        "tier": {"backend": "disk", "path": str(tmp_path)}}])
    with pytest.raises(ConfigError, match="bytes_per_second"):
        build_storage(cfg, MemoryPool(1 << 20, pin_memory=False))


# --------------------------------------------------------------------------- rate limit
def _limited(tmp_path, **kw) -> tuple[RateLimitTier, MemoryPool]:
    pool = MemoryPool(4 << 20, pin_memory=False)
    cfg = CacheConfig(local_disk=str(tmp_path), local_cpu_size="4MiB")
    tier = create_backend("rate_limit", cfg, pool, tier="disk", **kw)
    assert isinstance(tier, RateLimitTier)
    return tier, pool


def _objs(pool, n):
    out = [pool.allocate(SHAPE, torch.bfloat16, 16) for _ in range(n)]
    for o in out:
        o.tensor.fill_(1)
    return out


def test_bytes_are_paced_at_the_rate_and_latency_added(tmp_path):
    tier, pool = _limited(tmp_path, bytes_per_second="256KiB", latency="50ms")
    keys = [bytes([1, i]) * 8 for i in range(8)]
    objs = _objs(pool, 8)  # 64 KiB: a quarter of a second at 256 KiB/s
    try:
        t0 = time.monotonic()
        assert tier.put(keys, objs) == 8
        assert time.monotonic() - t0 >= 0.24
        t0 = time.monotonic()
        assert tier.contains(keys) == [True] * 8
        assert time.monotonic() - t0 >= 0.045  # a round trip's latency, no bytes
        t0 = time.monotonic()
        got = tier.get(keys)
        assert time.monotonic() - t0 >= 0.24
        for g in got:
            g.release()
    finally:
        for o in objs:
            o.release()
        tier.close()
    assert pool.used_bytes == 0


def test_a_call_is_never_held_past_max_delay_nor_past_close(tmp_path):
    tier, pool = _limited(tmp_path, bytes_per_second="1KiB", max_delay="300ms")
    keys = [bytes([2, i]) * 8 for i in range(4)]
    objs = _objs(pool, 4)  # 32 s at 1 KiB/s
    try:
        t0 = time.monotonic()
        assert tier.put(keys, objs) == 4
        assert 0.25 <= time.monotonic() - t0 < 5, "bounded by max_delay"
        slow, _ = _limited(tmp_path / "b", bytes_per_second="1KiB", max_delay="60s")
        done = threading.Event()
        result: list = []

        def put() -> None:
            result.append(slow.put(keys, objs))
            done.set()

        th = threading.Thread(target=put)
        th.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        slow.close()
        assert done.wait(5), "close() did not wake the paced call"
        assert time.monotonic() - t0 < 5 and result == [4]
        th.join(5)
    finally:
        for o in objs:
            o.release()
        tier.close()
