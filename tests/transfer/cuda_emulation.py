"""Run ``lmc/transfer/csrc/kv_transfer.cu`` on the CPU: the kernels' own code, checked access by access.

The .cu is compiled by a plain C++ compiler with a prelude that turns CUDA's qualifiers into
nothing and ``blockIdx``/``threadIdx``/``blockDim``/``gridDim`` into globals the launcher sets,
so the ``__global__`` entry points themselves run, one thread at a time, in the order asked
for (block-major, reversed, thread-major, shuffled). Every vector load and store goes through
the kernel's ``LMC_LOAD``/``LMC_STORE`` hooks into :func:`translate` here, which

* checks alignment (a misaligned vector access faults on a GPU, silently works on a CPU),
* maps the address through a table of regions (identity for real tensors; for sparse
  *virtual* caches, only the pages a test backs with real memory), refusing anything outside
  them and writes to read-only regions,
* records which thread wrote each vector, so two threads writing the same bytes in one launch
  (a race on a GPU, invisible in a sequential run) is an error.

The first error's message is kept; :class:`HostBackend` raises it after the launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

from lmc.transfer import cuda_copy as ct

ORDERS = ("block-major", "reversed", "thread-major", "shuffled")

PRELUDE = r"""
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <unordered_map>
#include <vector>

#define __global__
#define __host__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct LmcDim3 { unsigned int x, y, z; };
static LmcDim3 blockIdx, threadIdx, blockDim, gridDim;

namespace emu {
struct Region { uint64_t virt, len; char* real; int writable; };
static std::vector<Region> regions;  // sorted by virt, disjoint
static long long n_errors = 0, n_accesses = 0, cur_tid = 0;
static char first[600];
static std::unordered_map<uintptr_t, long long> writer;  // vector address -> writing thread
alignas(16) static char sink[64];

static char* fail(const char* what, uint64_t addr, uint64_t size, long long other) {
  if (!n_errors)
    snprintf(first, sizeof first, "%s: %llu-byte access at 0x%llx by thread %lld (other %lld)",
             what, (unsigned long long)size, (unsigned long long)addr, cur_tid, other);
  ++n_errors;
  return sink;
}

static char* translate(uint64_t addr, uint64_t size, int write) {
  ++n_accesses;
  if (addr % size) return fail("misaligned vector access", addr, size, -1);
  auto it = std::upper_bound(regions.begin(), regions.end(), addr,
                             [](uint64_t a, const Region& r) { return a < r.virt; });
  if (it == regions.begin()) return fail("out of bounds", addr, size, -1);
  --it;
  if (addr + size > it->virt + it->len) return fail("out of bounds", addr, size, -1);
  if (write && !it->writable) return fail("write to read-only memory", addr, size, -1);
  char* p = it->real + (addr - it->virt);
  if (write) {
    auto ins = writer.emplace((uintptr_t)p, cur_tid);
    if (!ins.second && ins.first->second != cur_tid)
      return fail("bytes written by two threads", addr, size, ins.first->second);
  }
  return p;
}
}  // namespace emu

template <typename T> static T* lmc_emu_at(T* p, int write) {
  return reinterpret_cast<T*>(emu::translate((uint64_t)(uintptr_t)p, sizeof(T), write));
}
#define LMC_LOAD(ptr) (*lmc_emu_at((ptr), 0))
#define LMC_STORE(ptr, val) (*lmc_emu_at((ptr), 1) = (val))
"""

LAUNCHER = r"""
typedef void (*LmcKernel)(const KVCopyArgs);
static const LmcKernel lmc_emu_kernels[] = {%(kernels)s};

