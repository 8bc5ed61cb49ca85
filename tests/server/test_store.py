"""The daemon's namespaced store in-process: namespaces never see each other's keys, quotas
evict a namespace's own oldest chunks, and the non-prefix get promotes lower-tier hits."""

from __future__ import annotations

import gc

import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.server.store import NamespacedStore
from lmc.storage.manager import StorageManager, TierPool
from lmc.storage.tier import create_backend

SHAPE = (1, 2, 16, 64)  # fp32
NB = 1 * 2 * 16 * 64 * 4  # 8 KiB


def _store(size="1MiB", **kw) -> NamespacedStore:
    cfg = CacheConfig(local_cpu_size=size, pin_memory="false")
    pool = MemoryPool(cfg.local_cpu_size, pin_memory="false")
    return NamespacedStore(StorageManager([create_backend("cpu", cfg, pool)]), **kw)


def _put(store: NamespacedStore, ns: str, keys: list[bytes], fill: float) -> None:
    ik = store.internal_keys(ns, keys)
    ok, reserved = store.admit(ns, [NB] * len(keys))
    objs = []
    for k, good in zip(ik, ok):
        if good:
            [o] = store.allocate_many(SHAPE, torch.float32, 1, 16)
            o.tensor.fill_(fill)
            objs.append((k, o))
    store.commit(ns, [k for k, _ in objs], [o for _, o in objs])
    for _, o in objs:
        o.release()
    store.settle(ns, reserved)


def test_namespaces_map_to_distinct_internal_keys():
    keys = [bytes([i]) * 16 for i in range(4)]
    a = NamespacedStore.internal_keys("a", keys)
    b = NamespacedStore.internal_keys("b", keys)
    assert len(set(a) | set(b)) == 8
    assert NamespacedStore.internal_keys("a", keys) == a
    assert NamespacedStore.internal_keys("", keys) != NamespacedStore.internal_keys("\0", keys)


def test_same_key_two_namespaces_no_cross_talk():
    s = _store()
    keys = [b"k" * 16]
    _put(s, "a", keys, 1.0)
    _put(s, "b", keys, 2.0)
    for ns, val in (("a", 1.0), ("b", 2.0)):
        [o] = s.get(ns, s.internal_keys(ns, keys), prefix=False)
        assert float(o.tensor[0, 0, 0, 0]) == val
        o.release()
    assert s.contains(s.internal_keys("c", keys)) == [False]


def test_quota_evicts_own_oldest_only():
    s = _store(quotas={"small": 3 * NB})
    _put(s, "big", [bytes([100 + i]) * 16 for i in range(10)], 9.0)
    keys = [bytes([i]) * 16 for i in range(6)]
    for k in keys:
        _put(s, "small", [k], 1.0)
    present = s.contains(s.internal_keys("small", keys))
    assert present == [False, False, False, True, True, True]
    assert all(s.contains(s.internal_keys("big", [bytes([100 + i]) * 16 for i in range(10)])))
    assert s.namespace_stats()["small"]["bytes"] == 3 * NB
    ok, reserved = s.admit("small", [4 * NB])  # one value larger than the quota
    assert ok == [False] and reserved == 0


def test_non_prefix_get_promotes_lower_tier_hits(tmp_path):
    cfg = CacheConfig(local_cpu_size="1MiB", pin_memory="false", local_disk=str(tmp_path))
    pool = MemoryPool(cfg.local_cpu_size, pin_memory="false")
    l1 = create_backend("cpu", cfg, pool)
    disk = create_backend("disk", cfg, TierPool(l1))
    mgr = StorageManager([l1, disk])
    s = NamespacedStore(mgr)
    keys = [bytes([i]) * 16 for i in range(3)]
    _put(s, "", keys, 3.0)
    assert mgr.flush(10)
    ik = s.internal_keys("", keys)
    l1.delete([ik[0], ik[2]])  # only on disk now
    got = s.get("", [ik[0], b"z" * 16, ik[2], ik[1]], prefix=False)
    assert [o is not None for o in got] == [True, False, True, True]
    assert all(float(o.tensor.flatten()[0]) == 3.0 for o in got if o is not None)
    for o in got:
        if o is not None:
            o.release()
    assert l1.contains([ik[0], ik[2]]) == [True, True]  # promoted
    mgr.close()


def test_a_key_given_twice_is_stored_once_without_a_leak():
    s = _store()
    pool = s.l1.pool
    for i in range(10):
        objs = s.allocate_many(SHAPE, torch.float32, 2, 16)
        k = bytes([i]) * 16
        s.commit("", [k, k], objs)
        pool.release_many(objs)
        del objs
    gc.collect()
    assert pool.leaks == [] and pool.stats()["objects"] == 10 == len(s.l1)


def test_a_key_asked_twice_is_read_once_from_disk(tmp_path):
    """A lower tier must not be asked twice for one key: two objects for one key would be
    promoted, and one of them leaked."""
    cfg = CacheConfig(local_cpu_size="1MiB", pin_memory="false", local_disk=str(tmp_path))
    pool = MemoryPool(cfg.local_cpu_size, pin_memory="false")
    l1 = create_backend("cpu", cfg, pool)
    mgr = StorageManager([l1, create_backend("disk", cfg, TierPool(l1))])
    s = NamespacedStore(mgr)
    keys = [bytes([i]) * 16 for i in range(3)]
    _put(s, "", keys, 4.0)
    assert mgr.flush(10)
    ik = s.internal_keys("", keys)
    for prefix in (False, True):
        l1.delete(ik)  # only on disk now
        got = s.get("", [ik[0], ik[1], ik[0], ik[2], ik[1]], prefix=prefix)
        assert [o is not None for o in got] == [True] * 5
        assert got[0] is got[2] and got[1] is got[4]
        for o in got:
            o.release()
    gc.collect()
    assert pool.leaks == [] and pool.stats()["objects"] == len(l1) == 3
    mgr.close()
