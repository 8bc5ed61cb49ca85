"""The router's subscription against a real engine's publisher: a router that starts late is
synced by a dump; a gap is filled from the replay buffer; a gap older than the buffer is
healed by a dump; whatever the path, the router's index scores a prompt exactly as the
engine's tiers hold it. And the policy's arithmetic: medium weights against load."""

from __future__ import annotations

import time

import pytest

from lmc.events import wire
from lmc.router.feed import EventFeed, Source
from lmc.router.index import Match, PrefixIndex, block_keys
from lmc.router.policy import Candidate, Weights, choose
from tests.deadlines import HANG_S
from tests.events.helpers import BLOCK, CHUNK, engine_with_events, request, store
from tests.kvutil import random_tokens
from tests.router.helpers import free_port


def replayed(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    frames = request(endpoint, [b"", wire.seq_bytes(start)])
    return [(int.from_bytes(f[2], "big"), f[3]) for f in frames[:-1]]


def cached_blocks(src: Source, prompt: list[int]) -> Match:
    return src.index.match(block_keys(prompt, BLOCK))


def drive(feed: EventFeed, done, timeout: float = 20.0) -> None:
    """Run the feed's loop (its thread's body) here until ``done()``."""
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, [s.counts for s in feed.sources]
        feed.step(20)


@pytest.mark.parametrize("buffer", [10_000, 2])
def test_late_start_gaps_and_lost_history_all_end_in_the_true_index(tmp_path, buffer):
    a = random_tokens(4 * CHUNK, seed=31)
    b = random_tokens(3 * CHUNK, seed=32)
    c = random_tokens(2 * CHUNK, seed=33)
    with engine_with_events(tmp_path / "disk", buffer_steps=buffer, heartbeat=60) as (
            eng, ev, caches):
        store(eng, caches, a)  # before any router exists
        time.sleep(0.3)
        # PUB from a port nothing publishes on: the test hands it batches (some "lost")
        src = Source("engine", f"tcp://127.0.0.1:{free_port()}", ev.replay_endpoint, 1 << 16)
        feed = EventFeed([src])
        sync = feed.syncs[id(src)]
        try:
            drive(feed, lambda: src.synced)
            assert cached_blocks(src, a) == Match(0, 16, 16, BLOCK)
            start = src.next_seq
            for step in (lambda: store(eng, caches, b), lambda: store(eng, caches, c),
                         eng.storage.clear_l1):
                seq = ev.publisher.stats()["seq"]
                step()
                end = time.monotonic() + HANG_S
                # each its own batch: sent, and nothing left queued for the next one
                while (st := ev.publisher.stats())["seq"] == seq or st["queued"]:
                    assert time.monotonic() < end, "the step's events were never published"
                    time.sleep(0.01)
            later = replayed(ev.replay_endpoint, 0)
            newest = later[-1]
            assert newest[0] > start + 1  # batches start..newest-1 "were lost"
            time.sleep(1.0)  # the publisher answers one dump per second
            feed.on_message(src, [b"t", wire.seq_bytes(newest[0]), newest[1]])
            drive(feed, lambda: sync.request is None and src.synced
                  and src.next_seq == newest[0] + 1)
            if buffer == 2:
                assert src.counts["dumps"] == 2  # the replay could not fill it
            else:
                assert src.counts["replays"] == 1 and src.counts["dumps"] == 1
            for prompt in (a, b, c):  # L1 cleared: everything is on disk only
                n = len(prompt) // BLOCK
                assert cached_blocks(src, prompt) == Match(0, 0, n, BLOCK)
        finally:
            feed.close()


def idx(*stores: tuple[list[int], str]) -> PrefixIndex:
    i = PrefixIndex()
    for n, (tokens, medium) in enumerate(stores):
        hashes = [1000 * (n + 1) + j for j in range(len(tokens) // 4)]
        i.stored(wire.Stored(tuple(hashes), None, tuple(tokens), 4, medium))
    return i


def test_medium_weights_and_load_decide_between_instances():
    prompt = list(range(64))  # 16 blocks of 4
    keys = block_keys(prompt, 4)
    gpu = idx((prompt[:32], wire.GPU)).match(keys)       # 8 blocks in GPU
    cpu = idx((prompt[:48], wire.CPU)).match(keys)       # 12 in CPU
    disk = idx((prompt, wire.STORAGE)).match(keys)       # 16 on disk
    assert (gpu.gpu, gpu.cpu, gpu.storage) == (8, 8, 8)
    assert (cpu.gpu, cpu.cpu, cpu.storage) == (0, 12, 12)
    assert (disk.gpu, disk.cpu, disk.storage) == (0, 0, 16)
    w = Weights(gpu=1.0, cpu=0.8, storage=0.5, load=10)
    assert [w.credit(m) for m in (gpu, cpu, disk)] == [32.0, pytest.approx(38.4), 32.0]
    cands = [Candidate(0, gpu), Candidate(0, cpu), Candidate(0, disk)]
    c = choose(cands, 64, w, 0, "prefix")
    assert (c.index, c.reason) == (1, "prefix")
    # two requests in flight cost 20 tokens: more than CPU's 6.4-token lead
    cands[1].in_flight = 2
    assert choose(cands, 64, w, 0, "prefix").index == 0
    # storage counts at full weight: the whole prompt on disk wins
    assert choose(cands, 64, Weights(1, 0.8, 1.0, 10), 0, "prefix").index == 2
    # stale everywhere: least loaded, in turn among equals
    stale = [Candidate(1, None), Candidate(0, None), Candidate(0, None)]
    assert [choose(stale, 64, w, t, "prefix").index for t in range(3)] == [1, 1, 2]
    assert choose(stale, 64, w, 0, "prefix").reason == "stale"
    assert [choose(cands, 64, w, t, "round_robin").index for t in range(4)] == [0, 1, 2, 0]


def test_a_restart_seen_both_by_its_seq_and_its_reconnection_is_synced_once(tmp_path):
    """A publisher restarted behind the same endpoint shows twice: its SUB connection drops
    and comes back, and its batches are numbered from 0 again (at or below the last seq
    seen). Whichever the feed sees first syncs the source anew; the other is the same restart
    and must not sync it again (the source would go unscored for another dump, or for
    ``RETRY`` seconds when that dump is refused as the second within a second)."""
    with engine_with_events(tmp_path / "disk", heartbeat=60) as (eng, ev, caches):
        store(eng, caches, random_tokens(2 * CHUNK, seed=41))
        src = Source("engine", f"tcp://127.0.0.1:{free_port()}", ev.replay_endpoint, 1 << 16)
        feed = EventFeed([src])
        sync = feed.syncs[id(src)]
        try:
            drive(feed, lambda: src.synced, timeout=HANG_S)
            assert src.next_seq is not None
            old = src.next_seq - 1  # a batch the dump covered: applying it changes nothing

            def batch(seq: int) -> list[bytes]:
                return [b"t", wire.seq_bytes(seq), wire.encode_batch([])]

            # the reconnection first, then the restarted publisher's batches (seq <= last)
            src.last_pub = old + 40
            feed.on_connection(src, connected=False)
            feed.on_connection(src, connected=True)
            assert src.counts["reconnects"] == 1 and not src.synced
            feed.on_message(src, batch(old))
            drive(feed, lambda: sync.request is None and src.synced, timeout=HANG_S)
            feed.on_message(src, batch(old + 1))  # the new publisher's next one
            assert src.counts["restarts"] == 0 and src.synced, src.counts
            # the batches first, then the reconnection's event
            src.last_pub = old + 40
            feed.on_connection(src, connected=False)
            feed.on_message(src, batch(old))
            asked = sync.request
            assert src.counts["restarts"] == 1 and asked is not None and not src.synced
            feed.on_connection(src, connected=True)
            assert src.counts["reconnects"] == 1 and sync.request is asked, src.counts
            drive(feed, lambda: sync.request is None and src.synced, timeout=HANG_S)
            # a new connection whose drop went unseen (no event for it): a reconnection too
            src.last_pub = old + 40
            feed.on_connection(src, connected=True)
            assert src.counts["reconnects"] == 2 and not src.synced, src.counts
        finally:
            feed.close()
