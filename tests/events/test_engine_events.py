"""A real CPU engine with a memory and a disk tier publishes what its tiers hold: every event
decoded from the wire, applied as a router applies it (stored adds, removed removes, cleared
empties, per medium), must equal what the tiers answer ``contains`` for, after stores,
evictions, promotions, deletes and clears; hashes one per engine block, parent-first."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from lmc import CacheConfig
from lmc.cache_engine import CacheEngine
from lmc.events import wire
from lmc.events.engine import attach
from tests.events.helpers import (
    BLOCK,
    CHUNK,
    LOCAL,
    Collector,
    engine_with_events,
    request,
    store,
)
from tests.kvutil import make_caches, random_tokens, spec_for


class Model:
    """What a consumer believes, per medium (Dynamo's semantics: no reference counts)."""

    def __init__(self) -> None:
        self.media: dict[str, set[int]] = defaultdict(set)
        self.tokens: dict[int, tuple[int, ...]] = {}

    def apply(self, events: list[wire.Event]) -> None:
        for ev in events:
            if isinstance(ev, wire.Stored):
                self.media[ev.medium].update(ev.hashes)
                for i, h in enumerate(ev.hashes):
                    self.tokens[h] = ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
            elif isinstance(ev, wire.Removed):
                self.media[ev.medium].difference_update(ev.hashes)
            else:
                self.media.clear()


def truth(eng: Any, ev: Any) -> dict[str, set[int]]:
    """Per medium, the blocks of every chunk a tier says it holds."""
    tracker = ev.publisher.tracker
    infos = {**tracker.seen, **tracker.held}
    out: dict[str, set[int]] = defaultdict(set)
    keys = list(infos)
    for level, tier in enumerate(eng.storage.tiers):
        medium = tracker.media[level]
        for k, present in zip(keys, tier.contains(keys)):
            if present and medium:
                out[medium].update(infos[k].hashes)
    return out


def settle(sub: Collector, model: Model, ev: Any) -> None:
    model.apply(sub.settle(ev.publisher))


def same(model: Model, want: dict[str, set[int]]) -> None:
    for medium in wire.MEDIA:
        assert model.media.get(medium, set()) == want.get(medium, set()), medium


def test_store_publishes_blocks_per_tier_parent_first(tmp_path):
    prompt = random_tokens(3 * CHUNK + 40, seed=1)  # 3 chunks and a tail of 2 blocks + 8
    with engine_with_events(tmp_path / "disk") as (eng, ev, caches):
        sub = Collector(ev.endpoint)
        store(eng, caches, prompt)
        events = sub.settle(ev.publisher)
        stored = [e for e in events if isinstance(e, wire.Stored)]
        for medium in (wire.CPU, wire.STORAGE):
            mine = [e for e in stored if e.medium == medium]
            assert [len(e.hashes) for e in mine] == [4, 4, 4, 2], medium
            parent = None
            at = 0
            for e in mine:
                assert e.parent == parent and e.block_size == BLOCK
                assert list(e.token_ids) == prompt[at:at + len(e.hashes) * BLOCK]
                assert all(0 <= h < 1 << 64 for h in e.hashes)
                parent, at = e.hashes[-1], at + len(e.hashes) * BLOCK
        cpu = [h for e in stored if e.medium == wire.CPU for h in e.hashes]
        assert len(set(cpu)) == 14  # one hash per block, all different
        assert {b[0] for b in sub.batches} == {b"kv@test-pod@tiny"}
        seqs = [b[1] for b in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        # the replay socket still holds seq 0, the start-up AllBlocksCleared
        frames = request(ev.replay_endpoint, [b"", wire.seq_bytes(0)])
        assert int.from_bytes(frames[0][2], "big") == 0
        assert wire.decode_batch(frames[0][3])[1] == [wire.Cleared()]
        assert frames[-1][2] == wire.END_SEQ and frames[-1][3] == b""
        sub.close()


def test_events_follow_evictions_promotions_deletes_clears(tmp_path):
    a = random_tokens(4 * CHUNK, seed=2)
    b = random_tokens(14 * CHUNK, seed=3)
    # a 64-token chunk is 24 KiB: the pool holds about ten, so storing b evicts a from L1
    with engine_with_events(tmp_path / "disk", pool="256KiB") as (eng, ev, caches):
        sub = Collector(ev.endpoint)
        model = Model()
        store(eng, caches, a)
        settle(sub, model, ev)
        same(model, truth(eng, ev))
        assert model.media[wire.CPU] and model.media[wire.STORAGE]
        store(eng, caches, b)
        settle(sub, model, ev)
        want = truth(eng, ev)
        same(model, want)
        a_keys = eng.db.keys(a)
        assert not any(eng.storage.l1.contains(a_keys)), "a should have left L1"
        # promotion: a is read back from disk into L1
        got = eng.retrieve(a, caches, torch.arange(len(a)))
        assert got == len(a)
        settle(sub, model, ev)
        same(model, truth(eng, ev))
        # a delete removes a's blocks from both media
        eng.storage.delete(a_keys)
        settle(sub, model, ev)
        same(model, truth(eng, ev))
        # clearing L1 leaves the disk's blocks announced
        eng.storage.clear_l1()
        settle(sub, model, ev)
        same(model, truth(eng, ev))
        assert not model.media[wire.CPU] and model.media[wire.STORAGE]
        # nothing left anywhere: a clear is AllBlocksCleared
        eng.storage.delete(eng.db.keys(b))
        settle(sub, model, ev)
        before = len(sub.batches)
        eng.storage.clear_l1()
        events = sub.settle(ev.publisher)
        assert wire.Cleared() in events, [type(e).__name__ for e in events]
        assert len(sub.batches) > before
        sub.close()


def test_shared_blocks_are_reference_counted(tmp_path):
    """A prompt's partial tail chunk and the full chunk that later covers it share engine
    blocks: deleting the tail chunk must not announce the shared blocks gone."""
    full = random_tokens(2 * CHUNK, seed=4)
    short = full[:CHUNK + 40]  # chunk 2 is a tail of 40 tokens: 2 whole blocks
    with engine_with_events(None) as (eng, ev, caches):
        sub = Collector(ev.endpoint)
        model = Model()
        store(eng, caches, short)
        store(eng, caches, full)
        settle(sub, model, ev)
        shared = [h for h, t in model.tokens.items() if t in (
            tuple(full[CHUNK:CHUNK + BLOCK]), tuple(full[CHUNK + BLOCK:CHUNK + 2 * BLOCK]))]
        assert len(shared) == 2 and set(shared) <= model.media[wire.CPU]
        tail_key = eng.db.keys(short)[-1]
        assert eng.storage.delete([tail_key]) == 1
        settle(sub, model, ev)
        assert set(shared) <= model.media[wire.CPU], "a block still held was announced gone"
        same(model, truth(eng, ev))
        eng.storage.delete([eng.db.keys(full)[-1]])
        settle(sub, model, ev)
        assert not set(shared) & model.media[wire.CPU]
        sub.close()


def test_a_full_queue_drops_counts_and_never_leaves_a_phantom_block(tmp_path):
    """With a queue of 4 items most events are dropped; what routers are then told is a
    subset of the truth (a removal lost is found by reconciling with the tiers)."""
    with engine_with_events(tmp_path / "disk", pool="256KiB", max_queue_size=4) as (
            eng, ev, caches):
        sub = Collector(ev.endpoint)
        model = Model()
        for seed in range(12):
            store(eng, caches, random_tokens(6 * CHUNK, seed=100 + seed))
        eng.storage.clear_l1()
        for _ in range(3):
            settle(sub, model, ev)
        stats = ev.stats()
        assert stats["kv_events.dropped"] > 0
        want = truth(eng, ev)
        for medium in wire.MEDIA:
            assert model.media.get(medium, set()) <= want.get(medium, set()), medium
        # a state dump is the truth again, whatever was dropped
        frames = request(ev.replay_endpoint, [b"", b"dump"])
        dumped = Model()
        for f in frames[:-1]:
            dumped.apply(wire.decode_batch(f[3])[1])
        for medium in wire.MEDIA:
            assert dumped.media.get(medium, set()) <= want.get(medium, set()), medium
        sub.close()


def test_events_observe_the_engines_own_token_database():
    """Events attach as an observer of the engine's token database, never by replacing it:
    a part of the engine that took ``engine.db`` before events were on (the hybrid cache, a
    worker's kept keys) keys prompts that are still published, and ``close`` detaches."""
    caches = make_caches("vllm_flash", blocks=64, block_size=BLOCK)
    eng = CacheEngine(CacheConfig(chunk_size=CHUNK, local_cpu_size="4MiB",
                                  local_cpu_prefault="off", pin_memory="false"),
                      spec_for("vllm_flash", caches), "events-test")
    db = eng.db
    ev = attach(eng, LOCAL)
    assert ev is not None
    try:
        assert eng.db is db and len(db.observers) == 1
        sub = Collector(ev.endpoint)
        prompt = random_tokens(2 * CHUNK, seed=7)
        keys = db.keys(prompt)  # through the reference taken before attach
        assert eng.store(prompt, caches, torch.arange(len(prompt)), keys=keys) == len(prompt)
        eng.flush()
        stored = [e for e in sub.settle(ev.publisher) if isinstance(e, wire.Stored)]
        assert [t for e in stored for t in e.token_ids] == prompt
        sub.close()
    finally:
        ev.close()
        eng.close()
    assert eng.db is db and db.observers == ()
