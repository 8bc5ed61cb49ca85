"""``lmc/transfer/csrc/kv_codecs.cu``, the codecs' device kernels: compiled by a plain C++
compiler and run thread by thread on the CPU (the ``__global__`` entry points themselves,
threads in forward and reversed order), they code and decode exactly as the torch path does
(:mod:`lmc.storage.kvcodecs`), bit for bit; on a GPU (marked ``gpu``) through NVRTC, the
same."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lmc.storage.kvcodecs import native
from lmc.storage.kvcodecs.stage import parse_stage

SOURCE = Path(__file__).resolve().parents[2] / "lmc/transfer/csrc/kv_codecs.cu"
PRELUDE = r"""
#define __global__
#define __host__
#define __device__
#define __forceinline__ inline
struct LmcDim3 { unsigned int x, y, z; };
static LmcDim3 blockIdx, threadIdx, blockDim, gridDim;
extern "C" void lmc_thread(unsigned b, unsigned t, unsigned bd, unsigned gd) {
  blockIdx.x = b; threadIdx.x = t; blockDim.x = bd; gridDim.x = gd;
}
#if defined(__x86_64__)
#include <xmmintrin.h>
// a GPU that flushes denormals (FTZ on results, DAZ on inputs), on this thread; 0: not here
extern "C" int lmc_flush_denormals(int on) {
  unsigned int csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | 0x8040u) : (csr & ~0x8040u));
  return 1;
}
#else
extern "C" int lmc_flush_denormals(int on) { return 0; }
#endif
#line 1 "kv_codecs.cu"
"""
BLOCKS, THREADS = 3, 5  # 15 threads: every grid-stride loop wraps many times
DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def cu(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to run the kernels on the CPU")
    d = tmp_path_factory.mktemp("kv_codecs_cu")
    (d / "k.cpp").write_text(PRELUDE + SOURCE.read_text())
    subprocess.run([cxx, "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(d / "k.so"),
                    str(d / "k.cpp")], check=True, capture_output=True, timeout=300)
    return ctypes.CDLL(str(d / "k.so"))


def _run(lib, name, *args, reverse=False):
    order = range(BLOCKS * THREADS - 1, -1, -1) if reverse else range(BLOCKS * THREADS)
    fn = getattr(lib, name)
    conv = []
    for a in args:
        if isinstance(a, torch.Tensor):
            conv.append(ctypes.c_void_p(a.data_ptr()))
        elif isinstance(a, tuple):  # (int,) marks a C int
            conv.append(ctypes.c_int(a[0]))
        else:
            conv.append(ctypes.c_longlong(a))
    for tid in order:
        lib.lmc_thread(tid // THREADS, tid % THREADS, THREADS, BLOCKS)
        fn(*conv)


def encode_cu(lib, codec, x, reverse=False):
    n, p, t, w = x.shape
    out = torch.zeros(codec.encoded_bytes(tuple(x.shape)), dtype=torch.uint8)
    bad = torch.zeros(1, dtype=torch.int32)
    dt = (DT[x.dtype],)
    k = codec.kernel_param(w)
    if codec.kernel == "fp8":
        rowmax = torch.zeros(n * p * t * k, dtype=torch.float32)
        _run(lib, "lmc_fp8_rowmax", x, dt, rowmax, bad, n, p, t, w, k, reverse=reverse)
        _run(lib, "lmc_fp8_scales", rowmax, out, n, p, t, w, k, reverse=reverse)
        _run(lib, "lmc_fp8_encode", x, dt, out, n, p, t, w, k, reverse=reverse)
    elif codec.kernel == "int8":
        _run(lib, "lmc_int8_encode", x, dt, out, bad, n, p, t, w, k, reverse=reverse)
    else:
        _run(lib, "lmc_int4_params", x, dt, out, bad, n, p, t, w, k, reverse=reverse)
        _run(lib, "lmc_int4_pack", x, dt, out, n, p, t, w, k, reverse=reverse)
    return out, bool(bad.item())


def decode_cu(lib, codec, buf, like):
    n, p, t, w = like.shape
    out = torch.empty_like(like)
    _run(lib, f"lmc_{codec.kernel}_decode", buf, out, (DT[like.dtype],), n, p, t, w,
         codec.kernel_param(w))
    return out


def kv_like(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[:, 0, :, 3] *= 20
    x.view(-1)[::37] *= 1e-4  # small values: e4m3 subnormals once scaled
    return x.to(dtype)


CASES = [((2, 2, 9, 24), 8), ((2, 1, 5, 20), None), ((1, 2, 4, 10), 5)]


@pytest.mark.parametrize("dtype", list(DT), ids=str)
@pytest.mark.parametrize("shape,head", CASES, ids=["mha", "mla", "odd"])
@pytest.mark.parametrize("name", ["fp8-e4m3", "int8", "int4-kivi,group=4", "int4-kivi,group=3"])
def test_device_kernels_code_as_the_torch_path(cu, monkeypatch, name, shape, head, dtype):
    codec = parse_stage(name, head_size=head).codec
    x = kv_like(shape, dtype)
    monkeypatch.setattr(native, "ENABLED", False)  # the torch formulation
    want = torch.zeros(codec.encoded_bytes(tuple(shape)), dtype=torch.uint8)
    codec.encode(x, want)
    for reverse in (False, True):
        got, bad = encode_cu(cu, codec, x, reverse)
        assert not bad
        assert torch.equal(got, want), f"{int((got != want).sum())} code bytes differ"
    values = torch.empty_like(x)
    codec.decode(want, values)
    assert torch.equal(decode_cu(cu, codec, want, x).view(torch.uint8), values.view(torch.uint8))


@pytest.mark.parametrize("dtype", list(DT), ids=str)
@pytest.mark.parametrize("name", ["fp8-e4m3", "int8", "int4-kivi,group=4"])
def test_the_bytes_do_not_depend_on_denormals_being_flushed(cu, monkeypatch, name, dtype):
    """A device may flush denormal floats to zero (an H200 did: fp16 chunks with subnormal
    values coded differently there): no step may pass through a denormal float, so the codes
    are the same with flushing on."""
    codec = parse_stage(name, head_size=8).codec
    x = kv_like((2, 2, 9, 24), dtype)
    x.view(-1)[::5] = torch.tensor(2.0 ** -20).to(dtype)  # fp16 subnormals: 2^-24 .. 2^-15
    monkeypatch.setattr(native, "ENABLED", False)
    want = torch.zeros(codec.encoded_bytes(tuple(x.shape)), dtype=torch.uint8)
    codec.encode(x, want)
    values = torch.empty_like(x)
    codec.decode(want, values)
    if not cu.lmc_flush_denormals(1):
        pytest.skip("no way to flush denormals on this processor")
    try:
        got, bad = encode_cu(cu, codec, x)
        back = decode_cu(cu, codec, want, x)
    finally:
        cu.lmc_flush_denormals(0)
    assert not bad
    assert torch.equal(got, want), f"{int((got != want).sum())} code bytes differ"
    assert torch.equal(back.view(torch.uint8), values.view(torch.uint8))


@pytest.mark.parametrize("name", ["fp8-e4m3", "int8", "int4-kivi"])
def test_device_kernels_flag_a_non_finite_chunk(cu, name):
    codec = parse_stage(name).codec
    x = kv_like((1, 2, 4, 16), torch.bfloat16)
    x[0, 1, 2, 3] = float("inf")
    assert encode_cu(cu, codec, x)[1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DT), ids=str)
@pytest.mark.parametrize("name", ["fp8-e4m3", "int8", "int4-kivi"])
def test_on_the_device_the_bytes_are_the_cpu_paths(name, dtype):
    from lmc.storage.kvcodecs import cuda as cuda_codecs
    from lmc.transfer.cuda_copy import cuda_kernels_available

    if not cuda_kernels_available():
        pytest.skip("no CUDA device with CuPy")
    codec = parse_stage(name, head_size=64).codec
    x = kv_like((30, 2, 256, 192), dtype)
    want = torch.zeros(codec.encoded_bytes(tuple(x.shape)), dtype=torch.uint8)
    codec.encode(x, want)
    got = torch.zeros_like(want, device="cuda")
    cuda_codecs.encode(codec, x.cuda(), got)
    assert torch.equal(got.cpu(), want)
    values = torch.empty_like(x)
    codec.decode(want, values)
    dev = torch.empty_like(x, device="cuda")
    cuda_codecs.decode(codec, want.cuda(), dev)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu().view(torch.uint8), values.view(torch.uint8))
