"""The L1 tier's reference rules: one reference per held key, referenced chunks never evicted,
every reference returned at close (the pool's invariant mode checks the balance)."""

from __future__ import annotations

import threading

import pytest
import torch

from lmc import CacheConfig
from lmc.memory.pool import Lease, MemoryPool
from lmc.storage.manager import StorageManager, TierPool
from lmc.storage.tier import StorageBackend, create_backend

UNIT = 4096


def _l1(units: int = 16):
    pool = MemoryPool(units * UNIT, pin_memory=False, invariants=True)
    return create_backend("cpu", CacheConfig(local_cpu_size=units * UNIT), pool), pool


def _obj(pool, val: int):
    o = pool.allocate((UNIT,), torch.uint8, 1)
    o.tensor.fill_(val)
    return o


def test_a_key_repeated_in_one_put_keeps_one_reference_and_leaks_nothing():
    l1, pool = _l1()
    a, b = _obj(pool, 1), _obj(pool, 2)
    l1.put([b"k" * 16, b"k" * 16], [a, b])
    assert (a.ref_count, b.ref_count) == (2, 1), "the second object got a reference too"
    Lease([a, b]).release()
    got = l1.get([b"k" * 16])[0]
    assert int(got.tensor[0]) == 1
    got.release()
    l1.close()
    assert pool.used_bytes == 0
    pool.close()


def test_batches_all_new_all_hit_and_mixed_follow_the_same_rules():
    """The batch fast paths (every key new, every key found) and the per-key ones (some
    held) give the same references, answers and LRU order."""
    l1, pool = _l1()
    keys = [bytes([i]) * 16 for i in range(6)]
    objs = [_obj(pool, i) for i in range(6)]
    assert l1.touch(keys[:3]) == [False] * 3
    assert l1.put(keys[:3], objs[:3]) == 3  # all new
    assert [o.ref_count for o in objs[:3]] == [2, 2, 2]
    l1.put(keys[1:5], [objs[0]] + objs[2:5])  # keys 1, 2 held: keep their first objects
    assert [o.ref_count for o in objs[:5]] == [2, 2, 2, 2, 2]
    assert l1.touch([keys[5], keys[0], keys[3]]) == [False, True, True]
    assert list(l1._map) == [keys[1], keys[2], keys[4], keys[0], keys[3]]  # touched: newest
    got = l1.get(keys[:5])  # all found: each acquired once, all refreshed in order
    assert got == objs[:5] and [o.ref_count for o in objs[:5]] == [3] * 5
    assert list(l1._map) == keys[:5]
    Lease(got).release()
    got = l1.get([keys[5], keys[2]])
    assert got == [None, objs[2]] and objs[2].ref_count == 3
    assert list(l1._map)[-1] == keys[2]
    Lease([objs[2]] + objs).release()
    l1.close()
    assert pool.used_bytes == 0
    pool.close()


class _Store(StorageBackend):
    """A lower tier with its own bytes: each get reads into a fresh object of the L1 pool, as
    disk and Redis do."""

    name = "store"

    def __init__(self, pool: TierPool) -> None:
        self.pool = pool
        self.data: dict[bytes, int] = {}

    def contains(self, keys):
        return [k in self.data for k in keys]

    def get(self, keys):
        out = []
        for k in keys:
            o = self.pool.allocate((UNIT,), torch.uint8, 1) if k in self.data else None
            if o is not None:
                o.tensor.fill_(self.data[k])
            out.append(o)
        return out

    def put(self, keys, objs):
        for k, o in zip(keys, objs):
            self.data[k] = int(o.tensor[0])
        return len(keys)

    def delete(self, keys):
        return sum(self.data.pop(k, None) is not None for k in keys)


def test_a_chunk_read_twice_from_a_lower_tier_is_promoted_once_and_leaks_nothing():
    l1, pool = _l1()
    low = _Store(TierPool(l1))
    low.data = {b"a" * 16: 7, b"b" * 16: 8}
    sm = StorageManager([l1, low])
    keys = [b"a" * 16, b"b" * 16, b"a" * 16]  # a prefetch of a repeated chunk, say
    got = sm.get_prefix(keys)
    assert [int(o.tensor[0]) for o in got] == [7, 8, 7]
    Lease(got).release()
    assert len(l1) == 2
    sm.close()
    assert pool.used_bytes == 0, "a promoted duplicate kept a reference nobody holds"
    pool.close()


