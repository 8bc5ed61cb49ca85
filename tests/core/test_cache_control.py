"""Cache control on ``CacheEngine`` (lmc/cache_control.py): pins with a TTL survive eviction
pressure until the TTL and not after, priorities order evictions, delete and clear reach L1
and the disk tier and publish the removals as KV events, a salted chain is its own, and every
bound refuses with its named error while changing nothing."""

from __future__ import annotations

import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.events import wire
from lmc.storage.control import NamespaceError, PinLimitError, PriorityError, TTLError
from tests.events.helpers import CHUNK as EV_CHUNK
from tests.events.helpers import Collector, engine_with_events, store
from tests.kvutil import assert_bits_equal, make_caches, random_tokens, spec_for, token_kv

CHUNK = 16
LAYOUT = "vllm_flash"
CACHES = dict(layers=2, heads=2, dim=64, blocks=64, block_size=4)


def _chunk_bytes() -> int:
    return spec_for(LAYOUT, make_caches(LAYOUT, **CACHES)).chunk_nbytes(CHUNK)


def _engine(chunks: int = 8, **cfg) -> tuple:
    """An engine whose pool holds exactly ``chunks`` chunks, and its source/destination
    caches."""
    src = make_caches(LAYOUT, **CACHES)
    dst = make_caches(LAYOUT, **CACHES, zeros=True)
    config = CacheConfig(**{"chunk_size": CHUNK, "local_cpu_size": chunks * _chunk_bytes(),
                            "local_cpu_prefault": "off", "pin_memory": "false", **cfg})
    return src, dst, CacheEngine(config, spec_for(LAYOUT, src), model_id="control")


def _slots(n: int, first_block: int = 0) -> torch.Tensor:
    return torch.arange(first_block * 4, first_block * 4 + n)


def _clock(eng: CacheEngine) -> list[float]:
    now = [0.0]  # the pin table's clock, moved by hand: expiry whatever the machine's load
    eng.control.pins.clock = lambda: now[0]
    return now


def test_a_pin_survives_eviction_pressure_until_its_ttl_and_not_after():
    src, dst, eng = _engine(chunks=8)
    now = _clock(eng)
    with eng:
        a = random_tokens(4 * CHUNK, 1)
        assert eng.store(a, src, _slots(len(a))) == len(a)
        assert eng.pin(a, ttl=30) == len(a)
        for seed in range(2, 8):  # pressure: 6 more prompts of 4 chunks through 8 slots
            now[0] += 4.0
            eng.store(random_tokens(4 * CHUNK, seed), src, _slots(4 * CHUNK, 16))
            assert eng.lookup(a) == len(a), f"pinned prompt evicted at t={now[0]}"
        assert eng.stats()["ttl_pinned_chunks"] == 4
        assert eng.retrieve(a, dst, _slots(len(a), 32)) == len(a)
        assert_bits_equal(token_kv(eng.spec, dst, _slots(len(a), 32)),
                          token_kv(eng.spec, src, _slots(len(a))), "pinned chunks")
        now[0] = 30.5  # past the TTL: the next call releases the pins, a is ordinary
        eng.store(random_tokens(8 * CHUNK, 9), src, _slots(8 * CHUNK))
        st = eng.stats()
        assert st["ttl_pinned_chunks"] == 0 and st["ttl_pins_expired"] == 4
        assert eng.lookup(a) == 0, "an expired pin still held its chunks"


def test_priority_then_recency_orders_evictions():
    src, _, eng = _engine(chunks=8)
    with eng:
        hi, lo = random_tokens(4 * CHUNK, 11), random_tokens(4 * CHUNK, 12)
        eng.store(hi, src, _slots(len(hi)))
        eng.store(lo, src, _slots(len(lo), 16))
        assert eng.set_priority(hi, 5) == 4
        assert eng.set_priority(lo, -1) == 4
        eng.lookup(lo)  # recency does not beat priority
        eng.store(random_tokens(4 * CHUNK, 13), src, _slots(4 * CHUNK, 32))
        assert eng.lookup(hi) == len(hi), "the high-priority prompt was evicted"
        assert eng.lookup(lo) == 0, "the low-priority prompt outlived a priority-0 one"
        eng.store(random_tokens(4 * CHUNK, 14), src, _slots(4 * CHUNK, 48))
        assert eng.lookup(hi) == len(hi)  # priority 0 goes first, recency within it


