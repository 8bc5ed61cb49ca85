"""CUDA gather/scatter: one kernel launch moves every requested layer of every chunk of a call.

Same interface and bit-exact results as :class:`lmc.transfer.TorchTransfer`; the kernels in
``lmc/csrc/kv_transfer.cu`` are compiled at run time by CuPy (NVRTC), once per process and
device (CuPy also caches the binary on disk).

How a call runs (all on one CUDA stream, the caller's or the current one):

1. ``plan(slots, ranges)`` uploads, once, a ``[2, tokens]`` table: each token's slot and its
   (chunk, row) destination. It never waits for the device: host slots (what the connectors
   pass) are checked on the host and uploaded asynchronously; device slots are planned on the
   device, and a slot past the cache is skipped there and raised by the handle's host wait.
2. ``gather``/``scatter`` upload a small int64 table (per-plane strides, per-(layer, plane)
   cache addresses, per-(chunk, layer, plane) buffer addresses) and launch one kernel.
3. Host chunk buffers are reached one of two ways, chosen per direction (``gather_mode``,
   ``scatter_mode``, or ``LMC_CUDA_GATHER_MODE`` / ``LMC_CUDA_SCATTER_MODE``):

   * ``"direct"``: the kernel reads/writes the pinned buffer itself through its mapped device
     address (zero-copy over PCIe). No staging memory, no extra pass over HBM.
   * ``"staged"``: the kernel works on a device staging buffer (from torch's caching allocator,
     stream-ordered) and one ``cudaMemcpyAsync`` per contiguous run of bytes moves it to or
     from the host; adjacent chunks of a pinned pool coalesce into one copy.

   Expected winners, to be confirmed with ``benchmarks/bench_gpu_transfer.py``: **gather =
   direct** (GPU writes to host are posted; 16-byte stores from a warp form full 128-byte PCIe
   writes, so the kernel runs at link rate and skips the HBM round trip); **scatter = staged**
   (GPU reads from host are non-posted round trips that need many requests in flight; the copy
   engine sustains link rate, and the on-device scatter afterwards costs ~2-3% at HBM speed).
   Pageable host buffers always take the staged path; device buffers always the direct one.

Waiting: ``gather``/``scatter`` return an :class:`~lmc.completion.EventCompletion` on an event
recorded after the call's work, and start only after their ``after`` handle, so layer-wise
callers do ``h = tr.scatter(plan, bufs, layers=[i], stream=side, after=tr.record_event())``
and later ``h.wait(compute_stream)`` (or ``h.wait()`` on the host); ``synchronize()`` waits for
everything issued through this object. The caller keeps ``bufs`` alive until ``h.done()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import operator
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmc.completion import Completion, EventCompletion
from lmc.kv_layouts import PlaneStrides
from lmc.kv_spec import KVCaches, KVSpec
from lmc.transfer import ChunkPlan, KVTransfer, TransferPlan

KERNEL_SOURCE = Path(__file__).with_name("csrc") / "kv_transfer.cu"
VECTOR_WIDTHS = (16, 8, 4, 2, 1)
KERNEL_NAMES: tuple[str, ...] = tuple(
    f"lmc_kv_{d}_v{w}" for d in ("gather", "scatter") for w in VECTOR_WIDTHS)
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17",)
THREADS = 256  # = LMC_THREADS in the .cu (__launch_bounds__)
GEOM = 6       # = LMC_GEOM: int64 values per plane at the head of the call table
BLOCKS_PER_SM = 4  # default grid cap; enough bytes in flight, leaves SMs for the model

MODES = ("direct", "staged")
DEFAULT_GATHER_MODE = "direct"   # flip here (or via env / constructor) after measuring
DEFAULT_SCATTER_MODE = "staged"


class KVCopyArgs(ctypes.Structure):
    """Mirror of ``struct KVCopyArgs`` in kv_transfer.cu: the kernel's one by-value argument."""

    _fields_ = [
        ("tokens", ctypes.c_uint64),
        ("table", ctypes.c_uint64),
        ("n_tokens", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("n_layers", ctypes.c_int32),
        ("n_planes", ctypes.c_int32),
        ("head_size", ctypes.c_int32),
        ("row_bytes", ctypes.c_int32),
        ("lanes", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


def cuda_kernels_available() -> bool:
    """CuPy imports and a CUDA device is present. Never raises."""
    try:
        import cupy

        return bool(torch.cuda.is_available()) and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# ---------------------------------------------------------------------- CUDA runtime access
@functools.cache
def _kernel_module() -> Any:
    import cupy

    return cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=NVRTC_OPTIONS)


@functools.cache
def _kernel_function(device_index: int, name: str) -> Any:
    """The compiled kernel for one device (compiled on first use, then cached)."""
    import cupy

    with cupy.cuda.Device(device_index):
        return _kernel_module().get_function(name).kernel


class CupyBackend:
    """Every CUDA runtime call of the transfer path, in one place.

    Tests swap in a host emulation with the same methods to run the real kernel code and the
    real packing logic on a CPU.
    """

    def __init__(self, device: torch.device) -> None:
        import cupy

        self._rt = cupy.cuda.runtime
        self._driver = cupy.cuda.driver
        self._cupy = cupy
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.sm_count = torch.cuda.get_device_properties(self.index).multi_processor_count

    def stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        if stream is None:
            return torch.cuda.current_stream(self.index)
        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
        if stream.device.index != self.index:
            raise ValueError(f"stream is on {stream.device}, the KV cache is on {self.device}")
        return stream

    @contextlib.contextmanager
    def context(self, stream: torch.cuda.Stream):
        """Device current for torch and CuPy, ``stream`` current for torch allocations."""
        with torch.cuda.device(self.index), self._cupy.cuda.Device(self.index), \
                torch.cuda.stream(stream):
            yield

    def event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream: torch.cuda.Stream, plan: CudaPlan) -> None:
        """Order ``stream`` after the plan's upload, and keep its memory alive for ``stream``."""
        if plan.stream is not None and plan.stream.cuda_stream != stream.cuda_stream:
            stream.wait_event(plan.ready)
            plan.tokens.record_stream(stream)

    def upload(self, arr: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor, asynchronously on the current stream (pinned source;
        torch's host allocator keeps it alive until the copy has run)."""
        return torch.from_numpy(arr).pin_memory().to(self.device, non_blocking=True)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def locate(self, buf: torch.Tensor) -> tuple[str, int]:
        """("device", ptr) | ("mapped", device address of pinned host memory) | ("host", 0)."""
        if buf.device.type == "cuda":
            if buf.device.index != self.index:
                raise ValueError(f"is on {buf.device}, the KV cache is on {self.device}")
            return "device", buf.data_ptr()
        if buf.device.type != "cpu":
            raise ValueError(f"is on {buf.device}: chunk buffers live on the host or on "
                             f"{self.device}")
        start = buf.data_ptr()
        dev = self._mapped(start)
        if not dev:
            return "host", 0
        # A pinned pool is registered in steps (lmc.prefault.Pinner): a buffer across two
        # registrations is reached directly only where its last byte maps right after its
        # first (one device range); else it is staged (cudaMemcpy takes any host range).
        last = start + buf.numel() * buf.element_size() - 1
        if last != start and self._mapped(last) != dev + (last - start):
            return "host", 0
        return "mapped", dev

    def _mapped(self, addr: int) -> int:
        """The device address of page-locked, mapped host memory at ``addr``; 0 if none."""
        try:
            attrs = self._rt.pointerGetAttributes(addr)
        except self._rt.CUDARuntimeError:
            return 0
        if attrs.type == self._rt.memoryTypeHost and attrs.devicePointer:
            return int(attrs.devicePointer)
        return 0

    def launch(self, name: str, blocks: int, args: KVCopyArgs, stream: torch.cuda.Stream) -> None:
        func = _kernel_function(self.index, name)
        params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        self._driver.launchKernel(func.ptr, blocks, 1, 1, THREADS, 1, 1, 0, stream.cuda_stream,
                                  ctypes.addressof(params), 0)

    def memcpy(self, dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
        self._rt.memcpyAsync(dst, src, nbytes, self._rt.memcpyDefault, stream.cuda_stream)


# ------------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class CudaPlan(TransferPlan):
    """``chunks`` keeps the generic view (start/end per chunk); the rest feeds the kernel."""

    counts: list[int] = dataclasses.field(default_factory=list)
    holes: list[bool] = dataclasses.field(default_factory=list)  # chunk has slots < 0
    tokens: torch.Tensor | None = None  # [2, n_tokens] int64: slot, (chunk << 32) | row
    n_tokens: int = 0
    stream: Any = None                  # stream the upload ran on
    ready: Any = None                   # event after the upload
    bad_slots: Any = None               # device slots: device flag, a slot past the cache
    places: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)


def _or_reduce(values: np.ndarray) -> int:
    return int(np.bitwise_or.reduce(values.ravel())) if values.size else 0


def vector_bytes(alignment_bits: int) -> int:
    """Widest vector (16, 8, 4, 2, 1 bytes) that divides every value OR-ed into the argument."""
    x = alignment_bits | 16
    return x & -x


def lanes_for(row_bytes: int, vec: int) -> int:
    """Threads per row: the smallest power of two >= vectors per row, at most a warp."""
    vecs = max(1, row_bytes // vec)
    return min(32, 1 << (vecs - 1).bit_length())


def layer_runs(lids: Sequence[int]) -> list[tuple[int, int]]:
    """``(first index, length)`` of each run of consecutive layer ids, in call order."""
    runs: list[tuple[int, int]] = []
    for i, lid in enumerate(lids):
        if runs and lids[i - 1] + 1 == lid:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def coalesce(copies: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge ``(dst, src, nbytes)`` copies that continue each other on both sides."""
    out: list[tuple[int, int, int]] = []
    for dst, src, n in copies:
        if out and out[-1][0] + out[-1][2] == dst and out[-1][1] + out[-1][2] == src:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        elif n:
            out.append((dst, src, n))
    return out


def _mode(direction: str, given: str | None, default: str) -> str:
    mode = given or os.environ.get(f"LMC_CUDA_{direction.upper()}_MODE") or default
    if mode not in MODES:
        raise ValueError(f"{direction}_mode must be one of {MODES}, got {mode!r}")
    return mode


def num_slots(spec: KVSpec, layer0: torch.Tensor) -> int:
    """Token slots the engine cache holds (same rule as the torch path)."""
    return spec.num_slots(layer0)


def kernel_geometry(spec: KVSpec, strides: Sequence[PlaneStrides]) -> np.ndarray:
    """``[planes, GEOM]``: byte strides and segment size of each plane (see the .cu).

    A segment is what is contiguous both in the cache and in a chunk row: the whole row
    (separate K/V planes, MLA, SGLang), one head (vLLM GPU's K/V interleaved per head, vLLM
    CPU's V) or one element (vLLM CPU's transposed K).
    """
    e, rows = spec.element_size, []
    for ps in strides:
        if ps.dim == 1 and (spec.num_kv_heads == 1 or ps.head == spec.head_size):
            seg = spec.row_width
        elif ps.dim == 1:
            seg = spec.head_size
        else:
            seg = 1
        rows.append([ps.block * e, ps.token * e, ps.head * e, ps.dim * e, seg, seg * e])
    return np.array(rows, dtype=np.int64)


# --------------------------------------------------------------------------- the transfer
class CudaTransfer(KVTransfer):
    """Gather/scatter with the ``kv_transfer.cu`` kernels; see the module docstring.

    ``gather_mode`` / ``scatter_mode``: how pinned host buffers are reached, "direct" or
    "staged" (default: ``LMC_CUDA_GATHER_MODE`` / ``LMC_CUDA_SCATTER_MODE``, else the module
    defaults). ``max_blocks``: grid cap, default 4 per SM; lower it to leave SMs to the model
    while layer-wise copies overlap compute. ``backend``: the CUDA runtime shim (the tests pass
    a host emulation).
    """

    def __init__(self, spec: KVSpec, kv_caches: KVCaches, *, gather_mode: str | None = None,
                 scatter_mode: str | None = None, max_blocks: int | None = None,
                 backend: Any = None) -> None:
        super().__init__(spec, kv_caches)
        if backend is None:
            if self.device.type != "cuda":
                raise ValueError(f"CudaTransfer needs the KV cache on a CUDA device, it is on "
                                 f"{self.device}; use TorchTransfer")
            backend = CupyBackend(self.device)
        self.backend = backend
        self.gather_mode = _mode("gather", gather_mode, DEFAULT_GATHER_MODE)
        self.scatter_mode = _mode("scatter", scatter_mode, DEFAULT_SCATTER_MODE)
        self.max_blocks = max_blocks or BLOCKS_PER_SM * backend.sm_count
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        self.esize = spec.element_size
        self.row_bytes = spec.row_width * self.esize
        self.num_planes = spec.num_planes
        self.num_slots = num_slots(spec, self.layers[0][0])
        self.strides = spec.plane_strides(self.layers[0])  # the tensors' real strides
        self.geom = kernel_geometry(spec, self.strides)
        self.cache_ptrs = self._cache_pointers()
        self._static_align = self._static_alignment()
        self._pending: dict[int, Any] = {}  # stream handle -> event after its last call
        self._lock = threading.Lock()       # connectors call from an I/O thread too

    # --------------------------------------------------------------- fixed per cache
    def _cache_pointers(self) -> np.ndarray:
        """``[layers, planes]`` address of element 0 of each plane of each layer."""
        bases = [ps.base * self.esize for ps in self.strides]
        ptrs = [[tensors[p if len(tensors) > 1 else 0].data_ptr() + bases[p]
                 for p in range(self.num_planes)] for tensors in self.layers]
        return np.array(ptrs, dtype=np.int64)

    def _static_alignment(self) -> int:
        bits = _or_reduce(self.cache_ptrs) | self.row_bytes
        for blk, off, head_b, dim_b, seg, seg_b in self.geom.tolist():
            bits |= blk | off | seg_b
            if seg_b != self.row_bytes:
                bits |= head_b
            if seg == 1:
                bits |= dim_b
        return bits

    # ------------------------------------------------------------------------ plan
    def plan(self, slots: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> CudaPlan:
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"slots must be a torch.Tensor, got {type(slots).__name__}")
        if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be a 1-D int32/int64 tensor, got shape "
                             f"{tuple(slots.shape)} {slots.dtype}")
        host = self._is_host(slots)
        if not host and slots.device != self.device:
            raise ValueError(f"slots are on {slots.device}, the KV cache is on {self.device}")
        slots = slots.to(torch.int64)
        n_all = slots.numel()
        ranges = [(operator.index(s), operator.index(e)) for s, e in ranges]
        for s, e in ranges:
            if not 0 <= s <= e <= n_all:
                raise ValueError(f"range ({s}, {e}) is outside the {n_all} planned slots")
        # Host slots (what connectors pass) are checked here; device slots are never read
        # back (that would sync the engine's stream): every chunk may have holes, and a slot
        # past the cache is skipped on the device and reported when the copy is waited for.
        holes = [not host] * len(ranges)
        host_slots = slots.numpy() if host else None
        if n_all and host_slots is not None:
            lo, hi = int(host_slots.min()), int(host_slots.max())
            if hi >= self.num_slots:
                raise ValueError(f"slot_mapping holds slot {hi}, but the KV cache has only "
                                 f"{self.num_slots} slots")
            if lo < 0:
                neg = host_slots < 0
                holes = [bool(neg[s:e].any()) for s, e in ranges]
        if n_all == 0 or not ranges:  # as the torch path: nothing to plan, no chunks
            return CudaPlan([])
        counts = [e - s for s, e in ranges]
        chunks = [ChunkPlan(s, e, "kernel", slots[s:e], None, None) for s, e in ranges]
        n_tokens = sum(counts)
        if n_tokens == 0:
            return CudaPlan(chunks, counts, holes)
        idx = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in ranges])
        chunk_of = np.repeat(np.arange(len(ranges), dtype=np.int64), counts)
        row = idx - np.repeat(np.array([s for s, _ in ranges], dtype=np.int64), counts)
        stream = self.backend.stream(None)
        bad = None
        with self.backend.context(stream):
            if host_slots is not None:  # one asynchronous upload, nothing read back
                tokens = self.backend.upload(np.stack([host_slots[idx], (chunk_of << 32) | row]))
            else:
                up = self.backend.upload(np.stack([idx, (chunk_of << 32) | row]))
                col = slots.index_select(0, up[0])
                over = col >= self.num_slots
                tokens = torch.stack([torch.where(over, -1, col), up[1]])
                bad = over.any()
            ready = self.backend.event(stream)
        return CudaPlan(chunks, counts, holes, tokens, n_tokens, stream, ready, bad_slots=bad)

    def _is_host(self, slots: torch.Tensor) -> bool:
        """Whether ``slots`` can be read on the host without a device sync (the backend may
        say: an emulation keeps 'device' tensors in host memory)."""
        is_host = getattr(self.backend, "is_host", None)
        return is_host(slots) if is_host is not None else slots.device.type == "cpu"

    # --------------------------------------------------------------------- execute
    def gather(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
               layers: Iterable[int] | None = None, *, after: Completion | None = None,
               stream: torch.cuda.Stream | None = None, arrays: Any = None) -> Completion:
        """Cache -> ``bufs`` on ``stream`` once ``after`` is reached; a handle on an event
        recorded after the work."""
        return self._run(plan, bufs, layers, stream, after, to_cache=False)

    def scatter(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
                layers: Iterable[int] | None = None, arrays: Any = None, *,
                after: Completion | None = None,
                stream: torch.cuda.Stream | None = None) -> Completion:
        """``bufs`` -> cache, as :meth:`gather`. ``arrays`` (numpy views for the CPU path) is
        ignored."""
        return self._run(plan, bufs, layers, stream, after, to_cache=True)

    def record_event(self, stream: torch.cuda.Stream | None = None) -> Completion:
        """A point on ``stream`` (default: the current one) after everything issued to it."""
        stream = self.backend.stream(stream)
        with self.backend.context(stream):
            return EventCompletion(self.backend.event(stream))

    def synchronize(self) -> None:
        """Wait for the last call issued on every stream this object has used."""
        with self._lock:
            events, self._pending = list(self._pending.values()), {}
        for ev in events:
            if ev is not None:
                ev.synchronize()

    def _layer_ids(self, layers: Iterable[int] | None) -> list[int]:
        n = self.spec.num_layers
        if layers is None:
            return list(range(n))
        lids = [operator.index(x) for x in layers]
        for lid in lids:
            if not 0 <= lid < n:
                raise ValueError(f"layer {lid} is out of range for {n} layers")
        return lids

    def _place(self, plan: CudaPlan, i: int, buf: Any) -> tuple[str, int]:
        """Check chunk buffer ``i``; return where it lives and its device-usable address."""
        n = plan.counts[i]
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"chunk buffer {i} is {type(buf).__name__}, not a torch.Tensor")
        if buf.dtype != self.spec.dtype:
            raise TypeError(f"chunk buffer {i} has dtype {buf.dtype}, the KV cache holds "
                            f"{self.spec.dtype}")
        want = self.spec.chunk_shape(n)
        if tuple(buf.shape) != want:
            raise ValueError(f"chunk buffer {i} has shape {tuple(buf.shape)}, expected {want} "
                             f"for its {n} tokens")
        if not buf.is_contiguous():
            raise ValueError(f"chunk buffer {i} must be contiguous (strides {buf.stride()})")
        if n == 0:
            return "device", 0
        key = buf.data_ptr()
        if key not in plan.places:
            try:
                plan.places[key] = self.backend.locate(buf)
            except ValueError as err:
                raise ValueError(f"chunk buffer {i} {err}") from None
        return plan.places[key]

    def _run(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
             layers: Iterable[int] | None, stream: Any, after: Completion | None,
             to_cache: bool) -> Completion:
        if not isinstance(plan, CudaPlan):
            raise TypeError("plan must come from this CudaTransfer's plan(), got "
                            f"{type(plan).__name__}")
        bufs = list(bufs)
        if len(bufs) != len(plan.counts):
            raise ValueError(f"{len(bufs)} chunk buffers for {len(plan.counts)} planned chunks")
        lids = self._layer_ids(layers)
        stream = self.backend.stream(stream)
        mode = self.scatter_mode if to_cache else self.gather_mode
        with self.backend.context(stream):
            places = [self._place(plan, i, b) for i, b in enumerate(bufs)]
            if after is not None:
                after.wait(stream)
            if plan.n_tokens and lids:
                self.backend.wait(stream, plan)
                staged = [kind == "host" or (kind == "mapped" and mode == "staged")
                          for kind, _ in places]
                self._launch(plan, bufs, lids, places, staged, stream, to_cache)
            ev = self.backend.event(stream)
        with self._lock:
            self._pending[getattr(stream, "cuda_stream", 0)] = ev
        return EventCompletion(ev, plan.bad_slots)

    def _launch(self, plan: CudaPlan, bufs: list[torch.Tensor], lids: list[int],
                places: list[tuple[str, int]], staged_list: list[bool], stream: Any,
                to_cache: bool) -> None:
        P, rb, n_layers = self.num_planes, self.row_bytes, len(lids)
        counts = np.array(plan.counts, dtype=np.int64)
        staged = np.array(staged_list, dtype=bool)
        base = np.array([ptr for _, ptr in places], dtype=np.int64)
        layer_bytes = P * counts * rb               # one layer of one chunk
        stage_bytes = np.where(staged, n_layers * layer_bytes, 0)
        stage_off = np.cumsum(stage_bytes) - stage_bytes
        staging = None
        if staged.any():
            staging = self.backend.alloc(int(stage_bytes.sum()))
            base = np.where(staged, staging.data_ptr() + stage_off, base)
        # Direct buffers hold every layer; a staging region holds just the call's layers.
        lyr = np.where(staged[:, None], np.arange(n_layers)[None, :], np.array(lids)[None, :])
        dst = base[:, None, None] + (lyr[:, :, None] * P + np.arange(P)) * counts[:, None, None] * rb
        table = np.concatenate([self.geom.ravel(), self.cache_ptrs[lids].ravel(), dst.ravel()])
        vec = vector_bytes(self._static_align | _or_reduce(dst))
        lanes = lanes_for(rb, vec)
        # (host, staging, nbytes) per staged chunk and run of consecutive layers
        spans = []
        if staging is not None:
            for c in np.flatnonzero(staged & (counts > 0)).tolist():
                host, stage, per = bufs[c].data_ptr(), int(base[c]), int(layer_bytes[c])
                spans += [(c, host + lids[first] * per, stage + first * per, length * per)
                          for first, length in layer_runs(lids)]
        to_stage = coalesce([(s, h, n) for c, h, s, n in spans
                             if to_cache or plan.holes[c]])
        from_stage = [] if to_cache else coalesce([(h, s, n) for _, h, s, n in spans])

        dev_table = self.backend.upload(table)
        args = KVCopyArgs(tokens=plan.tokens.data_ptr(), table=dev_table.data_ptr(),
                          n_tokens=plan.n_tokens, block_size=self.spec.block_size,
                          n_layers=n_layers, n_planes=P, head_size=self.spec.head_size,
                          row_bytes=rb, lanes=lanes, reserved=0)
        rows = plan.n_tokens * n_layers * P
        blocks = max(1, min(-(-rows * lanes // THREADS), self.max_blocks))
        name = f"lmc_kv_{'scatter' if to_cache else 'gather'}_v{vec}"
        # Scatter fills the staging area first. Gather copies it back whole, so a chunk with
        # skipped rows (slot < 0) is first loaded too: those rows must come back unchanged.
        for d, s, n in to_stage:
            self.backend.memcpy(d, s, n, stream)
        self.backend.launch(name, blocks, args, stream)
        for d, s, n in from_stage:
            self.backend.memcpy(d, s, n, stream)
        # staging / dev_table were allocated on `stream`: freeing them here is stream-ordered.
