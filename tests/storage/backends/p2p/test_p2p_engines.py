"""Two engine processes sharing KV over NIXL: one stores, the other misses locally and READs
the chunks from the first's pool, bit-exact; an owner killed around a transfer, a chunk
evicted mid-read and a stale directory entry are misses, never wrong KV.

The processes are shared by the module's tests (each takes seconds to start); every test
uses its own prompt (seed), so none sees another's chunks. Threat model:
``docs/threats/p2p.md``."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

pytestmark = pytest.mark.integration
N = 100  # six full chunks of 16 tokens and a partial one
BYTES = N * 4 * 2 * 2 * 64 * 2  # tokens x layers x K,V x heads x dim x bf16


def _clean_miss(r: dict) -> None:
    """Nothing loaded, nothing written into the reader's cache, the engine still answering."""
    assert r["retrieved"] == 0 and r["untouched"] and r["bit_exact"], r


def _delta(before: dict, after: dict) -> dict:
    return {k: after["p2p"][k] - before["p2p"][k] for k in
            ("hits", "bytes_in", "stale", "transfer_failures")}


def test_reader_pulls_owner_chunks_bit_exact(owner, reader):
    assert owner("store", seed=11, n=N) == {"stored": N, "flushed": True, "exports": 7}
    before = reader("load", seed=999, n=16)  # nobody has it: a plain miss
    assert before["lookup"] == 0 and before["untouched"]
    r = reader("load", seed=11, n=N)
    assert r["lookup"] == N and r["retrieved"] == N and r["bit_exact"] and r["untouched"], r
    assert _delta(before, r) == {"hits": 7, "bytes_in": BYTES, "stale": 0,
                                 "transfer_failures": 0}
    # promoted into the reader's L1: the next load asks no peer
    assert _delta(r, reader("load", seed=11, n=N))["hits"] == 0
    # the owner's own lookup never asks itself
    assert owner("load", seed=11, n=N)["p2p"]["hits"] == 0


def test_owner_killed_around_the_read_is_a_miss(directory, reader):
    """SIGKILL the owner right before the payload READ, or after it and before the version
    check: misses, no crash; the dead owner's records leave the directory with its socket."""
    doomed = dict(zip(("before", "after"), directory.engines(2)))
    for seed, (when, owner) in enumerate(doomed.items(), 12):
        owner("store", seed=seed, n=N)
        reader("arm", when=when, action="kill", pid=owner.pid)
        r = reader("load", seed=seed, n=N)
        _clean_miss(r)
        assert r["p2p"]["transfer_failures"] >= 1, (when, r)
        for _ in range(50):  # the daemon drops the records once it sees the socket close
            again = reader("load", seed=seed, n=N)
            _clean_miss(again)
            if again["lookup"] == 0:
                break
            time.sleep(0.1)
        assert again["lookup"] == 0, (when, again)


def test_reader_still_pulls_after_a_peer_died(owner, reader):
    owner("store", seed=14, n=N)
    r = reader("load", seed=14, n=N)
    assert r["retrieved"] == N and r["bit_exact"], r


def test_chunk_evicted_mid_read_is_a_miss(owner, reader):
    """The owner drops the chunks and reuses their memory after the payload READ, before the
    version check: the READ brought whatever was there; the cleared version rejects it."""
    owner("store", seed=15, n=N)
    before = reader("stats")
    reader("arm", when="after", action="signal", pid=owner.pid)
    r = reader("load", seed=15, n=N)
    _clean_miss(r)
    assert r["p2p"]["stale"] - before["stale"] == 7, r
    assert r["p2p"]["transfer_failures"] == before["transfer_failures"], r
    assert reader("load", seed=15, n=N)["lookup"] == 0  # withdrawn from the directory
    owner("store", seed=15, n=N)  # stored again: found and pulled again
    assert reader("load", seed=15, n=N)["retrieved"] == N


def test_stale_directory_entry_is_a_miss(owner, reader):
    """The owner let its chunks go and reused the memory, but its withdraw never reached the
    directory: readers find records, READ other KV, and the version check refuses it."""
    owner("store", seed=16, n=N)
    assert owner("forget", seed=16, n=N)["forgotten"] == 7
    before = reader("stats")
    r = reader("load", seed=16, n=N)
    assert r["lookup"] == N, r  # the directory still says so
    _clean_miss(r)
    assert r["p2p"]["stale"] - before["stale"] == 7, r


def test_stopped_owner_still_serves_its_exports(owner, reader):
    """A SIGSTOPped owner: one host's READs go through the kernel (UCX's ``cma``), not the
    owner's CPU, and its exports are still pinned: the pull completes, bit-exact."""
    owner("store", seed=17, n=N)
    os.kill(owner.pid, signal.SIGSTOP)
    try:
        r = reader("load", seed=17, n=N)
    finally:
        os.kill(owner.pid, signal.SIGCONT)
    assert r["retrieved"] == N and r["bit_exact"], r


def test_hung_directory_is_a_miss_within_the_deadline(directory, owner, reader):
    """The daemon stops answering (SIGSTOP): lookups are misses within ``remote_timeout``
    (2 s here), then mostly refused at once by the breaker; it comes back by itself after
    SIGCONT."""
    owner("store", seed=18, n=N)
    pid = directory.daemon.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(4):
            r = reader("load", seed=18, n=N)
            _clean_miss(r)
            # lookup and retrieve each ask at most once: two timeouts, plus a loaded machine
            assert r["seconds"] < 2 * 2.0 + 3.0, r
        # after three failures the breaker refuses calls at once (a probe now and then)
        assert r["p2p"]["breaker_trips"] >= 1 and r["p2p"]["breaker_rejected"] >= 1, r
    finally:
        os.kill(pid, signal.SIGCONT)
    for _ in range(100):  # the breaker's probe finds it answering again
        r = reader("load", seed=18, n=N)
        if r["retrieved"] == N:
            break
        time.sleep(0.2)
    assert r["retrieved"] == N and r["bit_exact"], r


def test_reads_racing_owner_churn_are_exact_or_misses(owner, reader):
    """The owner stores and evicts a few prompts at random (freed memory reused for other KV
    at once) while the reader keeps pulling them, forgetting each locally after: every token
    a load returns is bit-exact, every other one untouched. Whatever the interleaving."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    prompts = list(range(40, 46))
    before = reader("stats")
    owner("churn", seconds=6.0, seeds=prompts, n=N, rng_seed=seed)
    loads = hits = 0
    end = time.monotonic() + 6.0
    while time.monotonic() < end:
        p = rng.choice(prompts)
        r = reader("load", seed=p, n=N)
        assert r["bit_exact"] and r["untouched"], (seed, p, r)
        loads += 1
        hits += r["retrieved"] > 0
        reader("drop", seed=p, n=N)
    churned = owner("churn_wait")
    after = reader("stats")
    print(f"{loads} loads, {hits} with hits, owner {churned}, reader "
          f"stale +{after['stale'] - before['stale']}, "
          f"hits +{after['hits'] - before['hits']}")
    assert loads >= 3 and churned["stored"] >= 1, (seed, loads, churned)