def test_bounds_refuse_with_named_errors_and_change_nothing():
    src, _, eng = _engine(chunks=8, max_ttl_pins=3, max_pin_ttl="10s", tenant="team-a")
    with eng:
        a = random_tokens(4 * CHUNK, 21)
        eng.store(a, src, _slots(len(a)))
        with pytest.raises(PinLimitError, match="past the bound of 3 chunks"):
            eng.pin(a, ttl=5)
        with pytest.raises(TTLError, match="exceeds the ceiling max_pin_ttl 10 s"):
            eng.pin(a[:CHUNK], ttl=11)
        for bad in (0, -1, float("nan"), float("inf"), "5", True):
            with pytest.raises(TTLError):
                eng.pin(a[:CHUNK], ttl=bad)
        for bad in (11, -11, 1.5, "1", None):
            with pytest.raises(PriorityError):
                eng.set_priority(a, bad)
        assert eng.namespace == "team-a"
        for call in (lambda: eng.pin(a, ttl=1, namespace="team-b"),
                     lambda: eng.set_priority(a, 1, namespace="team-b"),
                     lambda: eng.delete(a, namespace="team-b"),
                     lambda: eng.clear("team-b")):
            with pytest.raises(NamespaceError, match="'team-b' is not its to change"):
                call()
        st = eng.stats()
        assert st["ttl_pinned_chunks"] == 0 and all(o.ref_count == 1 for o in
                                                    eng.storage.l1._map.values())
        assert eng.lookup(a) == len(a)  # nothing was deleted or cleared
        assert eng.pin(a[:3 * CHUNK], ttl=5, namespace="team-a") == 3 * CHUNK
        c = random_tokens(CHUNK, 22)
        assert eng.pin(c, ttl=5) == 0  # nothing stored: nothing to pin, nothing refused
        eng.store(c, src, _slots(CHUNK, 32))
        with pytest.raises(PinLimitError, match=r"\(3 held by others\)"):
            eng.pin(c, ttl=5)  # a 4th chunk
        assert eng.stats()["ttl_pinned_chunks"] == 3


def test_a_pin_by_bytes_past_the_share_is_refused():
    src, _, eng = _engine(chunks=8, max_pin_share=0.25)
    with eng:
        a = random_tokens(3 * CHUNK, 23)
        eng.store(a, src, _slots(len(a)))
        with pytest.raises(PinLimitError, match="past the bound of"):
            eng.pin(a, ttl=5)
        assert eng.pin(a[:2 * CHUNK], ttl=5) == 2 * CHUNK


def test_a_session_pin_replaces_its_last_turn_and_unpin_frees_it():
    src, _, eng = _engine(chunks=8)
    with eng:
        turn1 = random_tokens(2 * CHUNK, 31)
        turn2 = turn1 + random_tokens(2 * CHUNK, 32)
        eng.store(turn1, src, _slots(len(turn1)))
        assert eng.pin(turn1, ttl=60, session="s1") == len(turn1)
        eng.store(turn2, src, _slots(len(turn2)))
        assert eng.pin(turn2, ttl=60, session="s1") == len(turn2)
        assert eng.stats()["ttl_pinned_chunks"] == 4  # replaced, not stacked
        assert eng.unpin(session="s1") == 4
        assert eng.stats()["ttl_pinned_chunks"] == 0
        assert all(o.ref_count == 1 for o in eng.storage.l1._map.values())


def test_pin_reads_a_lower_tier_hit_into_l1(tmp_path):
    src, _, eng = _engine(chunks=8, local_disk=str(tmp_path / "d"), local_disk_size="4MiB")
    with eng:
        a = random_tokens(4 * CHUNK, 41)
        eng.store(a, src, _slots(len(a)))
        eng.flush()
        for seed in range(42, 45):
            eng.store(random_tokens(4 * CHUNK, seed), src, _slots(4 * CHUNK, 16))
        assert not any(eng.contains_chunks(a))
        assert eng.pin(a, ttl=10) == len(a)
        assert all(eng.contains_chunks(a))


def test_delete_reaches_every_tier_and_leaves_other_chains(tmp_path):
    src, _, eng = _engine(chunks=8, local_disk=str(tmp_path / "d"), local_disk_size="4MiB")
    with eng:
        a = random_tokens(3 * CHUNK, 51)
        eng.store(a, src, _slots(len(a)))
        eng.flush()  # the queue holds half the pool: each prompt reaches the disk
        eng.pin(a, ttl=10)
        b_salted = a  # the same tokens under a cache_salt: a chain of its own
        keys_salted = eng.control.keys(b_salted, "s", None)
        eng.store(a, src, _slots(len(a)), keys=keys_salted)
        eng.flush()
        disk = eng.storage.lower[0]
        assert all(disk.contains(eng.db.keys(a))) and all(disk.contains(keys_salted))
        assert eng.delete(a) == 6  # 3 chunks in L1 and on disk
        assert eng.lookup(a) == 0 and not any(disk.contains(eng.db.keys(a)))
        assert eng.stats()["ttl_pinned_chunks"] == 0  # the pins went with the chunks
        assert all(eng.storage.l1.contains(keys_salted)) and all(disk.contains(keys_salted))
        assert eng.delete(a, salt="s") == 6
        assert not any(disk.contains(keys_salted))
        assert eng.storage.l1.pool.used_bytes == 0


