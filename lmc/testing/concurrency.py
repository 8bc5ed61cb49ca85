"""Threads: callers at once, a value never visible before it is complete, ``close()`` racing
calls (every call returns, none raises; misses and 0 after it)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

import torch

from lmc.storage.tier import Key, StorageBackend
from lmc.testing.harness import (
    SHAPE,
    SMALL_POOL_BYTES,
    TierHarness,
    TierSpec,
    check_hit,
    fill,
    get_checked,
    key_of,
    release,
    seeded,
)


class ConcurrencyContract(TierHarness):
    """Thread safety and ``close()``: every tier passes these."""

    def test_concurrent_readers_and_writers(self, make_tier, tier_spec):
        """Four threads put, get, ask and delete over a shared key space larger than a small
        pool: every hit is right, no call raises, and no reference is lost."""
        tier = make_tier(2 * SMALL_POOL_BYTES)
        rng = seeded("test_concurrent_readers_and_writers")
        keys = [key_of(f"conc{i}") for i in range(48)]
        seeds = [rng.randrange(2**32) for _ in range(4)]
        errors: list[str] = []
        ops = 60

        def work(seed: int) -> None:
            r = random.Random(seed)
            try:
                for _ in range(ops):
                    batch = [r.choice(keys) for _ in range(r.randint(1, 4))]
                    op = r.random()
                    if op < 0.4:
                        objs = self.chunks(tier, tier_spec, batch)
                        try:
                            n = tier.put(batch[: len(objs)], objs)
                            assert 0 <= n <= len(objs), f"put of {len(objs)} returned {n}"
                        finally:
                            release(objs)
                    elif op < 0.8:
                        get_checked(tier, batch, misses=True)
                    elif op < 0.93:
                        assert len(tier.contains(batch)) == len(batch)
                    else:
                        assert 0 <= tier.delete(batch) <= len(batch)
            except BaseException as e:  # reported with the thread's seed
                errors.append(f"thread seed {seed}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a tier call hung under concurrency"
        assert not errors, "\n".join(errors)
        self.store(tier, tier_spec, keys[:2])  # still serves after the storm
        get_checked(tier, keys[:2])

    def test_no_value_is_visible_before_it_is_complete(self, tier, tier_spec):
        """Two readers ask for 192 KiB values while a writer stores and deletes them over and
        over: a hit is always the whole value, never a torn or half-written one."""
        shape = (2, 2, 96, 256)  # 192 KiB of float16: many socket reads, several disk pages
        keys = [key_of(f"visible{i}") for i in range(2)]
        stop = threading.Event()
        errors: list[str] = []
        hits = [0]

        def read() -> None:
            try:
                while not stop.is_set():
                    got = tier.get(keys)
                    try:
                        for k, o in zip(keys, got):
                            if o is not None:
                                check_hit(o, k, shape)
                                hits[0] += 1
                    finally:
                        release(got)
                    assert len(tier.contains(keys)) == 2
            except BaseException as e:
                errors.append(f"reader: {type(e).__name__}: {e}")

        readers = [threading.Thread(target=read, daemon=True) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            for _ in range(12):
                objs = self.chunks(tier, tier_spec, keys, shape)
                try:
                    tier.put(keys[: len(objs)], objs)
                finally:
                    release(objs)
                time.sleep(0.005)
                tier.delete(keys[:1])
        finally:
            stop.set()
            for t in readers:
                t.join(30)
        assert not any(t.is_alive() for t in readers), "a reader hung"
        assert not errors, "\n".join(errors)
        assert hits[0] > 0, "no reader ever saw a value: the test proved nothing"

    def test_close_with_work_in_flight(self, make_tier, tier_spec):
        """``close()`` while three threads call the tier with batches of up to 12 keys (split
        over connections or threads by remote tiers), and go on calling after it: every
        call returns (misses or right bytes), none raises or hangs, and the pool gets all its
        memory back. Several rounds, each closing at a random moment (seed printed)."""
        rng = seeded("test_close_with_work_in_flight")
        keys = [key_of(f"close{i}") for i in range(16)]
        before = 0
        for _ in range(4):
            tier = make_tier(fresh_pool=True)
            self.store(tier, tier_spec, keys[:8])
            before += self._close_during_calls(tier, tier_spec, keys, rng)
            assert self.used(tier) == 0, "memory still held once every caller released"
        assert before > 0, "no call completed before close(): the test proved nothing"

    def _close_during_calls(self, tier: StorageBackend, spec: TierSpec, keys: Sequence[Key],
                            rng: random.Random) -> int:
        """One round; returns how many calls completed before ``close()``."""
        stop, closed = threading.Event(), threading.Event()
        errors: list[str] = []
        calls = [0, 0]  # before, after close

        def work(seed: int) -> None:
            r = random.Random(seed)
            while not stop.is_set():
                batch = [r.choice(keys) for _ in range(r.randint(1, 12))]
                try:
                    if r.random() < 0.6:
                        get_checked(tier, batch, misses=True)
                    else:
                        objs = self.chunks(tier, spec, batch)
                        try:
                            tier.put(batch[: len(objs)], objs)
                        finally:
                            release(objs)
                    assert len(tier.contains(batch)) == len(batch)
                except BaseException as e:
                    errors.append(f"{'after' if closed.is_set() else 'before'} close: "
                                  f"{type(e).__name__}: {e}")
                    return
                calls[closed.is_set()] += 1

        threads = [threading.Thread(target=work, args=(rng.randrange(2**32),), daemon=True)
                   for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.02, 0.12))
        t0 = time.monotonic()
        tier.close()
        closed.set()
        took = time.monotonic() - t0
        time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(spec.deadline + 10)
        assert not any(t.is_alive() for t in threads), "a call racing close() never returned"
        assert not errors, "\n".join(errors)
        assert took < spec.deadline + 10, f"close() took {took:.1f} s"
        tier.close()  # again: a no-op
        # a closed tier answers misses and changes nothing (its directory or namespace may
        # already belong to the next tier)
        assert tier.contains(keys) == [False] * len(keys), "contains() after close()"
        assert tier.prefix_hits(keys) == 0 and tier.get(keys) == [None] * len(keys)
        assert tier.delete(keys) == 0, "delete() after close()"
        late = [key_of("after-close")]
        objs = [fill(o, late[0]) for o in tier.pool.allocate_many(  # type: ignore[attr-defined]
            SHAPE, torch.float16, 1, SHAPE[2])]
        try:
            assert tier.put(late, objs) == 0, "put() after close() stored something"
        finally:
            release(objs)
        assert tier.contains(late) == [False]
        return calls[0]
