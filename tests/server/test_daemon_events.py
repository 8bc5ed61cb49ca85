"""The daemon publishes KV events for what it holds: a real ``lmc server`` process with
``kv_events`` on, a real ``CacheEngine`` whose ``lmc://`` tier sends block info with its
PUTs, and a ZMQ subscriber decoding with lmc's wire decoder (and the router's index)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmc import CacheConfig
from lmc.cache_engine import CacheEngine
from lmc.events import wire
from lmc.events.notes import bind
from lmc.router.index import PrefixIndex
from lmc.router.policy import PromptKeys
from tests.events.helpers import Collector, replay_flood, request
from tests.kvutil import make_caches, random_tokens, spec_for
from tests.server.daemon_proc import DaemonProc

CHUNK = 64
BLOCK = 16
EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
          "replay_endpoint": "tcp://127.0.0.1:*", "block_size": BLOCK, "heartbeat": 0.3}


def start(tmp: Path, *flags: str, events: dict[str, Any] | None = None) -> DaemonProc:
    ev = {**EVENTS, **(events or {})}
    return DaemonProc(tmp, ["--size", "64MiB", "--kv-events", json.dumps(ev), *flags]).start()


def endpoints(d: DaemonProc) -> tuple[str, str]:
    ev = d.info["kv_events"]
    return ev["endpoint"], ev["replay_endpoint"]


@contextlib.contextmanager
def engine(url: str, ns: str = "lmc", notes: bool = True, pool: str = "4MiB",
           wrapped: bool = False, lookup_first: bool = True
           ) -> Iterator[tuple[CacheEngine, Any]]:
    """A CPU engine (chunk 64, block 16: 24 KiB a chunk) whose remote tier is the daemon
    (``wrapped``: inside a counting wrapper tier; ``lookup_first``: a lookup opens the
    tier's first connection before the test stores)."""
    caches = make_caches("vllm_flash", blocks=256, block_size=BLOCK)
    where: dict[str, Any] = {"remote_url": f"{url}?ns={ns}"}
    if wrapped:
        where = {"tiers": ["memory", {"wrap": "counting", "tier": f"{url}?ns={ns}"}]}
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size=pool, local_cpu_prefault="off",
                      pin_memory="false", **where)
    eng = CacheEngine(cfg, spec_for("vllm_flash", caches), "daemon-events-test")
    try:
        if notes:
            assert bind(eng) is not None  # bound by the engine already: the same notes
        else:  # an lmc before block info: its tier has no notes to send
            eng.storage.tiers[-1].block_notes = None
        if lookup_first:
            eng.lookup(random_tokens(CHUNK, seed=999))  # connects: HELLO says events are on
        yield eng, caches
    finally:
        eng.close()


def store(eng: CacheEngine, caches: Any, tokens: list[int]) -> None:
    eng.store(tokens, caches, torch.arange(len(tokens)))
    eng.flush()


def stored(evs: list[wire.Event], medium: str | None = None) -> list[wire.Stored]:
    return [e for e in evs if isinstance(e, wire.Stored) and medium in (None, e.medium)]


def wait_for(sub: Collector, pred, timeout: float = 10.0) -> list[wire.Event]:
    got: list[wire.Event] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got += sub.events(wait=0.5)
        if pred(got):
            return got
    return got


def cached(index: PrefixIndex, tokens: list[int], ns: str) -> tuple[int, int, int]:
    m = index.match(PromptKeys(tokens, None, ns).at(BLOCK))
    return m.gpu * BLOCK, m.cpu * BLOCK, m.storage * BLOCK


