"""Model-based test of the memory pool and its TLSF allocator: random allocate /
allocate_many / acquire / release sequences over a tiny pool with mixed sizes (so it
fragments), checked after every step against a plain model of the live objects.

After each step: every live object's tensor starts at ``buffer + offset`` and spans its
bytes; blocks lie inside the pool and never overlap; the pool's byte count equals the sum of
live blocks; and every live object still holds the bytes written into it at allocation
(through its own view) -- read back through an independent view of the buffer. A view built
on a wrong offset, a block handed out twice or freed early all fail here.
"""

from __future__ import annotations

import random

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from lmc.memory.pool import MemoryPool
from tests.core.model_kv import scaled

UNIT = 4096
POOL_UNITS = 12
# sizes in bytes: whole units, odd sizes that round up, sub-unit objects
# Mostly whole units (a batch of exact-size blocks is what gets carved from holes when no
# free block fits it), some sizes that round up, some below one unit.
SIZES = st.sampled_from([UNIT] * 8 + [2 * UNIT] * 3 + [3 * UNIT] * 2
                        + [4, 100, UNIT + 4, 3 * UNIT - 8])


class Live:
    """One object the model knows about: its pool object, references held, and its stamp."""

    def __init__(self, obj, stamp: int) -> None:
        self.obj = obj
        self.refs = 1
        self.stamp = stamp


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = MemoryPool(POOL_UNITS * UNIT, pin_memory="false", align=UNIT)
        self.live: dict[int, Live] = {}
        self.serial = 0
        self.base = self.pool.buffer.data_ptr()

    # ------------------------------------------------------------------ helpers
    def _stamp(self, o) -> int:
        self.serial += 1
        words = o.tensor.view(-1).view(torch.int32) if o.nbytes % 4 == 0 else None
        if words is not None:  # a distinct pattern per object and word
            words.copy_(torch.arange(words.numel(), dtype=torch.int32) * 7919 + self.serial)
        else:
            o.tensor.view(-1).fill_(self.serial & 0xFF)
        return self.serial

    def _expected(self, o, stamp: int) -> torch.Tensor:
        if o.nbytes % 4 == 0:
            return (torch.arange(o.nbytes // 4, dtype=torch.int32) * 7919 + stamp).view(
                torch.uint8)
        return torch.full((o.nbytes,), stamp & 0xFF, dtype=torch.uint8)

    def _new(self, got, count_asked: int, nbytes: int) -> None:
        assert len(got) <= count_asked
        if len(got) < count_asked:  # fewer only when nothing that big is free any more
            assert self.pool.allocator.largest_free() < -(-nbytes // UNIT) * UNIT, (
                f"allocate_many gave {len(got)}/{count_asked} with a free block of "
                f"{self.pool.allocator.largest_free()} B")
        for o in got:
            assert o.nbytes == nbytes and o.ref_count == 1
            self.live[id(o)] = Live(o, self._stamp(o))

    # -------------------------------------------------------------------- rules
    @rule(nbytes=SIZES)
    def allocate(self, nbytes):
        o = self.pool.allocate((nbytes,), torch.uint8)
        self._new([] if o is None else [o], 1, nbytes)

    @rule(nbytes=SIZES, count=st.integers(2, 6), dtype=st.sampled_from(
        [torch.uint8, torch.float32]))
    def allocate_many(self, nbytes, count, dtype):
        if dtype == torch.float32 and nbytes % 4:
            dtype = torch.uint8
        shape = (nbytes // dtype.itemsize,)
        self._new(self.pool.allocate_many(shape, dtype, count), count, nbytes)

    @rule(pick=st.integers(0, 1 << 16))
    def acquire(self, pick):
        if self.live:
            ent = list(self.live.values())[pick % len(self.live)]
            ent.obj.acquire()
            ent.refs += 1

    @rule(pick=st.integers(0, 1 << 16))
    def release(self, pick):
        """Drop one reference of any live object (the last one frees its block)."""
        if not self.live:
            return
        key = list(self.live)[pick % len(self.live)]
        ent = self.live[key]
        ent.obj.release()
        ent.refs -= 1
        if ent.refs == 0:
            del self.live[key]

    @rule(picks=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=4))
    def free_some(self, picks):
        """Free a few objects outright (every reference), as an evicting tier would."""
        for pick in picks:
            if not self.live:
                return
            key = list(self.live)[pick % len(self.live)]
            ent = self.live.pop(key)
            self.pool.release_many([ent.obj] * ent.refs)

    @rule(seed=st.integers(0, 1 << 32), ops=st.integers(1, 60))
    def churn(self, seed, ops):
        """A burst of seeded one-unit allocations, batches and frees: the workload that
        fragments a pool into single-unit holes fastest (each view is checked as it comes)."""
        r = random.Random(seed)
        for _ in range(ops):
            x = r.random()
            if x < 0.5 or not self.live:
                count = r.randint(1, 7)
                got = self.pool.allocate_many((UNIT,), torch.uint8, count)
                for o in got:
                    assert o.tensor.data_ptr() == self.base + o.offset, (
                        f"churn(seed={seed}): {o!r} views pool+"
                        f"{o.tensor.data_ptr() - self.base}; batch at "
                        f"{[g.offset // UNIT for g in got]} units")
                self._new(got, count, UNIT)
            else:
                key = list(self.live)[r.randrange(len(self.live))]
                ent = self.live.pop(key)
                self.pool.release_many([ent.obj] * ent.refs)

    # --------------------------------------------------------------- invariants
    @invariant()
    def views_blocks_and_bytes(self):
        alloc = self.pool.allocator
        spans = []
        for ent in self.live.values():
            o = ent.obj
            assert o.ref_count == ent.refs
            t = o.tensor
            assert t.data_ptr() == self.base + o.offset, (
                f"{o!r}: its tensor starts at offset {t.data_ptr() - self.base}")
            assert t.numel() * t.element_size() == o.nbytes and t.is_contiguous()
            size = alloc.block_size(o.offset)
            assert o.offset % UNIT == 0 and size >= o.nbytes
            assert o.offset >= 0 and o.offset + size <= self.pool.size
            spans.append((o.offset, o.offset + size))
        spans.sort()
        for (a0, a1), (b0, _) in zip(spans, spans[1:]):
            assert a1 <= b0, f"blocks [{a0}, {a1}) and [{b0}, ...) overlap"
        assert self.pool.used_bytes == sum(e - s for s, e in spans)
        assert alloc.num_allocations == len(spans)
        raw = self.pool.buffer
        for ent in self.live.values():
            o = ent.obj
            got = raw[o.offset: o.offset + o.nbytes]
            assert torch.equal(got, self._expected(o, ent.stamp)), (
                f"{o!r} (stamp {ent.stamp}) no longer holds its bytes")

    def teardown(self):
        for ent in self.live.values():
            self.pool.release_many([ent.obj] * ent.refs)
        assert self.pool.used_bytes == 0
        assert self.pool.allocator.free_bytes == self.pool.size
        self.pool.close()


def test_pool_matches_model():
    run_state_machine_as_test(PoolMachine, settings=scaled(100, 60))


# ------------------------------------------------------------- shrunk regressions
def test_regression_allocate_many_over_fragmented_blocks():
    """A batch that no free block fits is carved one by one from the holes at units 3, 1, 5:
    first and last are two units apart, as if neighbours, but the middle one is not between
    them. Each object's view must sit on its own offset (it sat on the used unit 4)."""
    pool = MemoryPool(8 * UNIT, pin_memory="false", align=UNIT)
    units = [pool.allocate((UNIT,), torch.uint8) for _ in range(8)]
    for i in (3, 1, 5, 6):  # holes: 3 then 1 (one unit each, in that order), then 5-6
        units[i].release()
    kept = [units[i] for i in (0, 2, 4, 7)]
    for o in kept:
        o.tensor.fill_(0xAB)
    batch = pool.allocate_many((UNIT,), torch.uint8, 3)
    try:
        assert [o.offset // UNIT for o in batch] == [3, 1, 5]
        base = pool.buffer.data_ptr()
        for o in batch:
            assert o.tensor.data_ptr() == base + o.offset, f"{o!r} views another block"
            o.tensor.fill_(0x11)
        for o in kept:
            assert bool((o.tensor == 0xAB).all()), f"{o!r} was overwritten by the batch"
    finally:
        pool.release_many(batch + kept)
        pool.close()