def test_clear_empties_every_tier_of_the_namespace(tmp_path):
    src, _, eng = _engine(chunks=8, local_disk=str(tmp_path / "d"), local_disk_size="4MiB")
    with eng:
        for seed in range(61, 64):
            eng.store(random_tokens(2 * CHUNK, seed), src, _slots(2 * CHUNK))
            eng.flush()  # the queue holds half the pool: each prompt reaches the disk
        eng.pin(random_tokens(2 * CHUNK, 61), ttl=10)
        eng.flush()
        out = eng.clear()
        assert out == {"cpu": 6, "disk": 6}
        assert len(eng.storage.l1) == 0 and len(eng.storage.lower[0]) == 0
        assert eng.stats()["ttl_pinned_chunks"] == 0
        assert eng.storage.l1.pool.used_bytes == 0


def test_delete_and_clear_publish_the_removals(tmp_path):
    a = random_tokens(3 * EV_CHUNK, seed=71)
    b = random_tokens(2 * EV_CHUNK, seed=72)
    with engine_with_events(tmp_path / "disk") as (eng, ev, caches):
        sub = Collector(ev.endpoint)
        store(eng, caches, a)
        store(eng, caches, b)
        stored = sub.settle(ev.publisher)
        hashes_a = {h for e in stored if isinstance(e, wire.Stored)
                    and e.token_ids == tuple(a[:len(e.token_ids)]) for h in e.hashes}
        assert hashes_a
        eng.delete(a)
        events = sub.settle(ev.publisher)
        removed = {(m, h) for e in events if isinstance(e, wire.Removed)
                   for m in (e.medium,) for h in e.hashes}
        assert {h for _, h in removed} >= hashes_a
        assert {m for m, _ in removed} == {wire.CPU, wire.STORAGE}
        eng.clear()
        events = sub.settle(ev.publisher)
        assert any(isinstance(e, (wire.Removed, wire.Cleared)) for e in events)
        assert wire.Cleared() in events or {
            h for e in events if isinstance(e, wire.Removed) for h in e.hashes}
        sub.close()


def test_a_priority_follows_the_chunk_down_to_disk_and_back(tmp_path):
    """Under write_on_evict a chunk reaches the disk only when L1 evicts it, after its
    priority was set; a disk hit is promoted back into L1: it keeps its rank both ways."""
    src, dst, eng = _engine(chunks=16, local_disk=str(tmp_path / "d"),
                            local_disk_size="8MiB", write_policy="write_on_evict")
    with eng:
        a = random_tokens(2 * CHUNK, 81)
        eng.store(a, src, _slots(len(a)))
        assert eng.set_priority(a, -4) == 2  # the first to go
        for seed in range(82, 90):  # 16 more chunks: a leaves L1 for the disk
            filler = random_tokens(2 * CHUNK, seed)
            eng.store(filler, src, _slots(2 * CHUNK, 16))
            # at a's level (recency decides within it): a full write queue drops a lower
            # priority first, and one allocation may fill the queue with its victims
            eng.set_priority(filler, -4)
            eng.flush()  # the queue (a quarter of the pool) drains between stores
        keys = eng.db.keys(a)
        disk, l1 = eng.storage.lower[0], eng.storage.l1
        assert not any(l1.contains(keys)) and all(disk.contains(keys))
        assert [disk.priority_of(k) for k in keys] == [-4, -4]
        assert eng.retrieve(a, dst, _slots(len(a), 32)) == len(a)  # promoted back
        assert [l1.priority_of(k) for k in keys] == [-4, -4]
        eng.delete(a)
        eng.store(a, src, _slots(len(a)))  # stored afresh after a delete: an ordinary chunk
        assert [l1.priority_of(k) for k in keys] == [0, 0]


def test_a_prioritised_batch_written_to_a_full_disk_keeps_itself_not_the_older(tmp_path):
    """A disk of 8 chunks full of priority-5 chunks (a); 8 more at priority 5 (b) are
    written down in batches: within one priority recency decides, so the disk ends holding
    b. (Ranked only after their batch was written, b's chunks arrived at 0 and each batch's
    later chunks evicted its earlier ones, not a's.)"""
    from lmc.storage.backends.disk.index import BLOCK, round_up

    entry = BLOCK + round_up(_chunk_bytes())
    src, _, eng = _engine(chunks=32, local_disk=str(tmp_path / "d"),
                          local_disk_size=8 * entry)
    with eng:
        a, b = random_tokens(8 * CHUNK, 91), random_tokens(8 * CHUNK, 92)
        for p, first in ((a, 0), (b, 32)):
            eng.set_priority(p, 5)  # remembered before the chunks exist: they arrive at 5
            assert eng.store(p, src, _slots(len(p), first)) == len(p)
            assert eng.flush()
        disk = eng.storage.lower[0]
        assert disk.contains(eng.db.keys(b)) == [True] * 8, "the disk dropped its newest"
        assert not any(disk.contains(eng.db.keys(a)))
        assert {disk.priority_of(k) for k in eng.db.keys(b)} == {5}