def test_stored_chunks_are_published_with_blocks_the_daemon_derived(tmp_path):
    d = start(tmp_path / "d")
    try:
        ep, rep = endpoints(d)
        sub = Collector(ep)
        with engine(d.url) as (eng, caches):
            prompt = random_tokens(3 * CHUNK + 10, seed=1)  # 3 full chunks and a tail
            store(eng, caches, prompt)
            got = wait_for(sub, lambda g: len(stored(g)) >= 4)
        ev = stored(got, wire.CPU)
        assert [len(e.hashes) for e in ev] == [4, 4, 4], ev  # the tail's partial block: none
        assert ev[0].parent is None and ev[1].parent == ev[0].hashes[-1] \
            and ev[2].parent == ev[1].hashes[-1]
        assert [t for e in ev for t in e.token_ids] == prompt[:3 * CHUNK]
        assert all(e.block_size == BLOCK and e.cache_salt == "lmc" for e in ev)
        assert len({h for e in ev for h in e.hashes}) == 12
        index = PrefixIndex()
        index.apply(got)
        assert cached(index, prompt, "lmc") == (0, 3 * CHUNK, 3 * CHUNK)
        assert cached(index, prompt, "other") == (0, 0, 0)  # the namespace is the salt
        # a router that joins now gets the same from the state dump
        frames = request(rep, [b"", b"dump"])
        dumped = [e for f in frames[:-1] for e in wire.decode_batch(f[3])[1]]
        assert isinstance(dumped[0], wire.Cleared)
        assert [e.hashes for e in stored(dumped)] == [e.hashes for e in ev]
        sub.close()
        st = d.stats()
        assert st["kv_events"]["kv_events.refused"] == 0
    finally:
        d.kill()


def test_a_store_before_any_lookup_is_published(tmp_path):
    """The tier's first connection (and the HELLO that says the daemon publishes) is opened
    by the write-behind PUT of chunks keyed before it: they are published all the same."""
    d = start(tmp_path / "d")
    try:
        sub = Collector(endpoints(d)[0])
        with engine(d.url, lookup_first=False) as (eng, caches):
            assert not eng.storage.tiers[-1]._idle  # no connection yet
            prompt = random_tokens(2 * CHUNK, seed=6)
            store(eng, caches, prompt)
            got = wait_for(sub, lambda g: len(stored(g)) >= 2)
        assert [t for e in stored(got) for t in e.token_ids] == prompt
        sub.close()
        assert d.stats()["kv_events"]["kv_events.no_info"] == 0
    finally:
        d.kill()


def test_removed_on_eviction_and_delete_stays_on_disk(tmp_path):
    # a 2 MiB pool holds ~80 chunks of 24 KiB: 40 prompts of 2 chunks evict the first ones
    d = start(tmp_path / "d", "--size", "2MiB", "--disk", str(tmp_path / "disk"),
              "--disk-size", "64MiB")
    try:
        ep, _ = endpoints(d)
        sub = Collector(ep)
        with engine(d.url, pool="8MiB") as (eng, caches):
            first = random_tokens(2 * CHUNK, seed=100)
            store(eng, caches, first)
            got = wait_for(sub, lambda g: len(stored(g, wire.STORAGE)) >= 2)
            index = PrefixIndex()
            index.apply(got)
            assert cached(index, first, "lmc") == (0, 2 * CHUNK, 2 * CHUNK)
            for i in range(60):
                store(eng, caches, random_tokens(2 * CHUNK, seed=200 + i))
            got = wait_for(sub, lambda g: any(isinstance(e, wire.Removed) for e in g)
                           and len(stored(g, wire.STORAGE)) >= 120, timeout=20)
            index.apply(got)
            removed = [e for e in got if isinstance(e, wire.Removed)]
            assert removed and all(e.medium == wire.CPU for e in removed)
            # evicted from the daemon's memory, still on its disk
            assert cached(index, first, "lmc") == (0, 0, 2 * CHUNK)
            # a delete takes every copy: gone from the router's view
            eng.storage.tiers[-1].delete(eng.db.keys(first))
            got = wait_for(sub, lambda g: any(isinstance(e, wire.Removed)
                                              and e.medium == wire.STORAGE for e in g))
            index.apply(got)
            assert cached(index, first, "lmc") == (0, 0, 0)
        sub.close()
    finally:
        d.kill()


