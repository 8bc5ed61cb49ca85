"""CudaTransfer against TorchTransfer, bit for bit.

The GPU tests (marked ``gpu``) run the real kernels. The comparison helpers are shared with
``test_cuda_sources.py``, which runs the same kernel code compiled for the host (no GPU needed).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from lmc.transfer.completion import Completion
from lmc.transfer.cuda_copy import CudaTransfer, cuda_kernels_available
from lmc.transfer.factory import make_transfer
from lmc.transfer.kv_spec import LAYOUTS, KVSpec
from lmc.transfer.torch_copy import TorchTransfer
from tests.kvutil import DTYPES, assert_bits_equal, bits, make_caches, random_bits, spec_for

GPU_READY = cuda_kernels_available()
gpu = pytest.mark.gpu
needs_kernels = pytest.mark.skipif(
    not GPU_READY, reason="needs a CUDA device and CuPy (pip install lmc-kvcache[gpu])")

MakeTransfer = Callable[[KVSpec, object], CudaTransfer]


# ------------------------------------------------------------------------------ helpers
def map_caches(layout: str, caches, fn):
    if layout == "sglang_mha":
        return ([fn(t) for t in caches[0]], [fn(t) for t in caches[1]])
    return [fn(t) for t in caches]


def cache_tensors(layout: str, caches) -> list[torch.Tensor]:
    return list(caches[0]) + list(caches[1]) if layout == "sglang_mha" else list(caches)


def make_slots(spec: KVSpec, n: int, rng: random.Random, aligned: bool,
               negative: bool) -> torch.Tensor:
    """``n`` distinct slots: whole shuffled blocks (aligned) or anywhere; some -1 if asked."""
    total = spec.num_blocks * spec.block_size
    if aligned:
        blocks = rng.sample(range(spec.num_blocks), -(-n // spec.block_size))
        slots = [b * spec.block_size + o for b in blocks for o in range(spec.block_size)][:n]
    else:
        slots = rng.sample(range(total), n)
    if negative:
        for i in rng.sample(range(n), max(1, n // 5)):
            slots[i] = -1
    return torch.tensor(slots, dtype=torch.int64)


def split(n: int, rng: random.Random, pieces: int) -> list[tuple[int, int]]:
    """Cut ``[0, n)`` into ``pieces`` consecutive ranges (one may be empty)."""
    cuts = sorted(rng.choice(range(n + 1)) for _ in range(pieces - 1))
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:], strict=True))


def chunk_buffer(shape, dtype, gen, *, device: str, pin: bool = False,
                 misalign: int = 0) -> torch.Tensor:
    """A chunk buffer filled with random bits, optionally ``misalign`` elements off a
    16-byte boundary (forces narrower vectors)."""
    esize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.empty((numel + misalign) * esize, dtype=torch.uint8, device=device,
                      pin_memory=pin)
    buf = raw[misalign * esize:].view(dtype).view(shape)
    bits(buf).copy_(bits(random_bits(shape, dtype, gen)).to(device))
    return buf


class TorchReference:
    """TorchTransfer (CPU) on the tokens whose slot is >= 0, placed by hand.

    Equivalent to TorchTransfer on all tokens, but placed through a second route (only the
    valid tokens, rows put in place by hand through integer views), so the CUDA path is
    checked against more than one reading of the semantics.
    """

    def __init__(self, spec: KVSpec, caches, slots: torch.Tensor, ranges) -> None:
        self.spec, self.tr = spec, TorchTransfer(spec, caches)
        valid = (slots >= 0).tolist()
        pos = [[t - s for t in range(s, e) if valid[t]] for s, e in ranges]
        self.used = [i for i, p in enumerate(pos) if p]
        self.pos = [torch.tensor(pos[i], dtype=torch.long) for i in self.used]
        keep = torch.tensor([s + t for i in self.used for s, t in
                             ((ranges[i][0], t) for t in pos[i])], dtype=torch.long)
        edges = [0]
        for p in self.pos:
            edges.append(edges[-1] + len(p))
        self.plan = self.tr.plan(slots[keep], list(zip(edges[:-1], edges[1:], strict=True)))

    def gather(self, bufs, layers) -> None:
        tmp = [torch.empty(self.spec.chunk_shape(len(p)), dtype=self.spec.dtype)
               for p in self.pos]
        self.tr.gather(self.plan, tmp, layers)
        for i, t, p in zip(self.used, tmp, self.pos, strict=True):
            for lid in range(self.spec.num_layers) if layers is None else layers:
                bits(bufs[i])[lid][:, p] = bits(t)[lid]

    def scatter(self, bufs, layers) -> None:
        sub = [bits(bufs[i])[:, :, p].view(self.spec.dtype)
               for i, p in zip(self.used, self.pos, strict=True)]
        self.tr.scatter(self.plan, sub, layers)


def check_against_torch(make_cuda: MakeTransfer, device: str, layout: str, dtype: torch.dtype,
                        *, buf_device: str = "cpu", pin: bool = False, aligned: bool = True,
                        negative: bool = False, misalign: int = 0, pieces: int = 3,
                        layer_sets=(None,), seed: int = 0, **shape) -> None:
    """Gather and scatter through ``make_cuda`` and through TorchTransfer (on CPU copies);
    every bit of the chunk buffers and of the caches must agree."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cpu_caches = make_caches(layout, dtype=dtype, seed=seed, **shape)
    spec = spec_for(layout, cpu_caches)
    n = min(spec.num_blocks * spec.block_size, rng.randint(1, 40))
    slots = make_slots(spec, n, rng, aligned, negative)
    ranges = split(n, rng, pieces)
    shapes = [spec.chunk_shape(e - s) for s, e in ranges]

    # gather: untouched rows (negative slots) must keep their random bits on both sides
    caches = map_caches(layout, cpu_caches, lambda t: t.clone().to(device))
    tr = make_cuda(spec, caches)
    ref = TorchReference(spec, cpu_caches, slots, ranges)
    ref_bufs = [random_bits(sh, dtype, gen) for sh in shapes]
    bufs = [chunk_buffer(sh, dtype, gen, device=buf_device, pin=pin, misalign=misalign)
            for sh in shapes]
    for b, r in zip(bufs, ref_bufs, strict=True):
        bits(b).copy_(bits(r))
    plan = tr.plan(slots.to(device), ranges)
    for layers in layer_sets:
        ref.gather(ref_bufs, layers)
        tr.gather(plan, bufs, layers)
    tr.synchronize()
    for i, (b, r) in enumerate(zip(bufs, ref_bufs, strict=True)):
        assert_bits_equal(b.cpu(), r, f"{layout} {dtype} gather chunk {i} {ranges[i]}")

    # scatter into random caches: rows not addressed must keep their bits
    cpu_dst = make_caches(layout, dtype=dtype, seed=seed + 1, **shape)
    dst = map_caches(layout, cpu_dst, lambda t: t.clone().to(device))
    tr2, ref2 = make_cuda(spec, dst), TorchReference(spec, cpu_dst, slots, ranges)
    src_ref = [random_bits(sh, dtype, gen) for sh in shapes]
    src = [chunk_buffer(sh, dtype, gen, device=buf_device, pin=pin, misalign=misalign)
           for sh in shapes]
    for b, r in zip(src, src_ref, strict=True):
        bits(b).copy_(bits(r))
    plan2 = tr2.plan(slots.to(device), ranges)
    for layers in layer_sets:
        ref2.scatter(src_ref, layers)
        tr2.scatter(plan2, src, layers)
    tr2.synchronize()
    for i, (got, want) in enumerate(zip(cache_tensors(layout, dst),
                                        cache_tensors(layout, cpu_dst), strict=True)):
        assert_bits_equal(got.cpu(), want, f"{layout} {dtype} scatter cache tensor {i}")