def test_eviction_under_concurrent_readers_never_frees_a_chunk_being_read():
    """Readers hold chunks they got while writers fill the pool: every chunk a reader holds
    keeps its bytes until it releases it (eviction passes over referenced chunks)."""
    l1, pool = _l1(units=8)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        try:
            for i in range(300):
                objs = l1.allocate_many((UNIT,), torch.uint8, 2, 1)
                for j, o in enumerate(objs):
                    o.tensor.fill_((seed * 7 + i + j) % 251)
                keys = [bytes([seed, i % 256, i // 256, j]) * 4 for j in range(len(objs))]
                l1.put(keys, objs)
                Lease(objs).release()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader() -> None:
        try:
            while not stop.is_set():
                with l1._lock:
                    keys = list(l1._map.keys())[-4:]
                for o in l1.get(keys):
                    if o is None:
                        continue
                    first = int(o.tensor[0])
                    assert bool((o.tensor == first).all()), "a held chunk changed under it"
                    o.release()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[0]
    l1.close()
    assert pool.used_bytes == 0
    pool.close()


def test_a_put_after_close_keeps_nothing_and_a_foreign_object_is_refused():
    """A promotion finishing on another thread after the tier closed must not park a
    reference in a map nobody will clear again (the pool's close would report it held)."""
    import pytest

    l1, pool = _l1()
    other = MemoryPool(4 * UNIT, pin_memory=False, invariants=True)
    stranger = _obj(other, 3)
    with pytest.raises(ValueError, match="another memory pool"):
        l1.put([b"s" * 16], [stranger])
    assert stranger.ref_count == 1 and len(l1) == 0
    stranger.release()
    other.close()
    l1.close()
    late = _obj(pool, 4)
    assert l1.put([b"l" * 16], [late]) == 0
    assert late.ref_count == 1 and len(l1) == 0
    late.release()
    assert pool.used_bytes == 0
    pool.close()


def test_a_failed_promotion_returns_every_reference_it_took(monkeypatch):
    """get_prefix holds a reference on every chunk found so far; when promoting a lower-tier
    hit raises, the caller never sees them, so the manager must release them itself."""
    import pytest

    l1, pool = _l1()
    hot = _obj(pool, 1)
    l1.put([b"h" * 16], [hot])
    hot.release()
    low = _Store(TierPool(l1))
    low.data = {b"a" * 16: 7, b"b" * 16: 8}
    sm = StorageManager([l1, low])

    def broken_put(keys, objs):
        raise MemoryError("injected: promotion failed")

    monkeypatch.setattr(l1, "put", broken_put)
    with pytest.raises(MemoryError, match="injected"):
        sm.get_prefix([b"h" * 16, b"a" * 16, b"b" * 16])
    monkeypatch.undo()
    assert hot.ref_count == 1, "the L1 hit kept the failed call's reference"
    assert pool.used_bytes == UNIT, "the chunks read from the lower tier were never freed"
    sm.close()
    assert pool.used_bytes == 0
    pool.close()


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_the_configured_policy_object_orders_eviction(policy):
    """``eviction_policy`` picks the tier's policy object: after a touch and a get of the
    oldest chunk, LRU evicts the next oldest, FIFO the first stored all the same."""
    pool = MemoryPool(4 * UNIT, pin_memory=False, invariants=True)
    l1 = create_backend("cpu", CacheConfig(local_cpu_size=4 * UNIT, eviction_policy=policy),
                        pool)
    keys = [bytes([i]) * 16 for i in range(5)]
    objs = [_obj(pool, i) for i in range(4)]
    assert l1.put(keys[:4], objs) == 4
    Lease(objs).release()
    assert l1.touch([keys[0]]) == [True]
    Lease(l1.get([keys[1], keys[0]])).release()
    new = l1.allocate((UNIT,), torch.uint8, 1)  # the pool is full: one chunk goes
    assert new is not None and l1.evictions == 1
    gone = keys[2] if policy == "lru" else keys[0]
    assert l1.contains(keys[:4]) == [k != gone for k in keys[:4]]
    order = l1._policy.keys_in_order()
    assert order == ([keys[3], keys[1], keys[0]] if policy == "lru" else keys[1:4])
    new.release()
    l1.close()
    assert pool.used_bytes == 0
    pool.close()


def test_an_unknown_policy_is_refused_naming_the_choices(tmp_path):
    from lmc.storage.backends.disk.backend import DiskBackend
    from lmc.storage.chain import check_chain
    pool = MemoryPool(4 * UNIT, pin_memory=False)
    try:
        with pytest.raises(ValueError, match="choose one of lru, fifo"):
            DiskBackend(config=CacheConfig(local_disk=str(tmp_path)), pool=pool,
                        eviction_policy="mru")
        with pytest.raises(ValueError, match="eviction_policy.*choose one of lru, fifo"):
            check_chain(CacheConfig(eviction_policy="arc"))  # the chain's registry check
    finally:
        pool.close()
