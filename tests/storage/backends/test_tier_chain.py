"""The issue's done-when: a ``tiers:`` chain memory -> ``lmc://`` daemon -> Redis stores and
loads bit-exact through the chain, in that order (docs/design.md, "The tier kit"). A real
daemon (``lmc server``, tests/server's fixture) and a real redis-server."""

from __future__ import annotations

import pytest
import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.chain import build_storage
from lmc.storage.tier import create_backend
from tests.kvutil import assert_bits_equal, random_bits
from tests.server.conftest import start_daemon as start_daemon  # noqa: F401 - a fixture
from tests.server.daemon_proc import client_pool

pytestmark = pytest.mark.integration
SHAPE = (2, 2, 16, 64)


def test_memory_daemon_redis_chain_stores_and_loads_bit_exact_in_order(start_daemon,  # noqa: F811
                                                                        redis_server):
    d = start_daemon("--size", "16MiB")
    prefix = "chain-test"
    cfg = CacheConfig(local_cpu_size="1MiB", tiers=[
        "memory", {"backend": d.url, "remote_timeout": 5},
        {"backend": redis_server.url, "remote_key_prefix": prefix, "remote_timeout": 5}])
    sm = build_storage(cfg, MemoryPool(1 << 20, pin_memory=False))
    assert [t.name for t in sm.tiers] == ["cpu", "server", "redis"]
    keys = [bytes([42, i]) * 8 for i in range(4)]
    gen = torch.Generator().manual_seed(11)
    try:
        objs = sm.allocate_many(SHAPE, torch.bfloat16, len(keys), 16)
        want = []
        for o in objs:
            o.tensor.copy_(random_bits(SHAPE, torch.bfloat16, gen))
            want.append(o.tensor.clone())
        assert sm.put(keys, objs) == len(keys)
        for o in objs:
            o.release()
        assert sm.flush(20)
        daemon, redis = sm.tiers[1], sm.tiers[2]
        assert daemon.contains(keys) == [True] * 4 and redis.contains(keys) == [True] * 4

        def load(expect_from: list[int], what: str) -> None:
            got, where = sm.fetch_prefix(keys)
            assert where == expect_from, what
            for g, w in zip(got, want):
                assert_bits_equal(g.tensor, w, what)
                g.release()

        load([0] * 4, "from memory")
        sm.clear_l1()
        load([1] * 4, "from the daemon")  # the first lower tier answers first
        sm.clear_l1()
        assert daemon.delete(keys[2:]) == 2
        load([1, 1, 2, 2], "from the daemon, then Redis for what it lost")
        assert sm.flush(20)
        assert daemon.contains(keys) == [True] * 4  # Redis's hits written back up
        sm.clear_l1()
        assert daemon.delete(keys) == 4
        load([2] * 4, "from Redis alone")
    finally:
        sm.delete(keys)
        sm.close()


def test_the_daemon_builds_its_chain_from_cache_tiers(start_daemon, redis_server, tmp_path):  # noqa: F811
    """``lmc server`` with ``cache: {tiers: [memory, disk, Redis]}`` (from its environment):
    values its 4 MiB memory evicted come back bit-exact from the chain below it."""
    chain = (f"{{tiers: [memory, {{backend: disk, path: '{tmp_path / 'disk'}'}}, "
             f"{{backend: '{redis_server.url}', remote_key_prefix: daemon-chain}}]}}")
    d = start_daemon("--size", "4MiB", env={"LMC_SERVER_CACHE": chain})
    cfg, pool = client_pool("32MiB")
    tier = create_backend(d.url, cfg, pool)
    gen = torch.Generator().manual_seed(5)
    objs = []
    try:
        for _ in range(12):  # 6 MiB through a 4 MiB memory tier
            o = pool.allocate((2, 2, 64, 1024), torch.bfloat16, 64)  # 512 KiB
            o.tensor.copy_(random_bits((2, 2, 64, 1024), torch.bfloat16, gen))
            objs.append(o)
        keys = [bytes([77, i]) * 8 for i in range(12)]
        for i in range(0, 12, 2):
            assert tier.put(keys[i:i + 2], objs[i:i + 2]) == 2
        tiers = d.stats()["tiers"]
        assert tiers["cpu.evictions"] > 0 and "disk.put_chunks" in tiers
        assert "redis.put_chunks" in tiers
        got = tier.get(keys)
        for o, g in zip(objs, got):
            assert g is not None, "an evicted value was not served from the chain"
            assert_bits_equal(g.tensor, o.tensor, "through the daemon's chain")
            g.release()
    finally:
        for o in objs:
            o.release()
        tier.close()
