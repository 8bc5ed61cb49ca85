"""The CUDA sources, checked on a machine without a GPU.

* Every ``lmc/csrc/*.cu`` compiles with ``nvcc`` for sm_80 and sm_90, and with NVRTC (what CuPy
  uses at run time) when its library is installed.
* The entry points the Python wrapper launches exist, as ``extern "C"`` kernels in the source
  and as ``.entry`` symbols in the PTX, and each one instantiates the template its name says.
* The kernel code itself runs on the CPU: the file is compiled for the host (every helper is
  ``__host__ __device__``), each thread of the grid is executed in turn, and the real
  ``CudaTransfer`` packing logic drives it. Results must equal TorchTransfer bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import re
import shutil
import site
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from lmc import cuda_transfer as ct
from lmc.kv_spec import LAYOUTS
from tests.core.test_cuda_transfer import check_against_torch, random_case
from tests.kvutil import DTYPES, make_caches, spec_for

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
def _harness() -> str:
    lines = [f'#include "{ct.KERNEL_SOURCE}"',
             'extern "C" int lmc_emu_args_size() { return (int)sizeof(KVCopyArgs); }',
             'extern "C" long long lmc_emu_divmod(long long a, long long b, long long* r) '
             "{ return lmc_divmod(a, b, r); }"]
    for name in ct.KERNEL_NAMES:
        width = int(name.rsplit("_v", 1)[1])
        to_cache = "true" if "scatter" in name else "false"
        lines.append(f'extern "C" void emu_{name}(KVCopyArgs a, long long n) {{\n'
                     f"  for (long long t = 0; t < n; ++t)\n"
                     f"    lmc_kv_copy_thread<LmcVec<{width}>::T, {to_cache}>(a, t, n);\n}}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory) -> ctypes.CDLL:
    if NVCC is None:
        pytest.skip("nvcc not found: the kernel code was not run on the host")
    d = tmp_path_factory.mktemp("emu")
    (d / "harness.cu").write_text(_harness())
    _run([NVCC, "-std=c++17", "-O1", "-shared", "-Xcompiler", "-fPIC", "-o",
          str(d / "libemu.so"), str(d / "harness.cu")])
    lib = ctypes.CDLL(str(d / "libemu.so"))
    for name in ct.KERNEL_NAMES:
        getattr(lib, f"emu_{name}").argtypes = [ct.KVCopyArgs, ctypes.c_longlong]
    return lib


class HostBackend:
    """CupyBackend's interface on the CPU: the grid runs thread by thread, memcpy is memmove,
    host buffers count as mapped (so "direct" and "staged" both run for real)."""

    sm_count = 1

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.launches: list[tuple[str, int]] = []
        self.copies = 0

    def stream(self, stream):
        return None

    def context(self, stream):
        return contextlib.nullcontext()

    def event(self, stream):
        return None

    def wait(self, stream, plan):
        pass

    def upload(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(arr.copy())

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # garbage, never read as is

    def locate(self, buf: torch.Tensor) -> tuple[str, int]:
        if buf.device.type != "cpu":
            raise ValueError(f"is on {buf.device}")
        return "mapped", buf.data_ptr()

    def launch(self, name, blocks, args, stream):
        self.launches.append((name, blocks))
        getattr(self.lib, f"emu_{name}")(args, blocks * ct.THREADS)

    def memcpy(self, dst, src, nbytes, stream):
        self.copies += 1
        ctypes.memmove(dst, src, nbytes)


def test_args_struct_layout_matches(emu_lib):
    assert emu_lib.lmc_emu_args_size() == ctypes.sizeof(ct.KVCopyArgs)


def test_divmod_both_widths(emu_lib):
    fn = emu_lib.lmc_emu_divmod
    fn.restype = ctypes.c_longlong
    fn.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.POINTER(ctypes.c_longlong)]
    rem = ctypes.c_longlong()
    for a, b in [(0, 1), (7, 2), (2**32 - 1, 16), (2**32, 16), (2**40 + 5, 3), (5, 2**33),
                 (2**31 + 7, 2**31 - 1)]:
        assert (fn(a, b, ctypes.byref(rem)), rem.value) == divmod(a, b), (a, b)


def _emulated(lib, mode: str, max_blocks: int | None = None, log: list | None = None):
    def make(spec, caches):
        backend = HostBackend(lib)
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
    check_against_torch(_emulated(emu_lib, mode), "cpu", layout, dtype, aligned=aligned,
                        negative=not aligned, layer_sets=(None, [1]))


@pytest.mark.parametrize("seed", range(60))
def test_emulated_random_shapes(emu_lib, seed):
    case = random_case(seed)
    layout, dtype = case.pop("layout"), case.pop("dtype")
    check_against_torch(_emulated(emu_lib, ct.MODES[seed % 2], max_blocks=1 + seed % 3),
                        "cpu", layout, dtype, **case)


def test_emulated_vector_width_follows_alignment(emu_lib):
    log: list[HostBackend] = []
    check_against_torch(_emulated(emu_lib, "direct", log=log), "cpu", "vllm_flash",
                        torch.bfloat16, heads=2, dim=64)
    assert {n for b in log for n, _ in b.launches} <= {"lmc_kv_gather_v16", "lmc_kv_scatter_v16"}
    log.clear()
    check_against_torch(_emulated(emu_lib, "direct", log=log), "cpu", "vllm_flash",
                        torch.bfloat16, heads=2, dim=64, misalign=1)
    assert {n for b in log for n, _ in b.launches} == {"lmc_kv_gather_v2", "lmc_kv_scatter_v2"}


def test_emulated_staging_coalesces_adjacent_chunks(emu_lib):
    caches = make_caches("vllm_flash", layers=3, dtype=torch.float16)
    spec = spec_for("vllm_flash", caches)
    backend = HostBackend(emu_lib)
    tr = ct.CudaTransfer(spec, caches, backend=backend, gather_mode="staged")
    plan = tr.plan(torch.arange(24), [(0, 8), (8, 16), (16, 24)])
    pool = torch.empty((3, *spec.chunk_shape(8)), dtype=spec.dtype)  # chunks back to back
    tr.gather(plan, list(pool))
    assert backend.copies == 1, "adjacent chunks of one pool must move in one memcpy"
    backend.copies = 0
    tr.gather(plan, list(pool), layers=[2, 0])
    assert backend.copies == 6, "non-adjacent layers: one copy per (chunk, layer run)"


def test_helpers():
    assert ct.vector_bytes(0) == 16 and ct.vector_bytes(1024 | 8) == 8
    assert ct.vector_bytes(6) == 2 and ct.vector_bytes(3) == 1
    assert ct.lanes_for(2048, 16) == 32 and ct.lanes_for(64, 16) == 4
    assert ct.lanes_for(12, 4) == 4 and ct.lanes_for(1, 1) == 1
    assert ct.layer_runs([0, 1, 2, 5, 6, 3]) == [(0, 3), (3, 2), (5, 1)]
    assert ct.coalesce([(0, 100, 8), (8, 108, 8), (20, 116, 4), (24, 120, 0)]) == [
        (0, 100, 16), (20, 116, 4)]


def test_emulated_errors_name_the_problem(emu_lib):
    caches = make_caches("vllm_flash")
    spec = spec_for("vllm_flash", caches)
    tr = ct.CudaTransfer(spec, caches, backend=HostBackend(emu_lib))
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
        ct.CudaTransfer(spec, caches, backend=HostBackend(emu_lib), gather_mode="zero-copy")