def random_case(seed: int) -> dict:
    """A random layout, dtype and shape, with the quirks that change the kernel's path."""
    rng = random.Random(seed)
    layout = rng.choice(LAYOUTS)
    case = dict(layout=layout, dtype=rng.choice(DTYPES), seed=seed,
                layers=rng.randint(1, 4), heads=rng.choice([1, 2, 3, 8]),
                dim=rng.choice([1, 3, 8, 16, 64]), blocks=rng.randint(4, 12),
                block_size=1 if layout.startswith("sglang") else rng.choice([1, 2, 4, 16]),
                aligned=rng.random() < 0.5, negative=rng.random() < 0.4,
                misalign=rng.choice([0, 0, 1, 3]), pieces=rng.randint(1, 4))
    n_layers = case["layers"]
    subset = sorted(rng.sample(range(n_layers), rng.randint(1, n_layers)), reverse=True)
    case["layer_sets"] = rng.choice([(None,), (subset,), tuple([i] for i in range(n_layers))])
    return case


# ------------------------------------------------------------------------------ CPU tests
def test_kernels_available_is_a_bool_and_never_raises():
    assert isinstance(cuda_kernels_available(), bool)


def test_cuda_transfer_refuses_a_cpu_cache():
    caches = make_caches("vllm_flash")
    with pytest.raises(ValueError, match="CUDA device"):
        CudaTransfer(spec_for("vllm_flash", caches), caches)