def test_a_clear_is_published_and_spares_other_namespaces(tmp_path):
    """``CacheEngine.clear()`` sends CLEAR for its namespace: the daemon publishes every block
    of it as removed (memory and disk), and another namespace's blocks stay published."""
    d = start(tmp_path / "d", "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB")
    try:
        sub = Collector(endpoints(d)[0])
        index = PrefixIndex()
        with engine(d.url, ns="mine") as (eng, caches), \
                engine(d.url, ns="theirs") as (other, other_caches):
            prompt = random_tokens(2 * CHUNK, seed=300)
            store(eng, caches, prompt)
            store(other, other_caches, prompt)
            got = wait_for(sub, lambda g: len(stored(g, wire.STORAGE)) >= 4)
            index.apply(got)
            assert cached(index, prompt, "mine") == (0, 2 * CHUNK, 2 * CHUNK)
            assert cached(index, prompt, "theirs") == (0, 2 * CHUNK, 2 * CHUNK)
            eng.clear()
            got = wait_for(sub, lambda g: {e.medium for e in g if isinstance(e, wire.Removed)}
                           >= {wire.CPU, wire.STORAGE})
            index.apply(got)
            assert cached(index, prompt, "mine") == (0, 0, 0), got
            assert cached(index, prompt, "theirs") == (0, 2 * CHUNK, 2 * CHUNK)
        sub.close()
    finally:
        d.kill()


def test_a_wrapped_lmc_tier_sends_block_info_too(tmp_path):
    d = start(tmp_path / "d")
    try:
        sub = Collector(endpoints(d)[0])
        with engine(d.url, wrapped=True) as (eng, caches):
            assert type(eng.storage.tiers[-1]).__name__ == "CountingTier"
            prompt = random_tokens(2 * CHUNK, seed=5)
            store(eng, caches, prompt)
            got = wait_for(sub, lambda g: len(stored(g)) >= 2)
        assert [t for e in stored(got) for t in e.token_ids] == prompt
        sub.close()
    finally:
        d.kill()


def test_an_old_client_is_stored_and_not_published(tmp_path):
    d = start(tmp_path / "d")
    try:
        ep, _ = endpoints(d)
        sub = Collector(ep)
        with engine(d.url, notes=False) as (eng, caches):
            prompt = random_tokens(2 * CHUNK, seed=3)
            store(eng, caches, prompt)
            assert eng.storage.tiers[-1].contains(eng.db.keys(prompt)) == [True, True]
        assert not stored(sub.events(wait=1.0))
        sub.close()
        assert d.stats()["kv_events"]["kv_events.no_info"] >= 2
    finally:
        d.kill()


def test_off_by_default_and_the_put_is_unchanged(tmp_path):
    d = DaemonProc(tmp_path / "d", ["--size", "64MiB"]).start()
    try:
        assert d.info["kv_events"] is None
        with engine(d.url) as (eng, caches):
            tier = eng.storage.tiers[-1]
            conn = tier._acquire()
            try:
                assert conn.kv_events is None
            finally:
                tier._release(conn, True)
            prompt = random_tokens(2 * CHUNK, seed=4)
            store(eng, caches, prompt)
            assert tier.contains(eng.db.keys(prompt)) == [True, True]
            (notes,) = eng.db.observers  # the tier's block notes observe the engine's keys
            assert not notes.active and len(notes) == 0  # nothing noted
        assert "kv_events" not in d.stats()
    finally:
        d.kill()


def test_bad_config_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="kv_events.*block_size"):
        DaemonProc(tmp_path / "d", ["--size", "64MiB", "--kv-events",
                                    json.dumps({**EVENTS, "block_size": -1})]).start()


