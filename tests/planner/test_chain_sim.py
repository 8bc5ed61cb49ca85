"""The planner over a config's tier chain (``tiers:`` or the shorthand keys): the same list
:mod:`lmc.storage.chain` builds the engine's tiers from, in its order, each tier simulated
by its declared medium with the eviction policy objects of :mod:`lmc.storage.eviction`."""

from __future__ import annotations

import random

import pytest

from lmc.config import CacheConfig
from lmc.planner.keys import key_trace
from lmc.planner.sim import GridPoint, chain_point, simulate
from lmc.planner.tiers import PeerTier, RemoteDaemon, SimCache, SimDisk, SimTier, chain_tiers
from lmc.storage.eviction import make_policy
from lmc.workloads.trace import TraceRequest

CS = 256
BPT = 16  # a full chunk is 4 KiB
CHUNK = 4096


def _trace(prompts: list[list[int]]):
    return key_trace([TraceRequest(float(i), f"r{i}", None, None, p, None, 4)
                      for i, p in enumerate(prompts)])


def _prompt(seed: int, chunks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 50000) for _ in range(chunks * CS)]


def test_shorthand_keys_give_the_fixed_chain_and_the_same_answers(tmp_path):
    cfg = CacheConfig(local_cpu_size=f"{4 * CHUNK}B", local_disk=str(tmp_path / "d"),
                      local_disk_size=f"{12 * CHUNK}B", remote_url="lmc://cache:7451")
    chain = chain_tiers(cfg, {"server": 40 * CHUNK})
    assert chain == [SimTier("disk", "disk", 12 * CHUNK), SimTier("server", "memory",
                                                                  40 * CHUNK)]
    rng = random.Random(5)
    prompts = [_prompt(rng.randrange(9), 3) for _ in range(60)]
    kt = _trace(prompts)
    by_chain = simulate(kt, chain_point(cfg, {"server": 40 * CHUNK}), bytes_per_token=BPT)
    fixed = simulate(kt, GridPoint(4 * CHUNK, 12 * CHUNK, 40 * CHUNK), bytes_per_token=BPT)
    assert list(by_chain.hit_tokens) == ["L1", "disk", "server"]
    assert list(by_chain.hit_tokens.values()) == list(fixed.hit_tokens.values())
    assert by_chain.hit_tokens["server"] > 0 and by_chain.hit_tokens["disk"] > 0


def test_a_tiers_list_is_simulated_in_its_own_order_with_two_remote_stores():
    tiers = ["memory", "redis://a:6379", {"backend": "disk", "path": "/nonexistent/x",
                                          "capacity": f"{64 * CHUNK}B",
                                          "eviction_policy": "fifo"},
             "lmc://cache:7451", "redis://b:6379", "p2p+lmc://dir:7451"]
    cfg = CacheConfig(local_cpu_size=f"{4 * CHUNK}B", tiers=tiers)
    sizes = {"redis": 6 * CHUNK, "server": 64 * CHUNK, "redis#2": 64 * CHUNK}
    point = chain_point(cfg, sizes)
    assert [(t.name, t.kind) for t in point.chain] == [
        ("redis", "memory"), ("disk", "disk"), ("server", "memory"), ("redis#2", "memory"),
        ("p2p", "peer")]
    assert point.chain[1] == SimTier("disk", "disk", 64 * CHUNK, "fifo")
    # eight prompts of three chunks, twice: L1 holds one prompt, the first redis two; the
    # second round (newest first) hits the first tier down the chain that still has them
    prompts = [_prompt(i, 3) for i in range(8)]
    r = simulate(_trace(prompts + prompts[::-1]), point, bytes_per_token=BPT)
    assert list(r.hit_tokens) == ["L1", "redis", "disk", "server", "redis#2", "p2p"]
    assert r.hit_tokens["p2p"] == 0 and r.hit_tokens["server"] == 0
    assert r.hit_tokens["redis#2"] == 0  # the disk above it holds everything
    assert r.hit_tokens["disk"] > 0 and r.hit_tokens["redis"] > 0
    # the same tiers in another order: the larger tier first takes every lower hit
    flipped = CacheConfig(local_cpu_size=f"{4 * CHUNK}B", tiers=[tiers[0], tiers[2],
                                                                 tiers[1]])
    r2 = simulate(_trace(prompts + prompts[::-1]), chain_point(flipped, sizes),
                  bytes_per_token=BPT)
    assert r2.hit_tokens["redis"] == 0
    assert r2.hit_tokens["disk"] == r.hit_tokens["disk"] + r.hit_tokens["redis"]


def test_a_remote_store_without_a_size_is_named():
    cfg = CacheConfig(local_cpu_size="1MiB", tiers=["memory", "redis://a:6379"])
    with pytest.raises(ValueError, match=r"tiers\[1\] \(redis://a:6379\).*sizes\['redis'\]"):
        chain_tiers(cfg)


def test_simulated_tiers_use_the_eviction_policy_objects():
    disk = SimDisk(3 * (CHUNK + 4096), "fifo")
    assert type(disk.index.policy) is type(make_policy("fifo"))
    disk.put([1, 2, 3], [CHUNK] * 3)
    disk.touch_present([1])  # FIFO: a use does not move it
    disk.put([4], [CHUNK])
    assert disk.keys_in_order() == [2, 3, 4]
    lru = SimDisk(3 * (CHUNK + 4096), "lru")
    lru.put([1, 2, 3], [CHUNK] * 3)
    lru.touch_present([1])
    lru.put([4], [CHUNK])
    assert lru.keys_in_order() == [3, 1, 4]
    assert isinstance(SimTier("r", "memory", 8 * CHUNK).build(), RemoteDaemon)
    assert isinstance(SimTier("p", "peer").build(), PeerTier)
    with pytest.raises(ValueError, match="give a chain or disk/remote sizes"):
        SimCache(8 * CHUNK, disk_bytes=CHUNK, bytes_per_token=BPT, chain=[])