static uint64_t splitmix(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

extern "C" {
int lmc_emu_args_size() { return (int)sizeof(KVCopyArgs); }
long long lmc_emu_divmod(long long a, long long b, long long* r) { return lmc_divmod(a, b, r); }
void lmc_emu_clear_regions() { emu::regions.clear(); }
void lmc_emu_add_region(uint64_t virt, uint64_t len, uint64_t real, int writable) {
  emu::Region r{virt, len, (char*)(uintptr_t)real, writable};
  emu::regions.insert(std::upper_bound(emu::regions.begin(), emu::regions.end(), r,
                                       [](const emu::Region& a, const emu::Region& b) {
                                         return a.virt < b.virt; }), r);
}
long long lmc_emu_errors() { return emu::n_errors; }
long long lmc_emu_accesses() { return emu::n_accesses; }
const char* lmc_emu_first_error() { return emu::first; }
void lmc_emu_reset_errors() { emu::n_errors = 0; emu::n_accesses = 0; emu::first[0] = 0; }

// Runs kernel `which` over grid x block threads in `order` (see ORDERS in Python).
long long lmc_emu_launch(int which, KVCopyArgs a, unsigned grid, unsigned block, int order,
                         unsigned long long seed) {
  blockDim = LmcDim3{block, 1, 1};
  gridDim = LmcDim3{grid, 1, 1};
  const long long n = (long long)grid * block;
  std::vector<long long> ids(n);
  std::iota(ids.begin(), ids.end(), 0LL);
  if (order == 1) std::reverse(ids.begin(), ids.end());
  if (order == 2)
    for (long long i = 0; i < n; ++i) ids[i] = (i %% grid) * block + i / grid;
  if (order == 3) {
    uint64_t s = seed;
    for (long long i = n - 1; i > 0; --i) std::swap(ids[i], ids[splitmix(&s) %% (i + 1)]);
  }
  emu::writer.clear();
  for (long long id : ids) {
    blockIdx.x = (unsigned)(id / block);
    threadIdx.x = (unsigned)(id %% block);
    emu::cur_tid = id;
    lmc_emu_kernels[which](a);
  }
  return emu::n_errors;
}
}
"""


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def harness_source(kernel: Path = ct.KERNEL_SOURCE) -> str:
    kernels = ", ".join(ct.KERNEL_NAMES)
    return (PRELUDE + f'#include "{kernel}"\n'
            + LAUNCHER % {"kernels": kernels})


def build(out_dir: Path, kernel: Path = ct.KERNEL_SOURCE) -> ctypes.CDLL:
    """Compile the harness around ``kernel`` into a shared library and load it."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++): cannot run the kernels")
    src, lib_path = out_dir / "harness.cpp", out_dir / "libkvemu.so"
    src.write_text(harness_source(kernel))
    res = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror",
                          "-Wno-unused-function", "-o", str(lib_path), str(src)],
                         capture_output=True, text=True, timeout=300)
    if res.returncode:
        raise RuntimeError(f"compiling the kernel for the host failed:\n{res.stderr}")
    lib = ctypes.CDLL(str(lib_path))
    u64, i64 = ctypes.c_uint64, ctypes.c_longlong
    lib.lmc_emu_add_region.argtypes = [u64, u64, u64, ctypes.c_int]
    lib.lmc_emu_launch.argtypes = [ctypes.c_int, ct.KVCopyArgs, ctypes.c_uint, ctypes.c_uint,
                                   ctypes.c_int, ctypes.c_ulonglong]
    lib.lmc_emu_launch.restype = i64
    lib.lmc_emu_errors.restype = i64
    lib.lmc_emu_accesses.restype = i64
    lib.lmc_emu_first_error.restype = ctypes.c_char_p
    lib.lmc_emu_divmod.restype = i64
    lib.lmc_emu_divmod.argtypes = [i64, i64, ctypes.POINTER(i64)]
    return lib


Region = tuple[int, int, int, bool]  # (address the kernel uses, bytes, real address, writable)


def merge(regions: list[Region]) -> list[Region]:
    """Sort and merge overlapping/adjacent regions with the same mapping and permission."""
    out: list[Region] = []
    for virt, n, real, w in sorted(regions):
        if out:
            v0, n0, r0, w0 = out[-1]
            if virt <= v0 + n0:
                if w != w0 or real - virt != r0 - v0:
                    raise AssertionError(f"regions at {virt:#x} overlap with different mappings")
                out[-1] = (v0, max(n0, virt + n - v0), r0, w0)
                continue
        out.append((virt, n, real, w))
    return out


def storage_region(t: torch.Tensor, writable: bool) -> Region:
    st = t.untyped_storage()
    return (st.data_ptr(), st.nbytes(), st.data_ptr(), writable)


class HostStreams:
    """CupyBackend's stream calls on the CPU, where the host is the only stream."""

    sm_count = 1

    def stream(self, stream):
        return None

    def context(self, stream):
        return contextlib.nullcontext()

    def event(self, stream):
        return None


