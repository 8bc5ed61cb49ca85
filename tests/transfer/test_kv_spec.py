"""KVSpec and the layout descriptors: strides read from real tensors (every physical order
vLLM 0.32 can allocate), the vllm_gpu layout end to end through CacheEngine, and the
refusals (a hand-built vllm_flash spec without num_blocks, overlapping or uneven strides)."""

from __future__ import annotations

import pytest
import torch

from lmc import CacheConfig, CacheEngine, KVSpec
from lmc.transfer.kv_layouts import DESCRIPTORS, PlaneStrides, contiguous_strides
from lmc.transfer.kv_spec import LAYOUTS
from tests.kvutil import (
    assert_bits_equal,
    bits,
    make_caches,
    random_bits,
    random_tokens,
    spec_for,
    token_kv,
)

CHUNK = 16
# vLLM 0.32's KVCacheLayout names (vllm/v1/kv_cache_layout.py): physical order of the logical
# [L(ayer), B(lock), H(ead), N (token in block), C (2 * head_size)] axes, outermost first.
VLLM_ORDERS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def vllm_gpu_caches(order: str, *, layers=3, blocks=10, heads=2, block_size=4, dim=8,
                    dtype=torch.float32, seed=0, zeros=False) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, 2*dim]`` views of one allocation laid out in ``order``, the way
    vLLM's create_kv_cache_views builds them (strides computed here from the order)."""
    size = {"L": layers, "B": blocks, "H": heads, "N": block_size, "C": 2 * dim}
    stride, acc = {}, 1
    for ax in reversed(order):
        stride[ax] = acc
        acc *= size[ax]
    gen = torch.Generator().manual_seed(seed)
    flat = (torch.zeros(acc, dtype=torch.uint8 if dtype.itemsize == 1 else dtype).view(dtype)
            if zeros else random_bits((acc,), dtype, gen))
    view = torch.as_strided(flat, [size[a] for a in "LBHNC"], [stride[a] for a in "LBHNC"])
    return list(view.unbind(0))


def _cfg() -> CacheConfig:
    return CacheConfig(chunk_size=CHUNK, local_cpu_size="8MiB")


