"""Tier listeners: every store, promotion, eviction, delete and clear of every tier is seen,
in order, after the fact, naming the tier's name, medium and level (docs/design.md, "The tier
kit"). The strong check: a model fed only by the events equals what each tier holds."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from lmc import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.metrics import EngineMetrics
from lmc.storage.chain import build_storage
from lmc.storage.manager import EvictionMetrics, StorageManager, WriteOnEvict
from lmc.storage.tier import (
    DELETED,
    EVICTED,
    PROMOTED,
    STORED,
    Key,
    Medium,
    TierInfo,
    TierListener,
)

SHAPE = (2, 2, 16, 32)  # [layers, planes, tokens, width] float16: 4 KiB a chunk
CHUNK = 4096


class Recorder(TierListener):
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.held: dict[str, set[Key]] = {}
        self.lock = threading.Lock()

    def on_stored(self, keys, tier, reason):
        with self.lock:
            self.events.append(("stored", tier.name, reason, tuple(keys)))
            self.held.setdefault(tier.name, set()).update(keys)

    def on_removed(self, keys, tier, reason, objs=None):
        with self.lock:
            self.events.append(("removed", tier.name, reason, tuple(keys)))
            self.held.setdefault(tier.name, set()).difference_update(keys)

    def on_cleared(self, tier):
        with self.lock:
            self.events.append(("cleared", tier.name))
            self.held[tier.name] = set()


def _merged(events: list[tuple]) -> list[tuple]:
    """Consecutive events of one kind, tier and reason as one (write-behind batches as its
    thread's timing falls)."""
    out: list[tuple] = []
    for e in events:
        if out and len(e) == 4 and out[-1][:3] == e[:3]:
            out[-1] = (*e[:3], out[-1][3] + e[3])
        else:
            out.append(e)
    return out


def _keys(events: list[tuple], *what: str) -> set[Key]:
    return {k for e in events if e[:3] == what for k in e[3]}


def _key(i: int) -> Key:
    return i.to_bytes(16, "big")


def _storage(tmp_path, l1_chunks=6, disk_chunks=4, **cfg) -> tuple[StorageManager, MemoryPool]:
    pool = MemoryPool(l1_chunks * CHUNK, pin_memory=False)
    config = CacheConfig(local_cpu_size=l1_chunks * CHUNK, local_disk=str(tmp_path),
                         local_disk_size=disk_chunks * (CHUNK + 4096), **cfg)
    return build_storage(config, pool), pool


def _store(sm: StorageManager, ids: list[int]) -> int:
    objs = sm.allocate_many(SHAPE, torch.float16, len(ids), 16)
    for o, i in zip(objs, ids):
        o.tensor.fill_(i)
    n = sm.put([_key(i) for i in ids[: len(objs)]], objs)
    for o in objs:
        o.release()
    return n


def _fetch(sm: StorageManager, ids: list[int]) -> None:
    for o in sm.get_prefix([_key(i) for i in ids]):
        o.release()


def _held(sm: StorageManager, universe: range) -> dict[str, set[Key]]:
    keys = [_key(i) for i in universe]
    return {t.name: {k for k, p in zip(keys, t.contains(keys)) if p} for t in sm.tiers}


def test_each_kind_of_event_in_order_over_memory_and_disk(tmp_path):
    sm, pool = _storage(tmp_path, l1_chunks=4, disk_chunks=3)
    rec = Recorder()
    sm.add_listener(rec)
    try:
        assert [(i.name, i.medium, i.level) for i in sm.infos] == [
            ("cpu", Medium.MEMORY, 0), ("disk", Medium.LOCAL_STORAGE, 1)]
        _store(sm, [1, 2])
        assert rec.events == [("stored", "cpu", STORED, (_key(1), _key(2)))]
        assert sm.flush(10)
        assert _merged(rec.events[1:]) == [("stored", "disk", STORED, (_key(1), _key(2)))]
        rec.events.clear()
        _store(sm, [3, 4])  # L1 holds 4 chunks; the disk 3: it evicts 1 or 2 for 4
        assert sm.flush(10)
        assert rec.events[0] == ("stored", "cpu", STORED, (_key(3), _key(4)))
        first = _keys(rec.events[1:], "removed", "disk", EVICTED)
        assert len(first) == 1 and first < {_key(1), _key(2)}  # written in parallel
        assert _keys(rec.events[1:], "stored", "disk", STORED) == {_key(3), _key(4)}
        assert rec.events[-1][:3] == ("stored", "disk", STORED)  # after the room was made
        rec.events.clear()
        _store(sm, [5])  # L1 evicts its least recent (1) to make room, then holds 5
        assert sm.flush(10)
        assert rec.events[:2] == [("removed", "cpu", EVICTED, (_key(1),)),
                                  ("stored", "cpu", STORED, (_key(5),))]
        (other,) = {_key(1), _key(2)} - first
        assert rec.events[2:] == [("removed", "disk", EVICTED, (other,)),
                                  ("stored", "disk", STORED, (_key(5),))]
        rec.events.clear()
        sm.delete([_key(5), _key(99)])
        assert rec.events == [("removed", "cpu", DELETED, (_key(5),)),
                              ("removed", "disk", DELETED, (_key(5),))]
        rec.events.clear()
        sm.clear_l1()
        assert rec.events == [("cleared", "cpu")]
        rec.events.clear()
        _fetch(sm, [3, 4])  # on disk only now: promoted back into L1
        assert rec.events == [("stored", "cpu", PROMOTED, (_key(3), _key(4)))]
    finally:
        sm.close()
    assert pool.used_bytes == 0


def test_a_model_fed_only_by_events_equals_every_tier(tmp_path):
    """Random stores, fetches, deletes and clears over memory + disk: after each step (and a
    flush), what the events say each tier holds is what it holds."""
    rng = random.Random(7)
    sm, _ = _storage(tmp_path, l1_chunks=6, disk_chunks=4)
    rec = Recorder()
    sm.add_listener(rec)
    universe = range(24)
    try:
        for step in range(120):
            op = rng.random()
            ids = rng.sample(list(universe), rng.randint(1, 5))
            if op < 0.5:
                _store(sm, ids)
            elif op < 0.8:
                _fetch(sm, ids)
            elif op < 0.95:
                sm.delete([_key(i) for i in ids])
            else:
                sm.clear_l1()
            assert sm.flush(10)
            real = _held(sm, universe)
            model = {n: rec.held.get(n, set()) for n in real}
            assert model == real, f"step {step}: events disagree with the tiers"
    finally:
        sm.close()


def test_write_on_evict_is_a_listener_and_stores_still_reach_disk(tmp_path):
    sm, _ = _storage(tmp_path, l1_chunks=8, disk_chunks=8, write_policy="write_on_evict")
    rec = Recorder()
    try:
        assert any(isinstance(x, WriteOnEvict) for x in sm.listeners)
        sm.add_listener(rec)
        _store(sm, [1, 2, 3, 4, 5, 6, 7, 8])
        assert sm.flush(10)
        assert not sm.tiers[1].contains([_key(1)])[0]  # nothing evicted yet
        _store(sm, [9, 10])  # the queue holds a quarter of the pool: 2 chunks
        assert sm.flush(10)
        assert sm.tiers[1].contains([_key(1), _key(2)]) == [True, True]
        assert {_key(1), _key(2)} <= _keys(rec.events, "removed", "cpu", EVICTED)
        assert {_key(1), _key(2)} <= _keys(rec.events, "stored", "disk", STORED)
    finally:
        sm.close()


def test_no_listener_no_hooks_and_a_failing_listener_is_not_the_callers_error(tmp_path):
    sm, _ = _storage(tmp_path)
    try:
        assert sm.l1.on_evict is None and sm.queues[0].on_written is None
        assert sm.tiers[1].on_evicted is None

        class Broken(TierListener):
            def on_stored(self, keys, tier, reason):
                raise RuntimeError("observer bug")

        rec = Recorder()
        broken = Broken()
        sm.add_listener(broken)
        sm.add_listener(rec)
        assert _store(sm, [1]) == 1  # the store succeeds; the next listener still hears it
        assert sm.flush(10)
        assert [e[:2] for e in rec.events] == [("stored", "cpu"), ("stored", "disk")]
        sm.remove_listener(broken)
        sm.remove_listener(rec)
        assert sm.l1.on_evict is None and sm.queues[0].on_written is None
    finally:
        sm.close()


def test_tier_info_names_what_kv_events_need():
    info = TierInfo("disk", Medium.LOCAL_STORAGE, 1)
    assert (info.name, info.medium.value, info.level) == ("disk", "local_storage", 1)
    with pytest.raises(AttributeError):
        info.name = "x"  # type: ignore[misc]


def test_the_engines_metrics_count_the_disk_tiers_evictions(tmp_path):
    sm, _ = _storage(tmp_path, l1_chunks=8, disk_chunks=2)
    metrics = EngineMetrics()
    sm.add_listener(EvictionMetrics(metrics))
    try:
        for i in range(0, 6, 2):
            _store(sm, [i, i + 1])
            assert sm.flush(10)
        held = len(_held(sm, range(6))["disk"])
        assert metrics.counts["evictions_disk"] == 6 - held > 0
        assert "evictions_cpu" not in metrics.counts  # L1 counts its own
    finally:
        sm.close()