def test_removed_when_a_quota_takes_a_namespaces_oldest_chunks(tmp_path):
    d = start(tmp_path / "d", "--quota", "lmc=256KiB")  # ~10 chunks of 24 KiB
    try:
        ep, _ = endpoints(d)
        sub = Collector(ep)
        with engine(d.url, pool="8MiB") as (eng, caches):
            first = random_tokens(2 * CHUNK, seed=60)
            store(eng, caches, first)
            for i in range(10):
                store(eng, caches, random_tokens(2 * CHUNK, seed=61 + i))
            got = wait_for(sub, lambda g: any(isinstance(e, wire.Removed) for e in g))
        index = PrefixIndex()
        index.apply(got)
        assert any(isinstance(e, wire.Removed) and e.medium == wire.CPU for e in got)
        assert cached(index, first, "lmc") == (0, 0, 0)  # the quota took it: not routed
        sub.close()
    finally:
        d.kill()


def test_a_replay_flood_holds_the_daemon_within_its_byte_budget(tmp_path):
    """Sixteen peers ask the daemon's replay socket for everything every 10 ms and never
    read (the issue's: +435 MiB on a 64 MiB daemon): what the bound counts stays within
    ``replay_max_bytes`` and the daemon's RSS barely moves; it then answers a replay whole."""
    budget = 4 << 20
    d = start(tmp_path / "d", events={"buffer_steps": 2000, "replay_max_bytes": budget})
    try:
        _, rep = endpoints(d)
        with engine(d.url, pool="8MiB") as (eng, caches):
            for seed in range(100):  # ~100 batches of ~5 KB in the daemon's replay buffer
                store(eng, caches, random_tokens(16 * CHUNK, seed=3000 + seed))
        end = time.monotonic() + 20
        while d.stats()["kv_events"]["kv_events.queued"] and time.monotonic() < end:
            time.sleep(0.1)
        before = d.rss()
        peak = replay_flood(rep, peers=16, seconds=6.0, interval=0.01, sample=d.rss)
        ev = d.stats()["kv_events"]
        grew = (peak - before) >> 20
        print(f"daemon replay flood: RSS +{grew} MiB, replies held at most "
              f"{ev['kv_events.replay_bytes_peak'] >> 10} KiB (bound {budget >> 10} KiB)")
        assert ev["kv_events.replay_bytes_peak"] <= budget + (64 << 10)
        assert ev["kv_events.replay_limited"] > 0
        assert grew < 48, f"the daemon's RSS grew {grew} MiB under the flood"  # 160 before
        got = request(rep, [b"", wire.seq_bytes(0)], timeout=30.0)  # every batch so far
        assert got[-1][2] == wire.END_SEQ and got[-1][3] == b""
        assert len(got) - 1 >= ev["kv_events.seq"]
    finally:
        d.kill()


def test_chunk_notes_are_bounded_copies():
    import gc
    import weakref

    import xxhash

    from lmc.events.notes import ChunkNotes
    from lmc.token_database import ChunkedTokenDatabase

    ns = b"\x05" * 16
    db = ChunkedTokenDatabase(CHUNK, True, ns)
    notes = ChunkNotes(ns, CHUNK, BLOCK, max_chunks=8)
    notes.activate()
    prompt = torch.tensor(random_tokens(3 * CHUNK + 5, seed=70))
    keys = db.keys(prompt)
    notes.note(prompt, keys, len(prompt))
    ref = weakref.ref(prompt)
    items = notes.items(keys)
    del prompt
    gc.collect()
    assert ref() is None  # the notes hold copies, not the prompt
    for i, (prev, toks, start) in enumerate(items):  # each one describes its chunk exactly
        assert start == i * CHUNK and xxhash.xxh3_128_digest(prev + toks) == keys[i]
    assert len(items[-1][1]) == 5 * 4
    for s in range(20):
        notes.note(random_tokens(CHUNK, seed=80 + s), db.keys(random_tokens(CHUNK, seed=80 + s)),
                   CHUNK)
    assert len(notes) == 8 and notes.items(keys) == [None] * 4  # oldest forgotten