class HostBackend(HostStreams):
    """CupyBackend's interface on the CPU. The grid runs thread by thread in ``order``;
    memcpy is memmove; host buffers count as mapped (so "direct" and "staged" both run).

    Before each launch the regions the kernel may touch are registered: the cache tensors
    (writable for a scatter), every chunk buffer located so far and every staging area
    (writable for a gather), plus ``virtual`` regions a test maps by hand. Meta-device caches
    have no memory of their own: only ``virtual`` regions back them.
    """

    def __init__(self, lib: ctypes.CDLL, order: int = 0, seed: int = 0,
                 caches: list[torch.Tensor] | None = None) -> None:
        self.lib, self.order, self.seed = lib, order, seed
        self.caches = [t for t in caches or [] if t.device.type == "cpu"]
        self.buffers: dict[int, torch.Tensor] = {}
        self.staging: list[torch.Tensor] = []
        self.virtual: list[Region] = []
        self.launches: list[tuple[str, int]] = []
        self.accesses = 0
        self.copies = 0

    def wait(self, stream, plan):
        pass

    def upload(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(arr.copy())

    def alloc(self, nbytes: int) -> torch.Tensor:
        t = torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # garbage, never read as is
        self.staging.append(t)
        return t

    def locate(self, buf: torch.Tensor) -> tuple[str, int]:
        if buf.device.type != "cpu":
            raise ValueError(f"is on {buf.device}")
        self.buffers[buf.data_ptr()] = buf
        return "mapped", buf.data_ptr()

    def launch(self, name: str, blocks: int, args: ct.KVCopyArgs, stream) -> None:
        to_cache = "scatter" in name
        regions = [storage_region(t, to_cache) for t in self.caches]
        regions += [(b.data_ptr(), b.numel() * b.element_size(), b.data_ptr(), not to_cache)
                    for b in self.buffers.values()]
        regions += [storage_region(t, not to_cache) for t in self.staging]
        self.lib.lmc_emu_clear_regions()
        for virt, n, real, w in merge(regions + self.virtual):
            self.lib.lmc_emu_add_region(virt, n, real, int(w))
        self.lib.lmc_emu_reset_errors()
        self.launches.append((name, blocks))
        errors = self.lib.lmc_emu_launch(ct.KERNEL_NAMES.index(name), args, blocks, ct.THREADS,
                                         self.order, self.seed)
        self.accesses += self.lib.lmc_emu_accesses()
        if errors:
            raise AssertionError(f"{name}: {errors} bad accesses; first: "
                                 f"{self.lib.lmc_emu_first_error().decode()}")

    def memcpy(self, dst, src, nbytes, stream):
        self._one_allocation(dst, nbytes)
        self._one_allocation(src, nbytes)
        self.copies += 1
        ctypes.memmove(dst, src, nbytes)

    def memcpy2d(self, dst, dpitch, src, spitch, width, height, stream):
        """cudaMemcpy2DAsync's contract: rows of ``width`` bytes at each pitch, the pitches
        at least the width (the driver refuses less), each side inside one allocation."""
        if not (width <= dpitch and width <= spitch and height >= 1):
            raise AssertionError(f"2D copy with width {width} over pitches {dpitch}/{spitch}")
        self._one_allocation(dst, (height - 1) * dpitch + width)
        self._one_allocation(src, (height - 1) * spitch + width)
        self.copies += 1
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    def _one_allocation(self, addr: int, n: int) -> None:
        """The driver refuses a copy whose extent leaves the allocation (or the host
        registration) it starts in (H100: cudaErrorInvalidValue)."""
        from lmc.memory import pinned_ranges

        win = pinned_ranges.window(addr)
        if win is None:
            tensors = [*self.caches, *self.staging, *self.buffers.values()]
            for t in tensors:
                st = t.untyped_storage()
                if st.data_ptr() <= addr < st.data_ptr() + st.nbytes():
                    win = (st.data_ptr(), st.data_ptr() + st.nbytes())
                    break
        if win is not None and addr + n > win[1]:
            raise AssertionError(f"a copy of {n} B at {addr:#x} runs past the allocation "
                                 f"[{win[0]:#x}, {win[1]:#x}) it starts in")
