"""Gather/scatter on the portable path: every layout and dtype, against a slow reference."""

from __future__ import annotations

import pytest
import torch

from lmc.kv_spec import LAYOUTS
from lmc.transfer import TorchTransfer, make_transfer
from tests.kvutil import DTYPES, assert_bits_equal, make_caches, spec_for, token_kv


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
    caches = make_caches(layout)
    spec = spec_for(layout, caches)
    tr = make_transfer(spec, caches)
    for slots, ranges in [(torch.arange(0), [(0, 0)]), (torch.arange(8), [(0, 8), (8, 8)])]:
        bufs = [torch.zeros(spec.chunk_shape(e - s)) for s, e in ranges]
        plan = tr.plan(slots, ranges)
        tr.gather(plan, bufs)
        tr.scatter(plan, bufs)


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
