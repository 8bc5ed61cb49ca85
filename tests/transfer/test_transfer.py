"""Gather/scatter on the portable path: every layout and dtype, against a slow reference."""

from __future__ import annotations

import pytest
import torch

from lmc.transfer.factory import make_transfer
from lmc.transfer.kv_spec import LAYOUTS
from lmc.transfer.torch_copy import TorchTransfer
from tests.kvutil import DTYPES, assert_bits_equal, bits, make_caches, spec_for, token_kv


def _slots(spec, n, gen, aligned: bool) -> torch.Tensor:
    """Slots for ``n`` tokens: whole shuffled blocks (aligned) or random distinct slots."""
    total = spec.num_blocks * spec.block_size
    if aligned:
        blocks = torch.randperm(spec.num_blocks, generator=gen)[: -(-n // spec.block_size)]
        s = (blocks[:, None] * spec.block_size + torch.arange(spec.block_size)).flatten()
        return s[:n]
    return torch.randperm(total, generator=gen)[:n]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("aligned", [True, False], ids=["blocks", "scattered"])
def test_gather_matches_reference_and_scatter_roundtrips(layout, dtype, aligned):
    gen = torch.Generator().manual_seed(1)
    caches = make_caches(layout, dtype=dtype)
    spec = spec_for(layout, caches)
    tr = make_transfer(spec, caches)
    assert isinstance(tr, TorchTransfer)
    n = 24
    slots = _slots(spec, n, gen, aligned)
    ranges = [(0, 8), (8, 16), (16, 24)] if spec.block_size <= 8 else [(0, n)]
    plan = tr.plan(slots, ranges)
    if aligned and spec.block_size > 1:
        assert [c.mode for c in plan.chunks] == ["block"] * len(ranges)
    bufs = [torch.empty(spec.chunk_shape(e - s), dtype=dtype) for s, e in ranges]
    tr.gather(plan, bufs)
    ref = token_kv(spec, caches, slots)
    for (s, e), buf in zip(ranges, bufs):
        assert_bits_equal(buf, ref[:, :, s:e], f"{layout} gather tokens {s}:{e}")

    fresh = make_caches(layout, dtype=dtype, zeros=True)
    tr2 = make_transfer(spec_for(layout, fresh), fresh)
    slots2 = _slots(spec, n, torch.Generator().manual_seed(7), aligned)
    tr2.scatter(tr2.plan(slots2, ranges), bufs)
    assert_bits_equal(token_kv(spec, fresh, slots2), ref, f"{layout} scatter")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layerwise_calls_equal_all_layers(layout):
    caches = make_caches(layout)
    spec = spec_for(layout, caches)
    tr = make_transfer(spec, caches)
    slots = torch.arange(16)
    plan = tr.plan(slots, [(0, 16)])
    whole = torch.empty(spec.chunk_shape(16))
    tr.gather(plan, [whole])
    per = torch.zeros(spec.chunk_shape(16))
    for layer in reversed(range(spec.num_layers)):
        tr.gather(plan, [per], layers=[layer])
    assert_bits_equal(per, whole, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_slots_are_skipped(layout, dtype):
    caches = make_caches(layout, dtype=dtype)
    spec = spec_for(layout, caches)
    tr = make_transfer(spec, caches)
    slots = torch.arange(8)
    slots[[1, 5]] = -1
    plan = tr.plan(slots, [(0, 8)])
    assert plan.chunks[0].mode == "masked"
    buf = torch.full((*spec.chunk_shape(8)[:-1], spec.row_width * dtype.itemsize), 7,
                     dtype=torch.uint8).view(dtype)
    tr.gather(plan, [buf])
    ref = token_kv(spec, caches, torch.arange(8))
    keep = [0, 2, 3, 4, 6, 7]
    assert_bits_equal(buf[:, :, keep], ref[:, :, keep])
    assert bool((buf[:, :, [1, 5]].view(torch.uint8) == 7).all()), "skipped rows untouched"

    fresh = make_caches(layout, dtype=dtype, zeros=True)
    tr2 = make_transfer(spec_for(layout, fresh), fresh)
    tr2.scatter(tr2.plan(slots, [(0, 8)]), [buf])
    got = token_kv(spec, fresh, torch.arange(8))
    assert_bits_equal(got[:, :, keep], ref[:, :, keep])
    assert bool((got[:, :, [1, 5]].view(torch.uint8) == 0).all()), "unmapped slots written"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_empty_chunks_are_no_ops(layout):
    """A zero-token chunk (an empty request; a range starting where the previous one ended)
    moves nothing: its neighbours in the plan move exactly their own tokens, and scattering a
    plan of empty chunks leaves every cache bit unchanged whatever its buffers hold."""
    caches = make_caches(layout)
    spec = spec_for(layout, caches)
    tr = make_transfer(spec, caches)
    every_slot = torch.arange(48)  # make_caches: 12 blocks of 4
    before = token_kv(spec, caches, every_slot)
    cases = [(torch.arange(0), [(0, 0)]), (torch.arange(8), [(0, 8), (8, 8)]),
             (torch.arange(8), [(0, 0), (0, 4), (4, 4), (4, 8)])]
    for slots, ranges in cases:
        bufs = [torch.full(spec.chunk_shape(e - s), 3.0, dtype=spec.dtype) for s, e in ranges]
        plan = tr.plan(slots, ranges)
        assert [(c.start, c.end) for c in plan.chunks] == ranges
        tr.gather(plan, bufs)
        for (s, e), buf in zip(ranges, bufs):
            assert_bits_equal(buf, token_kv(spec, caches, slots[s:e]), f"chunk {s}:{e}")
        tr.scatter(plan, bufs)  # what was just read: a no-op unless a chunk writes elsewhere
        empty = [(s, e) for s, e in ranges if s == e]
        junk = [torch.full(spec.chunk_shape(0), 5.0, dtype=spec.dtype) for _ in empty]
        tr.scatter(tr.plan(slots, empty), junk)
        assert_bits_equal(token_kv(spec, caches, every_slot), before, f"{ranges}: the caches")


def test_slot_past_the_cache_is_an_error():
    caches = make_caches("vllm_flash")
    spec = spec_for("vllm_flash", caches)
    tr = make_transfer(spec, caches)
    with pytest.raises(ValueError, match="slot 48"):
        tr.plan(torch.tensor([0, 48]), [(0, 2)])


def test_check_slots_names_the_problem():
    caches = make_caches("vllm_flash")
    tr = make_transfer(spec_for("vllm_flash", caches), caches)
    with pytest.raises(ValueError, match="3 entries for 4 tokens"):
        tr.check_slots(torch.arange(3), 4)
    with pytest.raises(TypeError, match="float32"):
        tr.check_slots(torch.zeros(4), 4)
    with pytest.raises(ValueError, match="1-D"):
        tr.check_slots(torch.zeros(2, 2, dtype=torch.long), 4)


# ------------------------------------------------- vLLM 0.32 GPU caches in every memory order
@pytest.mark.parametrize("order", ["NHD", "HND", "LHBNC", "BLHNC", "BHLNC"])
@pytest.mark.parametrize("aligned", [True, False], ids=["blocks", "scattered"])
def test_vllm_gpu_any_memory_order(order, aligned):
    """Strides come from the tensors: the same spec code moves K/V interleaved per head in
    vLLM's NHD/HND orders and in cross-layer allocations (a block holds every layer)."""
    from tests.transfer.test_kv_spec import vllm_gpu_caches

    def caches(zeros=False, seed=0):
        if order in ("NHD", "HND"):
            return make_caches("vllm_gpu", order=order, dtype=torch.bfloat16, blocks=12,
                               zeros=zeros, seed=seed)
        return vllm_gpu_caches(order, dtype=torch.bfloat16, blocks=12, zeros=zeros, seed=seed)

    src = caches()
    spec = spec_for("vllm_gpu", src)
    tr = make_transfer(spec, src)
    assert tr.strided, "K/V interleaved per head: no dense rows"
    slots = _slots(spec, 24, torch.Generator().manual_seed(3), aligned)
    slots[5] = -1
    ranges = [(0, 8), (8, 16), (16, 24)]
    plan = tr.plan(slots, ranges)
    bufs = [torch.zeros(spec.chunk_shape(8), dtype=spec.dtype) for _ in ranges]
    for layer in (2, 0, 1):
        tr.gather(plan, bufs, layers=[layer])
    got = torch.cat(bufs, dim=2)
    keep = [i for i in range(24) if i != 5]
    ref = token_kv(spec, src, slots.clamp(min=0))
    assert_bits_equal(got[:, :, keep], ref[:, :, keep], f"vllm_gpu {order} gather")

    dst = caches(zeros=True)
    tr2 = make_transfer(spec_for("vllm_gpu", dst), dst)
    tr2.scatter(tr2.plan(slots, ranges), bufs)
    back = token_kv(spec, dst, slots.clamp(min=0))
    assert_bits_equal(back[:, :, keep], ref[:, :, keep], f"vllm_gpu {order} scatter")
    untouched = torch.ones(spec.num_blocks * spec.block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    rest = token_kv(spec, dst, torch.arange(untouched.numel())[untouched])
    assert not bool(bits(rest).any()), "scatter wrote outside its slots"
