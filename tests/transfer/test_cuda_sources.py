"""The CUDA sources, checked on a machine without a GPU.

* Every ``lmc/transfer/csrc/*.cu`` compiles with ``nvcc`` for sm_80 and sm_90, and with NVRTC (what CuPy
  uses at run time) when its library is installed.
* The entry points the Python wrapper launches exist, as ``extern "C"`` kernels in the source
  and as ``.entry`` symbols in the PTX, and each one instantiates the template its name says.
* The kernel code itself runs on the CPU (:mod:`tests.transfer.cuda_emulation`): the file is
  compiled by a plain C++ compiler, the ``__global__`` entry points run thread by thread in
  several orders, every vector access is checked for bounds, alignment and write races, and
  the real ``CudaTransfer`` packing logic drives them. Results must equal a reference written
  from each layout's definition, and TorchTransfer, bit for bit; sparse virtual caches of more
  than 2^32 elements (slots past 2^32) check the 64-bit address arithmetic.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import random
import re
import shutil
import site
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmc.transfer import cuda_copy as ct
from lmc.transfer.completion import Completion
from lmc.transfer.kv_spec import LAYOUTS, KVSpec
from lmc.transfer.plan import ChunkPlan
from lmc.transfer.torch_copy import TorchTransfer
from tests.kvutil import (
    DTYPES,
    assert_bits_equal,
    bits,
    make_caches,
    random_bits,
    spec_for,
    token_kv,
)
from tests.requirements import missing
from tests.transfer import cuda_emulation as emu
from tests.transfer.test_cuda_transfer import check_against_torch, random_case

CSRC = Path(ct.__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cu"))


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "bin", "nvcc").exists():
            return str(Path(root, "bin", "nvcc"))
    return None


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit "
                                "or set CUDA_HOME); the CUDA sources were not compiled")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}"
    return res


def test_there_are_sources():
    assert ct.KERNEL_SOURCE in SOURCES


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles(src, arch, tmp_path):
    ptx = tmp_path / f"{src.stem}.ptx"
    _run([NVCC, "-std=c++17", "--ptx", f"-arch={arch}", "-Werror", "all-warnings",
          "-o", str(ptx), str(src)])
    if src == ct.KERNEL_SOURCE:
        entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx.read_text()))
        missing = set(ct.KERNEL_NAMES) - entries
        assert not missing, f"{src.name} PTX for {arch} lacks entry points {sorted(missing)}"


def test_entry_points_are_extern_c_and_match_their_names():
    text = ct.KERNEL_SOURCE.read_text()
    for name in ct.KERNEL_NAMES:
        m = re.search(r'extern "C" __global__ void __launch_bounds__\(LMC_THREADS\) '
                      + name + r"\(const KVCopyArgs a\) \{\s*lmc_kv_copy_thread<LmcVec<(\d+)>::T, "
                      r"(true|false)>", text)
        assert m, f'no extern "C" kernel {name}(const KVCopyArgs) in {ct.KERNEL_SOURCE.name}'
        width, to_cache = int(m.group(1)), m.group(2) == "true"
        assert name.endswith(f"_v{width}"), f"{name} instantiates a {width}-byte vector"
        assert ("scatter" in name) == to_cache, f"{name} moves the wrong way"


def test_constants_agree_with_the_source():
    text = ct.KERNEL_SOURCE.read_text()
    assert f"#define LMC_THREADS {ct.THREADS}" in text
    assert f"#define LMC_GEOM {ct.GEOM}" in text
    fields = re.search(r"struct KVCopyArgs \{(.*?)\};", text, re.S).group(1)
    names = re.findall(r"(\w+);", fields)
    assert names == [f for f, _ in ct.KVCopyArgs._fields_], "KVCopyArgs fields differ"


# ------------------------------------------------------------------------------- NVRTC
def _libnvrtc() -> str | None:
    pats = []
    for sp in site.getsitepackages() + [site.getusersitepackages()]:
        pats += [os.path.join(sp, "nvidia", "*", "lib", "libnvrtc.so*"),
                 os.path.join(sp, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")]
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            pats.append(os.path.join(root, "lib64", "libnvrtc.so*"))
    for pat in pats:
        for path in sorted(glob.glob(pat)):
            if "builtins" not in path:
                return path
    return None


@pytest.mark.skipif(_libnvrtc() is None, reason="libnvrtc not found (pip install "
                    "nvidia-cuda-nvrtc): the run-time compile path was not checked")
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_nvrtc_compiles_with_the_wrapper_options(arch):
    lib = ctypes.CDLL(_libnvrtc())
    prog = ctypes.c_void_p()
    src = ct.KERNEL_SOURCE.read_bytes()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kv_transfer.cu", 0, None, None) == 0
    opts = [o.encode() for o in (*ct.NVRTC_OPTIONS, f"--gpu-architecture={arch}")]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, f"NVRTC failed:\n{log.value.decode()}"
    entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx.value.decode()))
    assert set(ct.KERNEL_NAMES) <= entries


# --------------------------------------------------------------------- host emulation
@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory) -> ctypes.CDLL:
    if emu.compiler() is None:
        missing("no C++ compiler (g++ or clang++): the kernel code was not run on the host")
    return emu.build(tmp_path_factory.mktemp("emu"))


def test_args_struct_layout_matches(emu_lib):
    assert emu_lib.lmc_emu_args_size() == ctypes.sizeof(ct.KVCopyArgs)


def test_divmod_both_widths(emu_lib):
    rem = ctypes.c_longlong()
    for a, b in [(0, 1), (7, 2), (2**32 - 1, 16), (2**32, 16), (2**40 + 5, 3), (5, 2**33),
                 (2**31 + 7, 2**31 - 1)]:
        assert (emu_lib.lmc_emu_divmod(a, b, ctypes.byref(rem)), rem.value) == divmod(a, b)


def _emulated(lib, mode: str, max_blocks: int | None = None, log: list | None = None,
              order: int = 0, seed: int = 0):
    def make(spec, caches):
        tensors = [t for _, ts in spec.split_layers(caches) for t in ts]
        backend = emu.HostBackend(lib, order=order, seed=seed, caches=tensors)
        if log is not None:
            log.append(backend)
        return ct.CudaTransfer(spec, caches, backend=backend, gather_mode=mode,
                               scatter_mode=mode, max_blocks=max_blocks)
    return make


@pytest.mark.parametrize("mode", ct.MODES)
@pytest.mark.parametrize("aligned", [True, False], ids=["blocks", "scattered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_kernels_match_torch(emu_lib, layout, dtype, aligned, mode):
    order = (LAYOUTS.index(layout) + DTYPES.index(dtype) + aligned) % len(emu.ORDERS)
    check_against_torch(_emulated(emu_lib, mode, order=order, seed=order), "cpu", layout,
                        dtype, aligned=aligned, negative=not aligned, layer_sets=(None, [1]))


@pytest.mark.parametrize("seed", range(60))
def test_emulated_random_shapes(emu_lib, seed):
    case = random_case(seed)
    layout, dtype = case.pop("layout"), case.pop("dtype")
    check_against_torch(_emulated(emu_lib, ct.MODES[seed % 2], max_blocks=1 + seed % 3,
                                  order=seed % len(emu.ORDERS), seed=seed),
                        "cpu", layout, dtype, **case)


# ----------------------------------------------- against the layouts' definitions directly
CASES = [(lay, "NHD") for lay in LAYOUTS] + [("vllm_gpu", "HND"), ("vllm_gpu", "BLNHC")]


def _caches(layout: str, order: str, dtype, zeros=False, seed=0):
    if order == "BLNHC":
        from tests.transfer.test_kv_spec import vllm_gpu_caches
        return vllm_gpu_caches(order, dtype=dtype, blocks=12, zeros=zeros, seed=seed)
    return make_caches(layout, order=order, dtype=dtype, zeros=zeros, seed=seed)


@pytest.mark.parametrize("mode", ct.MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout,order", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_emulated_kernels_match_the_layout_definition(emu_lib, layout, order, dtype, mode):
    """Reference: tests.kvutil.token_kv, which indexes each layout as its engine defines it
    (never through lmc's strides). Skipped rows (slot -1) stay as they were; a scatter writes
    exactly the addressed slots."""
    rng = random.Random(f"{layout}{order}{dtype}{mode}")
    src = _caches(layout, order, dtype, seed=1)
    spec = spec_for(layout, src)
    total = spec.num_blocks * spec.block_size
    slots = torch.tensor(rng.sample(range(total), 21), dtype=torch.int64)
    slots[[3, 11]] = -1
    ranges = [(0, 8), (8, 8), (8, 21)]
    valid = slots >= 0
    gen = torch.Generator().manual_seed(2)
    bufs = [random_bits(spec.chunk_shape(e - s), dtype, gen) for s, e in ranges]
    before = [b.clone() for b in bufs]
    order_i = rng.randrange(len(emu.ORDERS))
    tr = _emulated(emu_lib, mode, max_blocks=2, order=order_i, seed=order_i)(spec, src)
    tr.gather(tr.plan(slots, ranges), bufs)
    want = token_kv(spec, src, slots.clamp(min=0))
    got = torch.cat([b for b in bufs], dim=2)
    old = torch.cat([b for b in before], dim=2)
    assert_bits_equal(got[:, :, valid], want[:, :, valid], f"{layout} {order} gather")
    assert_bits_equal(got[:, :, ~valid], old[:, :, ~valid], "rows of skipped slots")

    dst = _caches(layout, order, dtype, zeros=True)
    tr2 = _emulated(emu_lib, mode, order=3 - order_i, seed=7)(spec, dst)
    tr2.scatter(tr2.plan(slots, ranges), bufs)
    everything = token_kv(spec, dst, torch.arange(total))
    expect = torch.zeros_like(bits(everything))
    expect[:, :, slots[valid]] = bits(got[:, :, valid])
    assert torch.equal(bits(everything), expect), f"{layout} {order} scatter"


def test_thread_orders_and_grid_sizes_agree(emu_lib):
    caches = make_caches("vllm_gpu", heads=3, dim=16, dtype=torch.bfloat16)
    spec = spec_for("vllm_gpu", caches)
    slots = torch.randperm(spec.num_blocks * spec.block_size,
                           generator=torch.Generator().manual_seed(0))[:30]
    outs = []
    for order in range(len(emu.ORDERS)):
        for blocks in (1, 3):
            tr = _emulated(emu_lib, "direct", max_blocks=blocks, order=order, seed=blocks)(
                spec, caches)
            buf = torch.zeros(spec.chunk_shape(30), dtype=spec.dtype)
            tr.gather(tr.plan(slots, [(0, 30)]), [buf])
            outs.append(buf)
    for o in outs[1:]:
        assert_bits_equal(o, outs[0], "orders / grid sizes")


class _GridBackend(emu.HostBackend):
    """The emulation, noting each launch's kernel and grid."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.grids: list[tuple[str, int]] = []

    def launch(self, name, blocks, args, stream):
        self.grids.append((name.split("_")[2], blocks))
        super().launch(name, blocks, args, stream)


@pytest.mark.parametrize("mode", ct.MODES)
def test_gathers_take_their_own_grid_cap_and_copy_the_same(emu_lib, monkeypatch, mode):
    """``gather_blocks`` (or ``LMC_CUDA_GATHER_BLOCKS``) caps the saves' grid, whole-model
    and per layer, and leaves the loads' at ``max_blocks``; the bytes are the same."""
    caches = make_caches("vllm_flash", layers=2, heads=3, dim=16, dtype=torch.bfloat16)
    spec = spec_for("vllm_flash", caches)
    slots = torch.arange(48)
    outs = []
    for env, kw in ((None, {}), ("2", {}), (None, {"gather_blocks": 1})):
        if env is None:
            monkeypatch.delenv("LMC_CUDA_GATHER_BLOCKS", raising=False)
        else:
            monkeypatch.setenv("LMC_CUDA_GATHER_BLOCKS", env)
        be = _GridBackend(emu_lib, caches=list(caches))
        tr = ct.CudaTransfer(spec, caches, backend=be, gather_mode=mode, scatter_mode=mode,
                             max_blocks=5, **kw)
        plan = tr.plan(slots, [(0, 24), (24, 48)])
        bufs = [torch.zeros(spec.chunk_shape(24), dtype=spec.dtype) for _ in range(2)]
        tr.gather(plan, bufs)
        tr.gather(plan, bufs, [1])
        tr.scatter(plan, bufs)
        tr.synchronize()
        cap = {None: 5, "2": 2}[env] if not kw else 1
        assert max(b for k, b in be.grids if k == "gather") == cap  # the whole-model call
        assert max(b for k, b in be.grids if k == "scatter") == 5
        outs.append(bufs)
    for o in outs[1:]:
        for a, b in zip(o, outs[0]):
            assert_bits_equal(a, b, "grid caps")
    monkeypatch.delenv("LMC_CUDA_GATHER_BLOCKS", raising=False)
    big = _GridBackend(emu_lib, caches=list(caches))
    big.sm_count = 132  # an H200's: saves a layer at a time on 8 blocks, the rest on 528
    tr = ct.CudaTransfer(spec, caches, backend=big, gather_mode=mode, scatter_mode=mode)
    assert (tr.max_blocks, tr.gather_blocks, tr.layer_gather_blocks) == (528, 528, 8)
    monkeypatch.setenv("LMC_CUDA_GATHER_BLOCKS", "many")
    with pytest.raises(ValueError, match="LMC_CUDA_GATHER_BLOCKS must be a whole number"):
        ct.CudaTransfer(spec, caches, backend=_GridBackend(emu_lib, caches=list(caches)))


# ------------------------------------------------------------ the checker itself can fail
def test_duplicate_slots_in_a_scatter_are_a_race(emu_lib):
    caches = make_caches("vllm_flash")
    spec = spec_for("vllm_flash", caches)
    tr = _emulated(emu_lib, "direct")(spec, caches)
    with pytest.raises(AssertionError, match="written by two threads"):
        tr.scatter(tr.plan(torch.tensor([5, 9, 5]), [(0, 3)]),
                   [torch.zeros(spec.chunk_shape(3))])


def test_out_of_bounds_and_misaligned_accesses_are_caught(emu_lib):
    caches = make_caches("vllm_flash", dtype=torch.float16, dim=8)
    spec = spec_for("vllm_flash", caches)
    log: list = []
    tr = _emulated(emu_lib, "direct", log=log)(spec, caches)
    plan = tr.plan(torch.arange(4), [(0, 4)])
    buf = torch.zeros(spec.chunk_shape(4), dtype=spec.dtype)
    tr.gather(plan, [buf])  # fine as built
    tr.cache_ptrs = tr.cache_ptrs + 16 * spec.row_width * 2 * spec.block_size * 12  # past the end
    with pytest.raises(AssertionError, match="out of bounds"):
        tr.gather(plan, [buf])
    tr.cache_ptrs = tr.cache_ptrs - 16 * spec.row_width * 2 * spec.block_size * 12 + 2
    tr._static_align = 0  # lie about alignment: the kernel gets 16-byte vectors at +2 bytes
    with pytest.raises(AssertionError, match="misaligned vector access"):
        tr.gather(plan, [buf])
    assert log[0].accesses > 0


# --------------------------------------------------- 64-bit offsets on sparse virtual caches
BIG_SLOTS = 2**33 + 64   # slots past 2^32; every cache holds far more than 2^32 elements
VBASE = 2**40            # virtual addresses of the caches start here (far from real memory)
PAGE = 4096


@dataclasses.dataclass
class Physical:
    """A layout's memory as its engine defines it: one contiguous array of ``shape`` for all
    layers, ``index(l, p, slot, h, d)`` its position, ``views(backing)`` the layer tensors."""

    shape: tuple[int, ...]
    index: Callable[[int, int, int, int, int], tuple[int, ...]]
    views: Callable[[torch.Tensor], object]


def _physical(layout: str, order: str, L: int, H: int, D: int, bs: int) -> Physical:
    nb = BIG_SLOTS // bs
    if layout == "vllm_flash":
        return Physical((L, 2, nb, bs, H, D), lambda y, p, s, h, d: (y, p, s // bs, s % bs, h, d),
                        lambda t: list(t.unbind(0)))
    if layout == "vllm_flashinfer":
        return Physical((L, nb, 2, bs, H, D), lambda y, p, s, h, d: (y, s // bs, p, s % bs, h, d),
                        lambda t: list(t.unbind(0)))
    if layout == "vllm_mla":
        return Physical((L, nb, bs, D), lambda y, p, s, h, d: (y, s // bs, s % bs, d),
                        lambda t: list(t.unbind(0)))
    if layout == "vllm_cpu":  # per (block, head): K^T [D, bs] then V [bs, D]
        return Physical((L, nb, H, 2 * D * bs),
                        lambda y, p, s, h, d: (y, s // bs, h, d * bs + s % bs if p == 0
                                               else D * bs + (s % bs) * D + d),
                        lambda t: [x.view(nb, H, bs, 2 * D) for x in t.unbind(0)])
    if layout == "vllm_gpu" and order == "NHD":
        return Physical((L, nb, bs, H, 2 * D),
                        lambda y, p, s, h, d: (y, s // bs, s % bs, h, p * D + d),
                        lambda t: [x.transpose(1, 2) for x in t.unbind(0)])
    if layout == "vllm_gpu" and order == "HND":
        return Physical((L, nb, H, bs, 2 * D),
                        lambda y, p, s, h, d: (y, s // bs, h, s % bs, p * D + d),
                        lambda t: list(t.unbind(0)))
    if layout == "vllm_gpu":  # BLNHC: blocks outermost, the layers' pages inside each block
        return Physical((nb, L, bs, H, 2 * D),
                        lambda y, p, s, h, d: (s // bs, y, s % bs, h, p * D + d),
                        lambda t: [x.transpose(1, 2) for x in t.unbind(1)])
    if layout == "sglang_mha":
        return Physical((L, 2, BIG_SLOTS, H, D), lambda y, p, s, h, d: (y, p, s, h, d),
                        lambda t: ([x[0] for x in t.unbind(0)], [x[1] for x in t.unbind(0)]))
    return Physical((L, BIG_SLOTS, 1, D), lambda y, p, s, h, d: (y, s, 0, d),  # sglang_mla
                    lambda t: list(t.unbind(0)))


def _big_slots(bs: int) -> list[int]:
    """Whole blocks and single slots around 2^31, 2^32 and the top of the cache, and a hole."""
    top = BIG_SLOTS - 2 * bs
    slots = [0, 1, 2**31 - 1, 2**31 + 5, *range(2**32 - 3, 2**32 + 5), -1,
             *range(top, top + 2 * bs), 2**33 + 7, 2**32 + 2**31 + 3]
    return list(dict.fromkeys(slots))


class Sparse:
    """Real pages behind the few virtual pages a test touches."""

    def __init__(self, addrs: np.ndarray, fill: str, seed: int = 0) -> None:
        self.pages = np.unique(addrs // PAGE)
        n = len(self.pages) * PAGE
        self.mem = (np.zeros(n, np.uint8) if fill == "zeros"
                    else np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))

    def index(self, addrs: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.pages, addrs // PAGE) * PAGE + addrs % PAGE

    def regions(self, writable: bool) -> list[emu.Region]:
        base = self.mem.ctypes.data
        return [(int(pg) * PAGE, PAGE, base + i * PAGE, writable)
                for i, pg in enumerate(self.pages.tolist())]


def _hand_plan(slots: list[int], ranges: list[tuple[int, int]]) -> ct.CudaPlan:
    """The kernel's token table as documented in kv_transfer.cu: [slot; (chunk << 32) | row]."""
    counts = [e - s for s, e in ranges]
    idx = np.concatenate([np.arange(s, e) for s, e in ranges])
    chunk = np.repeat(np.arange(len(ranges)), counts)
    row = idx - np.repeat([s for s, _ in ranges], counts)
    tokens = torch.from_numpy(np.stack([np.array(slots, np.int64)[idx],
                                        (chunk << 32) | row]).astype(np.int64))
    chunks = [ChunkPlan(s, e, "kernel", torch.tensor(slots[s:e]), None, None) for s, e in ranges]
    return ct.CudaPlan(chunks=chunks, counts=counts,
                       holes=[min(slots[s:e], default=0) < 0 for s, e in ranges],
                       tokens=tokens, n_tokens=sum(counts))


def _run_big(lib, layout: str, order: str, dtype, mode: str) -> None:
    mla = layout in ("vllm_mla", "sglang_mla")
    L, H, D = 2, 1 if mla else 2, 12 if mla else 4
    bs = 1 if layout.startswith("sglang") else 2
    phys = _physical(layout, order, L, H, D, bs)
    esize = dtype.itemsize
    numel = int(np.prod(phys.shape))
    backing = torch.empty(VBASE // esize + numel, dtype=dtype, device="meta")[VBASE // esize:]
    caches = phys.views(backing.view(phys.shape))
    spec = KVSpec.from_tensors(caches, layout)
    assert spec.num_blocks * spec.block_size == BIG_SLOTS and numel > 2**33

    slots = _big_slots(bs)
    ranges = [(0, 5), (5, len(slots) - 3), (len(slots) - 3, len(slots))]
    valid = [s for s in slots if s >= 0]
    # byte address of every (layer, plane, valid token, head, dim), from the definition alone
    strides = np.array([int(np.prod(phys.shape[i + 1:])) for i in range(len(phys.shape))])
    addrs = np.array([[[[[VBASE + esize * int(np.dot(phys.index(lid, p, s, h, d), strides))
                          for d in range(D)] for h in range(H)] for s in valid]
                       for p in range(spec.num_planes)] for lid in range(L)], dtype=np.int64)
    pos = [i for i, s in enumerate(slots) if s >= 0]
    item = _INT[esize]

    # gather: what sits at the definition's addresses lands in the chunk rows
    mem = Sparse(addrs, "random", seed=1)
    backend = emu.HostBackend(lib, order=2, seed=3)
    backend.virtual = mem.regions(writable=False)
    tr = ct.CudaTransfer(spec, caches, backend=backend, gather_mode=mode, scatter_mode=mode)
    assert int(tr.cache_ptrs.min()) >= VBASE and int(tr.cache_ptrs.max()) < 2**44
    gen = torch.Generator().manual_seed(4)
    bufs = [random_bits(spec.chunk_shape(e - s), dtype, gen) for s, e in ranges]
    old = torch.cat([bits(b).clone() for b in bufs], dim=2)
    tr.gather(_hand_plan(slots, ranges), bufs)
    got = torch.cat([bits(b) for b in bufs], dim=2)
    elems = mem.mem.view(item)[mem.index(addrs) // esize]          # [L, P, n, H, D]
    want = torch.from_numpy(elems.reshape(L, spec.num_planes, len(valid), H * D).copy())
    assert np.array_equal(got[:, :, pos].numpy().view(item), want.numpy()), f"{layout} gather"
    assert torch.equal(got[:, :, slots.index(-1)], old[:, :, slots.index(-1)])

    # scatter: the chunk rows land at exactly those addresses, nothing else is written
    mem = Sparse(addrs, "zeros")
    backend = emu.HostBackend(lib, order=3, seed=5)
    backend.virtual = mem.regions(writable=True)
    tr = ct.CudaTransfer(spec, caches, backend=backend, gather_mode=mode, scatter_mode=mode)
    tr.scatter(_hand_plan(slots, ranges), bufs)
    at = mem.index(addrs) // esize
    assert np.array_equal(mem.mem.view(item)[at], want.numpy().reshape(at.shape)), \
        f"{layout} scatter"
    written = np.zeros(mem.mem.size // esize, bool)
    written[at.ravel()] = True
    assert not mem.mem.view(item)[~written].any(), f"{layout} scatter wrote outside its slots"


_INT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout,order", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_64bit_offsets_on_sparse_virtual_caches(emu_lib, layout, order, dtype):
    _run_big(emu_lib, layout, order, dtype, ct.MODES[DTYPES.index(dtype) % 2])


MUTANTS = {  # a 32-bit slip the 64-bit test must catch
    "int32 block offset": ("in_blk * g[1];", "(int)(blk * g[0])", "blk * g[0]"),
    "int32 slot": ("const lmc_i64 slot = a.tokens[t];", "const int slot = (int)a.tokens[t];",
                   None),
    "int32 block id": ("const lmc_i64 blk = lmc_divmod(slot, a.block_size, &in_blk);",
                       "const int blk = (int)lmc_divmod(slot, a.block_size, &in_blk);", None),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_64bit_test_catches_32bit_arithmetic(emu_lib, mutant, tmp_path):
    """Compile the kernel with one 32-bit slip and show the sparse-cache test fails on it."""
    anchor, new, old = MUTANTS[mutant]
    text = ct.KERNEL_SOURCE.read_text()
    assert anchor in text, f"the kernel changed: update the {mutant!r} mutant"
    mutated = text.replace(old, new) if old else text.replace(anchor, new)
    assert mutated != text
    (tmp_path / "kv_transfer.cu").write_text(mutated)
    lib = emu.build(tmp_path, tmp_path / "kv_transfer.cu")
    with pytest.raises(AssertionError):
        _run_big(lib, "sglang_mla", "NHD", torch.float16, "direct")
    with pytest.raises(AssertionError):
        _run_big(lib, "vllm_gpu", "NHD", torch.bfloat16, "direct")


# --------------------------------------------------------------------- wrapper behaviour
def test_emulated_vector_width_follows_alignment(emu_lib):
    log: list[emu.HostBackend] = []
    check_against_torch(_emulated(emu_lib, "direct", log=log), "cpu", "vllm_flash",
                        torch.bfloat16, heads=2, dim=64)
    assert {n for b in log for n, _ in b.launches} <= {"lmc_kv_gather_v16", "lmc_kv_scatter_v16"}
    log.clear()
    check_against_torch(_emulated(emu_lib, "direct", log=log), "cpu", "vllm_flash",
                        torch.bfloat16, heads=2, dim=64, misalign=1)
    assert {n for b in log for n, _ in b.launches} == {"lmc_kv_gather_v2", "lmc_kv_scatter_v2"}


def test_vllm_gpu_moves_one_head_per_segment(emu_lib):
    caches = make_caches("vllm_gpu", heads=4, dim=64, dtype=torch.float16)
    tr = _emulated(emu_lib, "direct")(spec_for("vllm_gpu", caches), caches)
    assert tr.geom[:, 4].tolist() == [64, 64], "K and V alternate per head: 64-element runs"
    assert tr.geom[1, 2] == 2 * 64 * 2, "next head of a plane is past the other plane's head"


def test_emulated_staging_coalesces_adjacent_chunks(emu_lib):
    caches = make_caches("vllm_flash", layers=3, dtype=torch.float16)
    spec = spec_for("vllm_flash", caches)
    backend = emu.HostBackend(emu_lib, caches=list(caches))
    tr = ct.CudaTransfer(spec, caches, backend=backend, gather_mode="staged")
    plan = tr.plan(torch.arange(24), [(0, 8), (8, 16), (16, 24)])
    pool = torch.empty((3, *spec.chunk_shape(8)), dtype=spec.dtype)  # chunks back to back
    tr.gather(plan, list(pool))
    assert backend.copies == 1, "adjacent chunks of one pool must move in one memcpy"
    backend.copies = 0
    tr.gather(plan, list(pool), layers=[2, 0])
    assert backend.copies == 2, "non-adjacent layers: one 2D copy per layer run"


def test_emulated_per_layer_staging_is_one_2d_copy_per_layer(emu_lib):
    """A per-layer staged call over evenly spaced chunks moves in one 2D copy, not one copy
    per chunk (what made per-layer staged scatter slow); chunks not evenly spaced fall back
    to a copy each; the bytes match the torch path either way."""
    caches = make_caches("vllm_flash", layers=4, blocks=16, block_size=4)
    spec = spec_for("vllm_flash", caches)
    backend = emu.HostBackend(emu_lib, caches=list(caches))
    tr = ct.CudaTransfer(spec, caches, backend=backend, gather_mode="staged",
                         scatter_mode="staged")
    ref = TorchTransfer(spec, caches)
    plan = tr.plan(torch.arange(48), [(0, 16), (16, 32), (32, 48)])
    spaced = torch.empty((3, 2, *spec.chunk_shape(16)))  # chunk i at pool[i, 0]: a gap each
    bufs = [spaced[i, 0] for i in range(3)]
    want = [torch.empty(spec.chunk_shape(16)) for _ in range(3)]
    ref.gather(ref.plan(torch.arange(48), [(0, 16), (16, 32), (32, 48)]), want)
    for layer in range(4):
        backend.copies = 0
        tr.gather(plan, bufs, layers=[layer])
        assert backend.copies == 1, f"layer {layer}: {backend.copies} copies for 3 chunks"
        for b, w in zip(bufs, want, strict=True):
            assert_bits_equal(b[layer], w[layer], f"layer {layer} gathered")
    uneven = [spaced[0, 0], spaced[1, 1], spaced[2, 0]]
    backend.copies = 0
    tr.gather(plan, uneven, layers=[1])
    assert backend.copies == 2, "chunks 0-1 are one step apart (one 2D copy), chunk 2 is not"
    for b, w in zip(uneven, want, strict=True):
        assert_bits_equal(b[1], w[1], "uneven chunks gathered")
    zeros = make_caches("vllm_flash", layers=4, blocks=16, block_size=4, zeros=True)
    back = ct.CudaTransfer(spec, zeros, backend=emu.HostBackend(emu_lib, caches=list(zeros)),
                           scatter_mode="staged")
    p2 = back.plan(torch.arange(48), [(0, 16), (16, 32), (32, 48)])
    for layer in range(4):
        back.scatter(p2, bufs, layers=[layer])
        assert back.backend.copies == layer + 1
    assert_bits_equal(token_kv(spec, zeros, torch.arange(48)),
                      token_kv(spec, caches, torch.arange(48)), "per-layer staged scatter")


def test_strided_groups_only_what_one_2d_copy_can_move():
    def w(*copies, win=0):  # copies inside one host window
        return [(*c, win) for c in copies]

    assert ct.strided([]) == []
    assert ct.strided(w((0, 100, 8))) == [(0, 8, 100, 8, 8, 1)]
    assert ct.strided(w((0, 100, 8), (8, 116, 8), (16, 132, 8))) == [(0, 8, 100, 16, 8, 3)]
    # a pitch under the width (overlapping rows) or a size change breaks the group
    assert ct.strided(w((0, 100, 8), (4, 104, 8))) == [(0, 8, 100, 8, 8, 1),
                                                       (4, 8, 104, 8, 8, 1)]
    assert ct.strided(w((0, 0, 8), (8, 8, 4)))[0][5] == 1
    assert ct.strided(w((0, 0, 8), (16, 16, 8), (40, 32, 8))) == [
        (0, 16, 0, 16, 8, 2), (40, 8, 32, 8, 8, 1)]
    big = ct.MAX_PITCH + 1
    assert all(c[5] == 1 for c in ct.strided(w((0, 0, 8), (big, 8, 8))))
    assert all(c[5] == 1 for c in ct.strided(w((100, 100, 8), (0, 200, 8))))  # backwards
    # evenly spaced rows in two host windows (two allocations or registrations): the driver
    # refuses one 2D copy over both (cudaErrorInvalidValue on an H100)
    two = [(0, 100, 8, 0), (16, 116, 8, 0), (32, 132, 8, 32), (48, 148, 8, 32)]
    assert ct.strided(two) == [(0, 16, 100, 16, 8, 2), (32, 16, 132, 16, 8, 2)]


def test_copies_are_cut_where_a_host_window_ends():
    """A span across a registration boundary becomes two copies, each tagged with its window;
    coalescing never merges across windows."""
    def window_of(addr):  # registrations [0, 64) and [64, 128)
        return (0, 64) if addr < 64 else (64, 128)

    assert ct.cut_at_windows([(40, 1000, 48)], window_of) == [(40, 1000, 24, 0),
                                                              (64, 1024, 24, 64)]
    assert ct.cut_at_windows([(0, 0, 64)], window_of) == [(0, 0, 64, 0)]
    assert ct.coalesce([(0, 0, 64, 0), (64, 64, 8, 64)]) == [(0, 0, 64, 0), (64, 64, 8, 64)]
    assert ct.coalesce([(0, 0, 8, 0), (8, 8, 8, 0), (16, 16, 0, 0)]) == [(0, 0, 16, 0)]


def test_pinned_ranges_registry():
    from lmc.memory import pinned_ranges as pr

    base = 1 << 60  # far from any real registration of this process
    pr.add(base, 100)
    pr.add(base + 100, 50)
    try:
        assert pr.window(base) == (base, base + 100)
        assert pr.window(base + 99) == (base, base + 100)
        assert pr.window(base + 100) == (base + 100, base + 150)
        assert pr.window(base + 150) is None and pr.window(base - 1) is None
        with pytest.raises(ValueError, match="registered already"):
            pr.add(base, 10)
        with pytest.raises(ValueError, match="positive size"):
            pr.add(base + 500, 0)
    finally:
        pr.remove(base)
        pr.remove(base + 100)
    assert pr.window(base) is None
    pr.remove(base)  # unknown: nothing


def test_emulated_staging_never_copies_across_registrations(emu_lib):
    """A pool page-locked in steps: chunks on both sides of a step boundary, one chunk across
    it. Per-layer and all-layer staged copies stay inside one registration each (the
    emulator refuses any copy that does not, as the driver does) and move the right bytes."""
    from lmc.memory import pinned_ranges as pr

    caches = make_caches("vllm_flash", layers=4, blocks=16, block_size=4)
    spec = spec_for("vllm_flash", caches)
    per = spec.chunk_nbytes(16)
    pool = torch.zeros(4 * per, dtype=torch.uint8)
    bufs = [pool[i * per:(i + 1) * per].view(spec.dtype).view(spec.chunk_shape(16))
            for i in range(3)]
    cut = pool.data_ptr() + per + per // 3  # the boundary falls inside chunk 1
    pr.add(pool.data_ptr(), cut - pool.data_ptr())
    pr.add(cut, 3 * per - per // 3)
    try:
        backend = emu.HostBackend(emu_lib, caches=list(caches))
        tr = ct.CudaTransfer(spec, caches, backend=backend, gather_mode="staged",
                             scatter_mode="staged")
        ref = TorchTransfer(spec, caches)
        ranges = [(0, 16), (16, 32), (32, 48)]
        want = [torch.empty(spec.chunk_shape(16)) for _ in range(3)]
        ref.gather(ref.plan(torch.arange(48), ranges), want)
        plan = tr.plan(torch.arange(48), ranges)
        for layers in ([0], [3], [1, 2], None):
            tr.gather(plan, bufs, layers=layers)
            for b, w_ in zip(bufs, want, strict=True):
                for lid in layers or range(4):
                    assert_bits_equal(b[lid], w_[lid], f"layers {layers} gathered")
        zeros = make_caches("vllm_flash", layers=4, blocks=16, block_size=4, zeros=True)
        back = ct.CudaTransfer(spec, zeros, backend=emu.HostBackend(emu_lib, caches=list(zeros)),
                               scatter_mode="staged")
        p2 = back.plan(torch.arange(48), ranges)
        for lid in range(4):
            back.scatter(p2, bufs, layers=[lid])
        assert_bits_equal(token_kv(spec, zeros, torch.arange(48)),
                          token_kv(spec, caches, torch.arange(48)), "staged scatter")
    finally:
        pr.remove(pool.data_ptr())
        pr.remove(cut)


class CountingBackend(emu.HostBackend):
    """The host emulation, counting the tables uploaded."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.uploads = 0

    def upload(self, arr: np.ndarray) -> torch.Tensor:
        self.uploads += 1
        return super().upload(arr)


@pytest.mark.parametrize("layout", ["vllm_flash", "vllm_gpu", "vllm_mla"])
def test_emulated_per_layer_calls_reuse_one_table(emu_lib, layout):
    """A layer-wise save and load (a call per layer, one plan, the same buffers) upload the
    call table of every layer once, not once a layer, and move the same bits as the torch
    path; new buffers on the same plan get a table of their own (a misaligned set, so a
    narrower vector), and a staged path still builds its table per call."""
    caches = make_caches(layout, layers=4, blocks=16, block_size=4)
    spec = spec_for(layout, caches)
    ranges = [(0, 16), (16, 32), (32, 44)]
    slots = torch.randperm(64)[:44]
    ref = TorchTransfer(spec, caches)
    want = [torch.empty(spec.chunk_shape(e - s)) for s, e in ranges]
    ref.gather(ref.plan(slots, ranges), want)
    backend = CountingBackend(emu_lib, caches=list(caches))
    tr = ct.CudaTransfer(spec, caches, backend=backend, gather_mode="direct",
                         scatter_mode="direct")
    plan = tr.plan(slots, ranges)
    bufs = [torch.full(spec.chunk_shape(e - s), -1.0) for s, e in ranges]
    before = backend.uploads
    for layer in (2, 0, 3, 1):
        tr.gather(plan, bufs, layers=[layer])
    assert backend.uploads - before == 1, "one table for every layer of the plan"
    for b, w in zip(bufs, want, strict=True):
        assert_bits_equal(b, w, f"{layout}: per-layer gathers")
    # other buffers, one of them misaligned by an element: their own table, right bytes
    raw = torch.empty(spec.chunk_nbytes(16) // spec.element_size + 1, dtype=spec.dtype)
    odd = [raw[1:].view(spec.chunk_shape(16)), *(torch.empty_like(w) for w in want[1:])]
    before = backend.uploads
    for layer in range(4):
        tr.gather(plan, odd, layers=[layer])
    assert backend.uploads - before == 1
    assert backend.launches[-1][0].endswith(f"_v{spec.element_size}"), backend.launches[-1]
    for b, w in zip(odd, want, strict=True):
        assert_bits_equal(b, w, f"{layout}: per-layer gathers into misaligned buffers")
    # and back: per-layer scatters into an empty cache
    zeros = make_caches(layout, layers=4, blocks=16, block_size=4, zeros=True)
    back_backend = CountingBackend(emu_lib, caches=list(zeros))
    back = ct.CudaTransfer(spec, zeros, backend=back_backend, scatter_mode="direct")
    p2 = back.plan(slots, ranges)
    before = back_backend.uploads
    for layer in range(4):
        back.scatter(p2, bufs, layers=[layer])
    assert back_backend.uploads - before == 1
    assert_bits_equal(token_kv(spec, zeros, slots), token_kv(spec, caches, slots),
                      f"{layout}: per-layer scatters")
    staged = ct.CudaTransfer(spec, caches, backend=backend, gather_mode="staged")
    sp = staged.plan(slots, ranges)
    before = backend.uploads
    for layer in range(4):
        staged.gather(sp, bufs, layers=[layer])
    assert backend.uploads - before == 4, "staging is per call: so is its table"


def test_helpers():
    assert ct.vector_bytes(0) == 16 and ct.vector_bytes(1024 | 8) == 8
    assert ct.vector_bytes(6) == 2 and ct.vector_bytes(3) == 1
    assert ct.lanes_for(2048, 16) == 32 and ct.lanes_for(64, 16) == 4
    assert ct.lanes_for(12, 4) == 4 and ct.lanes_for(1, 1) == 1
    assert ct.layer_runs([0, 1, 2, 5, 6, 3]) == [(0, 3), (3, 2), (5, 1)]
    assert ct.coalesce([(0, 100, 8, 0), (8, 108, 8, 0), (20, 116, 4, 0), (24, 120, 0, 0)]) == [
        (0, 100, 16, 0), (20, 116, 4, 0)]


def test_emulated_errors_name_the_problem(emu_lib):
    caches = make_caches("vllm_flash")
    spec = spec_for("vllm_flash", caches)
    tr = ct.CudaTransfer(spec, caches, backend=emu.HostBackend(emu_lib, caches=list(caches)))
    with pytest.raises(ValueError, match="slot 48"):
        tr.plan(torch.tensor([0, 48]), [(0, 2)])
    with pytest.raises(ValueError, match=r"range \(1, 3\)"):
        tr.plan(torch.tensor([0, 1]), [(1, 3)])
    plan = tr.plan(torch.arange(4), [(0, 4)])
    with pytest.raises(TypeError, match="chunk buffer 0 has dtype torch.float16"):
        tr.gather(plan, [torch.empty(spec.chunk_shape(4), dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"chunk buffer 0 has shape \(3, 2, 3, 16\)"):
        tr.scatter(plan, [torch.empty(spec.chunk_shape(3))])
    with pytest.raises(ValueError, match="layer 3 is out of range"):
        tr.gather(plan, [torch.empty(spec.chunk_shape(4))], layers=[3])
    with pytest.raises(ValueError, match="must be one of"):
        ct.CudaTransfer(spec, caches, backend=emu.HostBackend(emu_lib), gather_mode="zero-copy")


class _DeviceSlotsBackend(emu.HostBackend):
    """The emulation, with slot tensors treated as device memory: planning must not read them
    back (as on a GPU), so the device-side check of the real plan runs on the CPU."""

    def is_host(self, slots: torch.Tensor) -> bool:
        return False


def test_emulated_device_slot_past_the_cache_raises_at_the_wait(emu_lib):
    """Device slots are not read back at plan time (a sync of the engine's stream): a slot
    past the cache is skipped by the kernel -- nothing written out of bounds, the emulation
    checks every access -- and the handle's host wait names the problem."""
    caches = make_caches("vllm_flash")
    spec = spec_for("vllm_flash", caches)
    for mode in ct.MODES:
        tr = ct.CudaTransfer(spec, caches, backend=_DeviceSlotsBackend(emu_lib, caches=list(caches)),
                             gather_mode=mode, scatter_mode=mode)
        before = [t.clone() for t in caches]
        plan = tr.plan(torch.tensor([0, 48]), [(0, 2)])  # planned: no read-back, no error yet
        h = tr.scatter(plan, [torch.ones(spec.chunk_shape(2))])
        with pytest.raises(ValueError, match="slot past the end of the KV cache"):
            h.wait()
        for t, b in zip(caches, before, strict=True):
            assert_bits_equal(t[:, 1:], b[:, 1:], f"{mode}: only slot 0's block written")
        ok = tr.plan(torch.arange(4), [(0, 4)])
        tr.gather(ok, [torch.empty(spec.chunk_shape(4))]).wait()  # a good plan: no error


class _Event:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.fired = log, name, False

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.log.append(("host waits", self.name))
        self.fired = True


class _Stream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.cuda_stream = log, name, id(self)

    def wait_event(self, ev: _Event) -> None:
        self.log.append((self.name, "waits", ev.name))


class _RecordingBackend(emu.HostBackend):
    """The emulation with streams and events that record the order of every call: the
    ordering the completion handles promise, checked on the CPU."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.log: list = []
        self.n = 0

    def stream(self, stream):
        return stream if stream is not None else _Stream(self.log, "current")

    def event(self, stream):
        self.n += 1
        ev = _Event(self.log, f"e{self.n}")
        self.log.append((getattr(stream, "name", "?"), "records", ev.name))
        return ev

    def launch(self, name, blocks, args, stream):
        self.log.append((stream.name, "launch", name.split("_")[2]))
        super().launch(name, blocks, args, stream)


def test_emulated_handles_order_the_streams(emu_lib):
    """A layer-wise copy starts on its stream after its ``after`` handle, returns a handle
    on an event recorded after its kernel, and ``wait(stream)`` makes that stream wait on
    the event without blocking the host; ``wait()`` blocks the host; ``done()`` is the
    event's state."""
    caches = make_caches("vllm_flash", layers=2)
    spec = spec_for("vllm_flash", caches)
    be = _RecordingBackend(emu_lib, caches=list(caches))
    tr = ct.CudaTransfer(spec, caches, backend=be)
    side, compute = _Stream(be.log, "side"), _Stream(be.log, "compute")
    plan = tr.plan(torch.arange(8), [(0, 8)])
    start = tr.record_event(compute)
    be.log.clear()
    h = tr.scatter(plan, [torch.ones(spec.chunk_shape(8))], layers=[1], stream=side,
                   after=start)
    assert isinstance(h, Completion) and not h.done()
    log = be.log[:]
    assert log.index(("side", "waits", start.event.name)) < log.index(("side", "launch",
                                                                       "scatter"))
    assert log[-1] == ("side", "records", h.event.name), "the handle's event is not last"
    be.log.clear()
    h.wait(compute)
    assert be.log == [("compute", "waits", h.event.name)] and not h.done()
    h.wait()
    assert be.log[-1] == ("host waits", h.event.name) and h.done()


def test_emulated_paths_follow_the_call_shape_and_show_in_stats(emu_lib, monkeypatch):
    """A per-layer call takes the per-layer path and an all-layer call the all-layer one
    (here per-layer scatter direct, all-layer scatter staged: the staged one copies through
    cudaMemcpy, the direct one never does); the calls per path show in the engine's stats.
    Both paths give the torch path's bytes."""
    from lmc import CacheConfig, CacheEngine

    for var in ("LMC_CUDA_GATHER_MODE", "LMC_CUDA_SCATTER_MODE"):
        monkeypatch.delenv(var, raising=False)
    paths = {("gather", "per_layer"): "staged", ("gather", "all_layers"): "direct",
             ("scatter", "per_layer"): "direct", ("scatter", "all_layers"): "staged"}
    made: list = []

    def factory(spec, caches):
        be = emu.HostBackend(emu_lib, caches=[t for _, ts in spec.split_layers(caches)
                                              for t in ts])
        made.append(be)
        return ct.CudaTransfer(spec, caches, backend=be, paths=paths)

    src = make_caches("vllm_flash", layers=3, blocks=16, block_size=4)
    dst = make_caches("vllm_flash", layers=3, blocks=16, block_size=4, zeros=True)
    spec = spec_for("vllm_flash", src)
    tr = factory(spec, dst)
    plan = tr.plan(torch.arange(16), [(0, 16)])
    buf = [torch.randn(spec.chunk_shape(16))]
    tr.scatter(plan, buf, layers=[1]).wait()
    assert made[-1].copies == 0, "a per-layer scatter took the staged path"
    tr.scatter(plan, buf).wait()
    assert made[-1].copies > 0, "an all-layer scatter took the direct path"
    st = tr.path_stats()
    assert st["copy_path.scatter.per_layer"] == "direct"
    assert st["copy_path.scatter.all_layers"] == "staged"
    assert st["copy_calls.scatter.per_layer.direct"] == 1
    assert st["copy_calls.scatter.all_layers.staged"] == 1
    with CacheEngine(CacheConfig(chunk_size=16, local_cpu_size="4MiB"), spec, "m",
                     transfer=factory) as eng:
        toks = list(range(32))
        eng.store(toks, src, torch.arange(32))
        assert eng.retrieve(toks, dst, torch.arange(32)) == 32
        s = eng.stats()
    assert s["copy_path.gather.per_layer"] == "staged"
    assert s["copy_calls.gather.all_layers.direct"] >= 1
    assert s["copy_calls.scatter.all_layers.staged"] >= 1
    assert_bits_equal(token_kv(spec, dst, torch.arange(32)),
                      token_kv(spec, src, torch.arange(32)), "engine through both paths")


def test_emulated_forced_modes_override_the_calibration(emu_lib, monkeypatch):
    caches = make_caches("vllm_flash")
    spec = spec_for("vllm_flash", caches)
    be = emu.HostBackend(emu_lib, caches=list(caches))
    tr = ct.CudaTransfer(spec, caches, backend=be, scatter_mode="staged",
                         paths={k: "direct" for k in ct.DEFAULT_PATHS})
    assert tr.paths[("scatter", "per_layer")] == "staged"
    assert tr.paths[("gather", "per_layer")] == "direct"
    monkeypatch.setenv("LMC_CUDA_GATHER_MODE", "staged")
    tr = ct.CudaTransfer(spec, caches, backend=be, paths={k: "direct" for k in ct.DEFAULT_PATHS})
    assert tr.paths[("gather", "per_layer")] == "staged" == tr.gather_mode
    monkeypatch.setenv("LMC_CUDA_GATHER_MODE", "fast")
    with pytest.raises(ValueError, match="gather_mode must be one of"):
        ct.CudaTransfer(spec, caches, backend=be)


@given(st.lists(st.integers(1, 64), min_size=1, max_size=6),
       st.lists(st.tuples(st.integers(0, 300), st.integers(0, 80)), min_size=1, max_size=12))
def test_copies_cut_at_windows_cover_the_spans_and_never_cross_one(sizes, spans):
    """Any registrations (consecutive windows of any sizes) and any host spans inside them:
    the pieces tile each span exactly, each piece and every 2D copy built from them stays
    inside one window, and coalescing keeps every byte once."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    end = sum(sizes)

    def window_of(addr):
        i = max(j for j, s in enumerate(starts) if s <= addr)
        return starts[i], starts[i] + sizes[i]

    spans = [(h % end, 10_000 + 100 * i, min(n, end - h % end))
             for i, (h, n) in enumerate(spans)]
    pieces = ct.cut_at_windows(spans, window_of)
    it = iter(pieces)
    for h, other, n in spans:
        covered = 0
        while covered < n:
            ph, po, pn, win = next(it)
            assert (ph, po) == (h + covered, other + covered) and pn > 0
            lo, hi = window_of(ph)
            assert win == lo and ph + pn <= hi
            covered += pn
        assert covered == n
    assert next(it, None) is None
    merged = ct.coalesce(pieces)
    assert sum(p[2] for p in merged) == sum(n for _, _, n in spans)
    for d, dp, _s, _sp, width, height in ct.strided(merged):
        _lo, hi = window_of(d)
        assert d + (height - 1) * dp + width <= hi, "a 2D copy leaves its window"