def _slots(spec: KVSpec, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bs = spec.block_size
    blocks = torch.randperm(spec.num_blocks, generator=g)[: -(-n // bs)]
    return (blocks[:, None] * bs + torch.arange(bs)).flatten()[:n]


def _check_strides_address_the_definition(spec: KVSpec, caches) -> None:
    """Every (layer, plane, slot, head, dim) read through ``plane_strides`` from the raw
    storage equals what the layout's definition (tests.kvutil.token_kv) says is there."""
    slots = torch.arange(spec.num_blocks * spec.block_size)
    want = bits(token_kv(spec, caches, slots))
    H, D, bs = spec.num_kv_heads, spec.head_size, spec.block_size
    s = slots.view(-1, 1, 1)
    h, d = torch.arange(H).view(1, -1, 1), torch.arange(D).view(1, 1, -1)
    for li, (_, tensors) in enumerate(spec.split_layers(caches)):
        for p, ps in enumerate(spec.plane_strides(tensors)):
            t = tensors[p if len(tensors) > 1 else 0]
            raw = bits(t).as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
            off = (t.storage_offset() + ps.base + (s // bs) * ps.block + (s % bs) * ps.token
                   + h * ps.head + d * ps.dim)
            got = raw[off].reshape(len(slots), H * D)
            assert torch.equal(got, want[li, p]), f"{spec.layout} layer {li} plane {p}"


# ----------------------------------------------------------------------------- strides
@pytest.mark.parametrize("layout", LAYOUTS)
def test_strides_read_from_tensors_address_every_element(layout):
    caches = make_caches(layout, dtype=torch.float16, layers=2, blocks=5)
    _check_strides_address_the_definition(spec_for(layout, caches), caches)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_vllm_gpu_both_orders_address_every_element(order):
    caches = make_caches("vllm_gpu", order=order, layers=2, blocks=5, heads=3)
    spec = KVSpec.from_tensors(caches, layout="vllm_gpu", block_size=4)
    assert (spec.num_kv_heads, spec.head_size, spec.num_blocks) == (3, 8, 5)
    _check_strides_address_the_definition(spec, caches)


@pytest.mark.parametrize("order", VLLM_ORDERS)
def test_vllm_gpu_every_vllm_allocation_order(order):
    """Cross-layer orders (B outside L) give views whose block stride spans every layer."""
    caches = vllm_gpu_caches(order, dtype=torch.bfloat16)
    spec = KVSpec.from_tensors(caches, layout="vllm_gpu", block_size=4)
    _check_strides_address_the_definition(spec, caches)
    k = spec.plane_strides(caches[0])[0]
    if order.index("B") < order.index("L"):
        assert k.block >= 3 * 2 * 4 * 16, "cross-layer: a block holds every layer's page"


def test_canonical_strides_are_those_of_a_contiguous_tensor():
    for layout, d in DESCRIPTORS.items():
        spec = KVSpec(2, 1 if d.use_mla else 2, 8, torch.float32,
                      1 if d.slot_addressed else 4, layout, num_blocks=6)
        shape = spec.layer_shape()
        t = torch.empty(shape)
        pair = (t, t) if d.split_planes else t
        assert spec.plane_strides() == spec.plane_strides(pair), layout
        assert t.stride() == contiguous_strides(shape)


def test_stride_fields_have_names():
    ps = PlaneStrides(base=3, block=100, token=10, head=5, dim=1)
    assert ps.offset(slot=9, head=1, dim=2, block_size=4) == 3 + 2 * 100 + 1 * 10 + 5 + 2


# --------------------------------------------------------------------------- refusals
def test_vllm_flash_without_num_blocks_is_refused_not_aliased():
    spec = KVSpec(3, 2, 8, torch.float32, 4, "vllm_flash")  # num_blocks=0
    with pytest.raises(ValueError, match="num_blocks=0.*V plane"):
        spec.plane_strides()


def test_hand_built_vllm_flash_spec_without_num_blocks_round_trips_v():
    """Regression: num_blocks=0 used to put the V plane on top of K (V stored as K twice, then
    served to every engine sharing the tier). Strides now come from the tensors."""
    n = 40
    src = make_caches("vllm_flash", blocks=16)
    dst = make_caches("vllm_flash", blocks=16, zeros=True)
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_size=8, dtype=torch.float32,
                  block_size=4, layout="vllm_flash")
    full = spec_for("vllm_flash", src)
    s1, s2 = _slots(full, n, 1), _slots(full, n, 2)
    toks = random_tokens(n, seed=5)
    with CacheEngine(_cfg(), spec, "m") as eng:
        assert eng.store(toks, src, s1) == n
        assert eng.retrieve(toks, dst, s2) == n
    got, want = token_kv(full, dst, s2), token_kv(full, src, s1)
    assert_bits_equal(got[:, 1], want[:, 1], "V plane")
    assert_bits_equal(got, want, "K and V")


def test_overlapping_strides_are_refused():
    t = torch.zeros(1, 2, 4, 16).expand(6, 2, 4, 16)  # every block is the same memory
    with pytest.raises(ValueError, match="share memory"):
        KVSpec.from_tensors([t], "vllm_gpu")


def test_layers_laid_out_differently_are_refused():
    nhd = make_caches("vllm_gpu", order="NHD", layers=1)
    hnd = make_caches("vllm_gpu", order="HND", layers=1)
    with pytest.raises(ValueError, match="layer1 has strides.*laid out alike"):
        KVSpec.from_tensors(nhd + hnd, "vllm_gpu")


@pytest.mark.parametrize("shape,kw,needle", [
    ((4, 2, 4, 15), {}, "even last dim"),
    ((4, 2, 4), {}, "4-d tensor"),
    ((4, 2, 4, 16), {"block_size": 8}, "block_size=8 but"),
    ((4, 2, 4, 16), {"num_kv_heads": 4}, "num_kv_heads=4 but the tensors hold 2"),
])
def test_bad_vllm_gpu_tensors_are_named(shape, kw, needle):
    with pytest.raises(ValueError, match=needle):
        KVSpec.from_tensors([torch.zeros(shape)], "vllm_gpu", **kw)


# ------------------------------------------------------------------ through CacheEngine
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("order", ["NHD", "HND", "BLHNC"])
def test_vllm_gpu_round_trips_bit_exact(order, dtype):
    n = 40  # two full chunks and a partial one
    if order in ("NHD", "HND"):
        src = make_caches("vllm_gpu", order=order, dtype=dtype, blocks=16)
        dst = make_caches("vllm_gpu", order=order, dtype=dtype, blocks=16, zeros=True)
    else:
        src = vllm_gpu_caches(order, dtype=dtype, blocks=16)
        dst = vllm_gpu_caches(order, dtype=dtype, blocks=16, zeros=True)
    spec = KVSpec.from_tensors(src, layout="vllm_gpu", block_size=4)
    s1, s2 = _slots(spec, n, 1), _slots(spec, n, 2)
    toks = random_tokens(n, seed=5)
    with CacheEngine(_cfg(), spec, "m") as eng:
        assert eng.store(toks, src, s1) == n
        assert eng.retrieve(toks, dst, s2) == n
    assert_bits_equal(token_kv(spec, dst, s2), token_kv(spec, src, s1), f"vllm_gpu {order}")


def _move(src_spec, src, dst_spec, dst, n) -> None:
    """Store from one engine, hand the chunks to another (as a shared tier would), load."""
    toks = random_tokens(n, seed=5)
    s1, s2 = _slots(src_spec, n, 3), _slots(dst_spec, n, 4)
    assert src_spec.namespace_fields() == dst_spec.namespace_fields()
    with CacheEngine(_cfg(), src_spec, "m") as a:
        assert a.store(toks, src, s1) == n
        objs = a.storage.get_prefix(a.db.keys(toks))
        with CacheEngine(_cfg(), dst_spec, "m") as b:
            assert b.db.keys(toks) == a.db.keys(toks)
            copies = []  # a shared tier copies bytes into the reader's own pool
            for o in objs:
                c = b.pool.allocate(o.shape, o.dtype, o.num_tokens)
                c.tensor.copy_(o.tensor)
                copies.append(c)
                o.release()
            b.storage.put(b.db.keys(toks), copies)
            for c in copies:
                c.release()
            assert b.retrieve(toks, dst, s2) == n
    assert_bits_equal(token_kv(dst_spec, dst, s2), token_kv(src_spec, src, s1),
                      f"{src_spec.layout} -> {dst_spec.layout}")


@pytest.mark.parametrize("other", ["vllm_flash", "sglang_mha", "vllm_cpu", "vllm_gpu:HND"])
def test_kv_saved_from_vllm_gpu_loads_into_other_layouts(other):
    n = 48
    layout, _, order = other.partition(":")
    src = make_caches("vllm_gpu", dtype=torch.bfloat16, blocks=16)
    dst = make_caches(layout, dtype=torch.bfloat16, blocks=16, zeros=True, order=order or "NHD")
    _move(spec_for("vllm_gpu", src), src, spec_for(layout, dst), dst, n)
    # and back: what the other layout saved loads into vllm_gpu
    back = make_caches("vllm_gpu", dtype=torch.bfloat16, blocks=16, zeros=True)
    _move(spec_for(layout, dst), dst, spec_for("vllm_gpu", back), back, n)