# ------------------------------------------------------------------------------ GPU tests
DESTS = {
    "pinned-direct": dict(buf_device="cpu", pin=True, mode="direct"),
    "pinned-staged": dict(buf_device="cpu", pin=True, mode="staged"),
    "pageable": dict(buf_device="cpu", pin=False, mode="direct"),
    "device": dict(buf_device="cuda", pin=False, mode="direct"),
}


def _cuda_factory(mode: str) -> MakeTransfer:
    return lambda spec, caches: CudaTransfer(spec, caches, gather_mode=mode, scatter_mode=mode)


@gpu
@needs_kernels
@pytest.mark.parametrize("dest", list(DESTS))
@pytest.mark.parametrize("aligned", [True, False], ids=["blocks", "scattered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_matches_torch(layout, dtype, aligned, dest):
    d = DESTS[dest]
    check_against_torch(_cuda_factory(d["mode"]), "cuda", layout, dtype,
                        buf_device=d["buf_device"], pin=d["pin"], aligned=aligned)


@gpu
@needs_kernels
@pytest.mark.parametrize("dest", list(DESTS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_negative_slots_and_layer_subsets(layout, dest):
    d = DESTS[dest]
    check_against_torch(_cuda_factory(d["mode"]), "cuda", layout, torch.bfloat16,
                        buf_device=d["buf_device"], pin=d["pin"], negative=True,
                        layer_sets=([2], [0], [1]), layers=3)
    check_against_torch(_cuda_factory(d["mode"]), "cuda", layout, torch.float16,
                        buf_device=d["buf_device"], pin=d["pin"], negative=True,
                        layer_sets=([3, 1],), layers=4, seed=5)


@gpu
@needs_kernels
@pytest.mark.parametrize("seed", range(40))
def test_gpu_random_shapes(seed):
    case = random_case(seed)
    dest = DESTS[list(DESTS)[seed % len(DESTS)]]
    layout, dtype = case.pop("layout"), case.pop("dtype")
    check_against_torch(_cuda_factory(dest["mode"]), "cuda", layout, dtype,
                        buf_device=dest["buf_device"], pin=dest["pin"], **case)


@gpu
@needs_kernels
def test_gpu_layerwise_events_on_a_side_stream():
    """Layer-wise copies on a side stream return completion handles (lmc.transfer.completion): not
    done while the side stream is held back, done after; ``wait(stream)`` makes the engine's
    stream wait for the copy without blocking the host, so a read queued after it sees it."""
    caches = make_caches("vllm_flash", layers=4, dtype=torch.bfloat16, device="cuda")
    spec = spec_for("vllm_flash", caches)
    tr = make_transfer(spec, caches)
    assert isinstance(tr, CudaTransfer)
    slots = torch.arange(32, device="cuda")
    plan = tr.plan(slots, [(0, 16), (16, 32)])
    bufs = [torch.empty(spec.chunk_shape(16), dtype=spec.dtype, pin_memory=True)
            for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the caches were filled on this stream
    handles = [tr.gather(plan, bufs, layers=[i], stream=side) for i in range(spec.num_layers)]
    assert all(isinstance(h, Completion) for h in handles)
    handles[-1].wait()
    assert all(h.done() for h in handles)
    ref = TorchTransfer(spec, caches)
    want = [torch.empty_like(b) for b in bufs]
    ref.gather(ref.plan(slots, [(0, 16), (16, 32)]), want)
    for b, w in zip(bufs, want, strict=True):
        assert_bits_equal(b, w, "layer-wise gather on a side stream")
    # scatter back layer by layer into zeroed caches, the side stream held back by a spin
    # kernel: the handle is not done, and the engine's stream still reads the loaded layer
    # only because it waited on the handle
    zeros = make_caches("vllm_flash", layers=4, dtype=torch.bfloat16, device="cuda", zeros=True)
    tr2 = CudaTransfer(spec, zeros)
    side.wait_stream(torch.cuda.current_stream())
    plan2 = tr2.plan(slots, [(0, 16), (16, 32)])
    compute = torch.cuda.current_stream()
    for i in range(spec.num_layers):
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # ~10 ms of spinning before the copy
        h = tr2.scatter(plan2, bufs, layers=[i], stream=side)
        assert not h.done(), "a handle reported done while its copy was still queued"
        h.wait(compute)  # no host block: the compute stream waits on the copy's event
        got = zeros[i][:, :8].clone()  # queued on the compute stream after the wait
        assert_bits_equal(got, caches[i][:, :8],  # slots 0..31 = blocks 0..7
                          f"layer {i} read on the engine's stream after waiting on its handle")
    tr2.synchronize()
    assert all(h.done() for h in handles)


@gpu
@needs_kernels
def test_gpu_errors_name_the_problem():
    """Host slots (what the connectors pass) are checked at plan time, before any copy is
    queued. Device slots are not read back at plan time (that would stall the host on the
    engine's stream): a slot past the cache is skipped on the device, never written, and
    raised by the handle's host wait."""
    caches = make_caches("vllm_flash", device="cuda")
    spec = spec_for("vllm_flash", caches)
    tr = CudaTransfer(spec, caches)
    with pytest.raises(ValueError, match="slot 48"):
        tr.plan(torch.tensor([0, 48]), [(0, 2)])
    with pytest.raises(ValueError, match=r"range \(1, 3\)"):
        tr.plan(torch.tensor([0, 1]), [(1, 3)])
    before = [t.clone() for t in caches]
    bad = tr.plan(torch.tensor([0, 48], device="cuda"), [(0, 2)])
    h = tr.scatter(bad, [torch.ones(spec.chunk_shape(2))])
    with pytest.raises(ValueError, match="slot past the end of the KV cache"):
        h.wait()
    for t, b in zip(caches, before, strict=True):  # slot 0 written, nothing past the end
        assert_bits_equal(t[:, 1:], b[:, 1:], "blocks other than slot 0's")
    plan = tr.plan(torch.arange(4, device="cuda"), [(0, 4)])
    with pytest.raises(TypeError, match="chunk buffer 0 has dtype"):
        tr.gather(plan, [torch.empty(spec.chunk_shape(4), dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"chunk buffer 0 has shape \(3, 2, 3, 16\)"):
        tr.gather(plan, [torch.empty(spec.chunk_shape(3))])
    with pytest.raises(ValueError, match="2 chunk buffers for 1 planned chunks"):
        tr.gather(plan, [torch.empty(spec.chunk_shape(4))] * 2)
    with pytest.raises(ValueError, match="layer 3 is out of range"):
        tr.gather(plan, [torch.empty(spec.chunk_shape(4))], layers=[3])
