"""Copies planned and executed a run at a time: ``ChunkRanges``, ``PlanRun`` and pool spans.

A CPU plan holds one ``PlanRun`` per run of consecutive equal chunks, and a batch of pool
objects is read as strided spans (``PoolArrays``). These tests check the run-wise copies
bit for bit against the slow reference and against chunk-by-chunk copies into plain
tensors, for every layout, with objects laid out in the pool as one run, as several runs
(some spaced wider than an object) and mixed with another pool's object.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lmc.memory.pool import Lease, MemoryPool, PoolArrays
from lmc.transfer.factory import make_transfer
from lmc.transfer.kv_spec import LAYOUTS
from lmc.transfer.plan import ChunkRanges, PlanRun, equal_runs
from lmc.transfer.torch_copy import TorchPlan
from tests.kvutil import assert_bits_equal, make_caches, spec_for, token_kv


def _block_slots(spec, n: int, seed: int) -> torch.Tensor:
    """Slots for ``n`` tokens in whole shuffled blocks (the aligned, usual case)."""
    gen = torch.Generator().manual_seed(seed)
    bs = spec.block_size
    blocks = torch.randperm(spec.num_blocks, generator=gen)[: -(-n // bs)]
    return (blocks[:, None] * bs + torch.arange(bs)).flatten()[:n]


def _objects(pool: MemoryPool, other: MemoryPool, spec, ranges, order: str):
    """Pool objects for ``ranges``, laid out as ``order`` says: "run" (one batch, in
    allocation order), "shuffled" (the same, several runs: one spaced two objects apart)
    or "foreign" (one object of another pool among them)."""
    sizes = [e - s for s, e in ranges]
    full = [pool.allocate(spec.chunk_shape(n), spec.dtype, n) for n in sizes] if \
        order == "foreign" else None
    if full is None:
        objs = pool.allocate_many(spec.chunk_shape(sizes[0]), spec.dtype, len(sizes) - 1,
                                  sizes[0])
        objs.append(pool.allocate(spec.chunk_shape(sizes[-1]), spec.dtype, sizes[-1]))
        if order == "shuffled":  # [0, 1, 3, 2, 4, ...]: runs, a wide step, a step back
            objs[2], objs[3] = objs[3], objs[2]
        return objs
    full[1].release()
    full[1] = other.allocate(spec.chunk_shape(sizes[1]), spec.dtype, sizes[1])
    return full


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("order", ["run", "shuffled", "foreign"])
@pytest.mark.parametrize("regular", [True, False], ids=["ChunkRanges", "list"])
def test_run_copies_through_pool_spans_are_bit_exact(layout, order, regular):
    caches = make_caches(layout, blocks=24, dtype=torch.bfloat16)
    spec = spec_for(layout, caches)
    tr = make_transfer(spec, caches)
    size = 2 * spec.block_size if spec.block_size > 1 else 8
    n = 5 * size + size // 2  # five full chunks and a shorter tail
    ranges = ChunkRanges(0, size, 6, n) if regular else [
        (i * size, min(n, (i + 1) * size)) for i in range(6)]
    slots = _block_slots(spec, n, seed=5)
    plan = tr.plan(slots, ranges)
    assert isinstance(plan, TorchPlan) and not plan.unmapped
    if not tr.strided:
        assert [type(p) for p in plan.parts] == [PlanRun, PlanRun]  # full chunks, the tail
    pool = MemoryPool(1 << 20, pin_memory=False)
    other = MemoryPool(1 << 18, pin_memory=False)
    objs = _objects(pool, other, spec, list(ranges), order)
    arrays = PoolArrays(objs)
    cuts = [(i, j) for i, j, _ in arrays.spans()]
    if order == "foreign":
        assert (1, 2) in cuts, cuts  # the other pool's object is a span of its own
    else:  # full chunks as runs (one two objects apart), the tail of its own shape alone
        assert cuts == ([(0, 5), (5, 6)] if order == "run"
                        else [(0, 2), (2, 3), (3, 5), (5, 6)]), cuts
    tr.gather(plan, [o.tensor for o in objs], arrays=arrays)
    ref = token_kv(spec, caches, slots)
    for (s, e), o in zip(ranges, objs):
        assert_bits_equal(o.tensor, ref[:, :, s:e], f"{layout} {order} gather {s}:{e}")
    # chunk by chunk into plain tensors (no arrays): the same bytes
    plain = [torch.empty(spec.chunk_shape(e - s), dtype=spec.dtype) for s, e in ranges]
    tr.gather(plan, plain)
    for p, o in zip(plain, objs):
        assert_bits_equal(p, o.tensor, f"{layout} {order} plain gather")
    # one layer at a time, as a layer-wise store does
    for o in objs:
        o.tensor.zero_()
    for layer in reversed(range(spec.num_layers)):
        tr.gather(plan, [o.tensor for o in objs], [layer], arrays=PoolArrays(objs))
    for (s, e), o in zip(ranges, objs):
        assert_bits_equal(o.tensor, ref[:, :, s:e], f"{layout} {order} per-layer gather")

    fresh = make_caches(layout, blocks=24, dtype=torch.bfloat16, zeros=True)
    tr2 = make_transfer(spec_for(layout, fresh), fresh)
    slots2 = _block_slots(spec, n, seed=9)
    tr2.scatter(tr2.plan(slots2, ranges), [o.tensor for o in objs], arrays=PoolArrays(objs))
    assert_bits_equal(token_kv(spec, fresh, slots2), ref, f"{layout} {order} scatter")
    Lease([o for o in objs if o.pool is pool]).release()
    Lease([o for o in objs if o.pool is other]).release()
    pool.close()
    other.close()


def test_spans_cover_a_batch_exactly_and_refuse_a_released_object():
    """Each span's rows are exactly their objects' bytes (written through the span, read
    back through each object's own array); a released object is refused."""
    pool = MemoryPool(1 << 20, pin_memory=False)
    objs = pool.allocate_many((3, 1000), torch.int16, 6)  # 6000 B in 8 KiB blocks: gaps
    batch = objs[:2] + objs[3:] + [objs[2]]
    spans = pool.spans(batch)
    assert [(i, j) for i, j, _ in spans] == [(0, 2), (2, 5), (5, 6)]
    pool.buffer.fill_(0)
    for i, j, a in spans:
        assert a.shape == (j - i, 3, 1000) and a.dtype == np.int16
        for k in range(j - i):
            a[k] = i + k + 1
    for k, o in enumerate(batch):
        assert (o.array == k + 1).all()
        block = pool.buffer[o.offset: o.offset + 8192].numpy()
        assert (block[o.nbytes:] == 0).all(), "a span wrote into a gap between objects"
    objs[4].release()
    with pytest.raises(RuntimeError, match="after its last release"):
        pool.spans(objs)
    with pytest.raises(RuntimeError, match="after its last release"):
        PoolArrays(objs[3:5])
    Lease(objs[:4] + objs[5:]).release()
    pool.close()


def test_chunk_ranges_is_the_list_it_stands_for():
    r = ChunkRanges(512, 256, 3, 1100)
    assert list(r) == r[:] == [(512, 768), (768, 1024), (1024, 1100)]
    assert len(r) == 3 and r[-1] == (1024, 1100) and r[1:] == [(768, 1024), (1024, 1100)]
    assert r.runs() == equal_runs(list(r)) == [(0, 2), (2, 3)]
    assert ChunkRanges(0, 4, 2, 8).runs() == [(0, 2)]
    assert ChunkRanges(0, 4, 1, 3).runs() == [(0, 1)]
    assert ChunkRanges(0, 4, 0, 0).runs() == [] and list(ChunkRanges(0, 4, 0, 0)) == []
    with pytest.raises(IndexError):
        r[3]  # noqa: B018
    for bad in ((0, 4, 2, 4), (0, 4, 2, 9), (0, 0, 1, 0)):
        with pytest.raises(ValueError, match="ChunkRanges"):
            ChunkRanges(*bad)


def test_equal_runs_agrees_with_a_plain_scan():
    """Random range lists (gaps, repeats, changing sizes, empty ranges) cut into runs as
    one scan chunk by chunk would."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)

    def scan(ranges):
        out, i = [], 0
        while i < len(ranges):
            j = i + 1
            while (j < len(ranges) and ranges[j][0] == ranges[j - 1][1]
                   and ranges[j][1] - ranges[j][0] == ranges[i][1] - ranges[i][0]):
                j += 1
            out.append((i, j))
            i = j
        return out

    for _ in range(300):
        ranges, pos = [], rng.randrange(3)
        for _ in range(rng.randrange(1, 8)):
            pos += rng.choice((0, 0, 0, 1))  # mostly consecutive
            n = rng.choice((4, 4, 4, 2, 0))
            ranges.append((pos, pos + n))
            pos += n
        assert equal_runs(ranges) == scan(ranges), f"seed {seed}: {ranges}"
    assert equal_runs([]) == []


@pytest.mark.parametrize("layout", ["vllm_flash", "vllm_flashinfer", "sglang_mha"])
def test_plan_chunks_are_made_on_demand_and_unmapped_is_known(layout):
    caches = make_caches(layout)
    spec = spec_for(layout, caches)
    tr = make_transfer(spec, caches)
    slots = _block_slots(spec, 20, seed=2)
    plan = tr.plan(slots, ChunkRanges(0, 8, 3, 20))
    assert plan._chunks is None, "no ChunkPlan made by planning"
    chunks = plan.chunks
    mode = "block" if spec.block_size > 1 else "token"  # sglang: a slot per token
    assert [(c.start, c.end, c.mode) for c in chunks] == [
        (0, 8, mode), (8, 16, mode), (16, 20, mode)]
    one = tr.plan(slots[:8], [(0, 8)]).chunks[0]
    assert np.array_equal(chunks[0].index_np, one.index_np)
    assert torch.equal(chunks[0].index, one.index)  # the tensor index, made on use
    assert tr.plan(slots, [(0, 20)]).unmapped is False
    slots[3] = -1
    neg = tr.plan(slots, ChunkRanges(0, 8, 3, 20))
    assert neg.unmapped is True and tr.has_negative(slots)
    modes = [c.mode for c in neg.chunks]
    assert modes[0] == "masked" and "masked" not in modes[1:], modes


def test_chunk_ranges_is_a_full_sequence():
    """``ChunkRanges`` is a ``Sequence``: the mixin methods work (its ``count`` attribute once
    shadowed ``Sequence.count``, so ``r.count(x)`` raised; found by mypy)."""
    r = ChunkRanges(0, 4, 3, 10)
    assert len(r) == 3 and list(r) == [(0, 4), (4, 8), (8, 10)]
    assert r.count((4, 8)) == 1 and r.count((0, 8)) == 0
    assert r.index((8, 10)) == 2 and (4, 8) in r
    assert r[-1] == (8, 10) and r[1:] == [(4, 8), (8, 10)]


def test_a_torch_plans_chunks_can_be_set_as_the_base_plans():
    """``TransferPlan.chunks`` is a plain field; ``TorchPlan`` makes it lazily but keeps it
    writable (a read-only property broke code that sets it on any plan)."""
    caches = make_caches("vllm_flash")
    tr = make_transfer(spec_for("vllm_flash", caches), caches, "torch")
    plan = tr.plan(torch.arange(8), ChunkRanges(0, 4, 2, 8))
    assert isinstance(plan, TorchPlan) and [(c.start, c.end) for c in plan.chunks] == [
        (0, 4), (4, 8)]
    plan.chunks = plan.chunks[:1]
    assert [(c.start, c.end) for c in plan.chunks] == [(0, 4)]
