"""CUDA gather/scatter: one kernel launch moves every requested layer of every chunk of a call.

Same interface and bit-exact results as :class:`lmc.transfer.torch_copy.TorchTransfer`; the kernels in
``lmc/transfer/csrc/kv_transfer.cu`` are compiled at run time by CuPy (NVRTC), once per process and
device (CuPy also caches the binary on disk).

How a call runs (all on one CUDA stream, the caller's or the current one):

1. ``plan(slots, ranges)`` uploads, once, a ``[2, tokens]`` table: each token's slot and its
   (chunk, row) destination. It never waits for the device: host slots (what the connectors
   pass) are checked on the host and uploaded asynchronously; device slots are planned on the
   device, and a slot past the cache is skipped there and raised by the handle's host wait.
2. ``gather``/``scatter`` upload a small int64 table (per-plane strides, per-(layer, plane)
   cache addresses, per-(chunk, layer, plane) buffer addresses) and launch one kernel.
3. Host chunk buffers are reached one of two ways, chosen per direction and call shape
   (one layer per call, as layer-wise saves and loads go, or several layers at once): by a
   short calibration per device (:func:`device_paths`; first use, cached per device name in
   ``~/.cache/lmc/copy_paths.json``), unless ``gather_mode`` / ``scatter_mode`` or
   ``LMC_CUDA_GATHER_MODE`` / ``LMC_CUDA_SCATTER_MODE`` force one:

   * ``"direct"``: the kernel reads/writes the pinned buffer itself through its mapped device
     address (zero-copy over PCIe). No staging memory, no extra pass over HBM.
   * ``"staged"``: the kernel works on a device staging buffer (from torch's caching allocator,
     stream-ordered) and one ``cudaMemcpyAsync`` per contiguous run of bytes moves it to or
     from the host; adjacent chunks of a pinned pool coalesce into one copy, and one layer of
     evenly spaced chunks (a per-layer call) is one ``cudaMemcpy2DAsync``.

   Winners measured on an H200 (the defaults where no calibration ran): **gather =
   direct** (GPU writes to host are posted; 16-byte stores from a warp form full 128-byte PCIe
   writes, so the kernel runs at link rate and skips the HBM round trip); **scatter = staged**
   (GPU reads from host are non-posted round trips that need many requests in flight; the copy
   engine sustains link rate, and the on-device scatter afterwards costs ~2-3% at HBM speed)
   for all-layer calls, but **direct** for one layer per call (0.90 of memcpy against 0.82:
   a small call pays the staging copy's fixed costs). Other GPUs differ, hence the
   calibration, which also measures how much each path slows a concurrent matmul-heavy
   forward (the kernel paths take SMs, copy engines do not) and prefers the gentler path
   when the two are within 5% in speed (:func:`choose_paths`). The choice and the calls per
   path show in ``CacheEngine.stats()`` (``copy_path.*``, ``copy_calls.*``).
   Pageable host buffers always take the staged path; device buffers always the direct one.
   Grids: a call takes at most 4 thread blocks per SM, but a per-layer gather (a save, which
   runs beside the forward that computed its KV) 1/16 of the SMs (at least 8): PCIe, not the
   SMs, bounds it, and every SM it holds is one the forward waits for.

Waiting: ``gather``/``scatter`` return an :class:`~lmc.transfer.completion.EventCompletion` on an event
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
import hashlib
import json
import logging
import math
import operator
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmc.memory import pinned_ranges
from lmc.strict_json import load_json_file
from lmc.transfer.completion import Completion, EventCompletion
from lmc.transfer.kv_layouts import PlaneStrides
from lmc.transfer.kv_spec import KVCaches, KVSpec
from lmc.transfer.plan import ChunkPlan, KVTransfer, TransferPlan
from lmc.user_cache import cache_dir

KERNEL_SOURCE = Path(__file__).with_name("csrc") / "kv_transfer.cu"
VECTOR_WIDTHS = (16, 8, 4, 2, 1)
KERNEL_NAMES: tuple[str, ...] = tuple(
    f"lmc_kv_{d}_v{w}" for d in ("gather", "scatter") for w in VECTOR_WIDTHS)
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17",)
THREADS = 256  # = LMC_THREADS in the .cu (__launch_bounds__)
GEOM = 6       # = LMC_GEOM: int64 values per plane at the head of the call table
BLOCKS_PER_SM = 4  # default grid cap; enough bytes in flight, leaves SMs for the model
# a per-layer gather's grid cap: 1/16 of the SMs, at least 8 blocks. Measured on an H200
# (132 SMs; the calibration's shape, 2,048 tokens of 8 KV heads of 128: 8 MiB a layer): 8
# blocks gather as fast as 528 (0.167 vs 0.176 ms a call: PCIe, not the SMs, is the limit)
# and slow a concurrent forward by +30% instead of +85% (benchmarks/print_copy_paths.py
# --grids)
LAYER_GATHER_MIN_BLOCKS, LAYER_GATHER_SM_SHARE = 8, 16

log = logging.getLogger(__name__)

MODES = ("direct", "staged")
DIRECTIONS = ("gather", "scatter")
SHAPES = ("per_layer", "all_layers")  # one layer of several per call, or more at once
DEFAULT_GATHER_MODE = "direct"   # all-layer calls where no calibration ran (H200 figures)
DEFAULT_SCATTER_MODE = "staged"
DEFAULT_PATHS: dict[tuple[str, str], str] = {
    ("gather", "per_layer"): "direct", ("gather", "all_layers"): DEFAULT_GATHER_MODE,
    ("scatter", "per_layer"): "direct", ("scatter", "all_layers"): DEFAULT_SCATTER_MODE,
}
CLOSE = 0.05  # paths within 5% in speed: the one that slows a concurrent forward less wins


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
            assert plan.tokens is not None  # uploaded with the stream it ran on
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
        # A pinned pool is registered in steps (lmc.memory.prefault.Pinner): a buffer across two
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

    def memcpy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                 stream: torch.cuda.Stream) -> None:
        self._rt.memcpy2DAsync(dst, dpitch, src, spitch, width, height,
                               self._rt.memcpyDefault, stream.cuda_stream)


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
    windows: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # per-layer calls of one plan (a layer-wise save or load) repeat the same buffers:
    # the last call's checked buffers and their places, and the call tables of every layer
    # uploaded once per (direction, stream, buffers) (CudaTransfer._layer_tables)
    checked: tuple[list[Any], list[tuple[str, int]]] | None = None
    layer_tables: dict[tuple[Any, ...], tuple[Any, np.ndarray]] = dataclasses.field(
        default_factory=dict)


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


Copy = tuple[int, int, int, Any]  # (dst, src, nbytes, host window): see cut_at_windows


def coalesce(copies: Sequence[Copy]) -> list[Copy]:
    """Merge ``(dst, src, nbytes, window)`` copies that continue each other on both sides
    inside one host window (one allocation or registration: the driver's unit)."""
    out: list[Copy] = []
    for dst, src, n, win in copies:
        if (out and out[-1][3] == win and out[-1][0] + out[-1][2] == dst
                and out[-1][1] + out[-1][2] == src):
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n, win)
        elif n:
            out.append((dst, src, n, win))
    return out


def host_window(buf: torch.Tensor) -> Callable[[int], tuple[int, int]]:
    """For addresses inside host buffer ``buf``: the registration lmc made around them
    (:mod:`lmc.memory.pinned_ranges`, a pool page-locked in steps), else ``buf``'s own
    storage (one allocation: torch's pinned allocator, a pageable tensor)."""
    storage = buf.untyped_storage()
    own = (storage.data_ptr(), storage.data_ptr() + storage.nbytes())

    def window_of(addr: int) -> tuple[int, int]:
        return pinned_ranges.window(addr) or own

    return window_of


def cut_at_windows(spans: Sequence[tuple[int, int, int]],
                   window_of: Callable[[int], tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """``(host, other, nbytes)`` spans cut where the host allocation or registration holding
    them ends (``window_of(addr)`` gives its ``(start, end)``); each piece carries its
    window's start. Why: the driver takes each registration as an allocation of its own,
    and refuses a copy that runs from one into the next (a pool page-locked in steps)."""
    out = []
    for host, other, n in spans:
        while n > 0:
            lo, hi = window_of(host)
            take = min(n, hi - host) if hi > host else n
            out.append((host, other, take, lo))
            host, other, n = host + take, other + take, n - take
    return out


MAX_PITCH = (1 << 31) - 1  # cudaMemcpy2D refuses larger pitches (cudaDevAttrMaxPitch)


def strided(copies: Sequence[Copy]) -> list[tuple[int, int, int, int, int, int]]:
    """Consecutive ``(dst, src, nbytes, window)`` copies of one size and host window whose
    addresses advance by one step each side (a layer of evenly spaced chunks) as one 2D copy
    ``(dst, dpitch, src, spitch, width, height)``; the rest as ``height == 1``. Why: one
    copy-engine job per layer instead of one per chunk -- a per-layer staged call of small
    pieces paid each copy's fixed cost (0.82 of memcpy against 0.94 for one large copy,
    H200). A 2D copy never spans two host windows: the driver refuses it (H100)."""
    out: list[tuple[int, int, int, int, int, int]] = []
    i, n_all = 0, len(copies)
    while i < n_all:
        d, s, n, win = copies[i]
        j = i + 1
        if j < n_all and copies[j][2] == n and copies[j][3] == win:
            dp, sp = copies[j][0] - d, copies[j][1] - s
            if n <= dp <= MAX_PITCH and n <= sp <= MAX_PITCH:
                while (j < n_all and copies[j][2] == n and copies[j][3] == win
                       and copies[j][0] - copies[j - 1][0] == dp
                       and copies[j][1] - copies[j - 1][1] == sp):
                    j += 1
        if j - i > 1:
            out.append((d, dp, s, sp, n, j - i))
        else:
            out.append((d, n, s, n, n, 1))
            j = i + 1
        i = j
    return out


def _mode(direction: str, given: str | None, default: str | None) -> str | None:
    """The mode forced by the constructor or the environment (``None``: not forced)."""
    mode = given or os.environ.get(f"LMC_CUDA_{direction.upper()}_MODE") or default
    if mode is not None and mode not in MODES:
        raise ValueError(f"{direction}_mode must be one of {MODES}, got {mode!r}")
    return mode


def resolve_paths(paths: Mapping[tuple[str, str], str], forced: Mapping[str, str | None]
                  ) -> dict[tuple[str, str], str]:
    """Per (direction, shape): the forced mode of that direction, else ``paths``' choice,
    else the default; every value checked."""
    out = {}
    for key, default in DEFAULT_PATHS.items():
        mode = forced.get(key[0]) or paths.get(key, default)
        if mode not in MODES:
            raise ValueError(f"copy path for {key[0]} {key[1]} must be one of {MODES}, "
                             f"got {mode!r}")
        out[key] = mode
    return out


def call_shape(n_call_layers: int, n_layers: int) -> str:
    """``per_layer``: one layer of several per call (layer-wise pipelines); else
    ``all_layers`` (a whole-model save or load, or several layers at once)."""
    return "per_layer" if n_call_layers == 1 and n_layers > 1 else "all_layers"


# ------------------------------------------------------------------------ path calibration
@dataclasses.dataclass(frozen=True)
class PathTiming:
    """One path measured: ``seconds`` per call alone, and ``slowdown``, how much longer a
    concurrent matmul-heavy forward took while the path copied (0.1 = 10% slower; None:
    not measured)."""

    seconds: float
    slowdown: float | None = None


def choose_paths(timings: Mapping[tuple[str, str, str], PathTiming]
                 ) -> dict[tuple[str, str], str]:
    """Per (direction, shape), the faster mode; where the other is within ``CLOSE`` of it
    in speed and both slowdowns were measured, the one that slows the forward less.

    Gathers (saves) are weighed by what they cost a step: a save runs beside the forward
    that computed the KV, so where both slowdowns were measured the gather path with the
    least ``seconds * (1 + slowdown)`` wins. Why: on an H100 the direct kernel gathered at
    0.93 of memcpy but slowed a concurrent forward by +150-700%, which made every cold
    prefill slower and the measured prefill speed 3x too low. Loads (scatters) are what a
    hit's forward waits for: speed first. A (direction, shape) measured for neither mode
    keeps its default; a non-positive or non-finite time is not a measurement."""
    out = dict(DEFAULT_PATHS)
    for key in DEFAULT_PATHS:
        got = {m: t for m in MODES
               if (t := timings.get((*key, m))) is not None and 0 < t.seconds < float("inf")}
        if not got:
            continue
        measured = len(got) > 1 and all(
            t.slowdown is not None and math.isfinite(t.slowdown) for t in got.values())
        if key[0] == "gather" and measured:
            out[key] = min(got, key=lambda m: (got[m].seconds * (1 + max(0.0, got[m].slowdown
                                                                       or 0.0)),
                                               got[m].seconds))
            continue
        fastest = min(got, key=lambda m: got[m].seconds)
        near = [m for m in got if got[m].seconds <= got[fastest].seconds * (1 + CLOSE)]
        if len(near) > 1 and all(got[m].slowdown is not None for m in near):
            out[key] = min(near, key=lambda m: (got[m].slowdown, got[m].seconds))
        else:
            out[key] = fastest
    return out


PATHS_FILE_BYTES = 1 << 20  # a device's entry is ~1 KB: a larger file is not lmc's


def paths_cache_file() -> Path:
    """Where calibrations are kept: the user's cache dir (``$XDG_CACHE_HOME`` or
    ``~/.cache``), ``lmc/copy_paths.json``."""
    return cache_dir() / "copy_paths.json"


@functools.cache
def kernel_digest() -> str:
    """Calibrations are valid for these kernels only: a changed .cu recalibrates."""
    return hashlib.sha256(KERNEL_SOURCE.read_bytes()).hexdigest()[:16]


def _key(s: str) -> tuple[str, str]:
    d, _, shape = s.partition("/")
    return d, shape


def load_paths(device_name: str, path: Path | None = None) -> dict[tuple[str, str], str] | None:
    """The cached choice for ``device_name`` (None: none, another kernel, or an unreadable
    or malformed file, which is logged and then overwritten by the next calibration)."""
    path = path or paths_cache_file()
    try:
        data = load_json_file(path, PATHS_FILE_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("copy path cache %s is unreadable (%s): recalibrating", path, e)
        return None
    entry = data.get(device_name) if isinstance(data, dict) else None
    if not isinstance(entry, dict) or entry.get("kernel") != kernel_digest():
        return None
    choice = entry.get("choice")
    if not isinstance(choice, dict):
        return None
    out = {_key(k): v for k, v in choice.items() if isinstance(k, str)}
    if set(out) != set(DEFAULT_PATHS) or any(v not in MODES for v in out.values()):
        log.warning("copy path cache %s: entry for %s is malformed: recalibrating", path,
                    device_name)
        return None
    return out


def save_paths(device_name: str, choice: Mapping[tuple[str, str], str],
               timings: Mapping[tuple[str, str, str], PathTiming], path: Path | None = None
               ) -> None:
    """Record a calibration (atomically: a crash never leaves half a file)."""
    path = path or paths_cache_file()
    try:
        data = load_json_file(path, PATHS_FILE_BYTES)
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[device_name] = {
        "kernel": kernel_digest(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "choice": {f"{d}/{s}": m for (d, s), m in choice.items()},
        "measured": {f"{d}/{s}/{m}": dataclasses.asdict(t) for (d, s, m), t in timings.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".copy_paths.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_CALIBRATED: dict[int, dict[tuple[str, str], str]] = {}
_CALIBRATE_LOCK = threading.Lock()


def device_paths(index: int, *, measure: Callable[[int], Mapping] | None = None,
                 name: str | None = None, force: bool = False,
                 path: Path | None = None) -> dict[tuple[str, str], str]:
    """The copy path per (direction, shape) for CUDA device ``index``: from this process's
    memo, else the cache file, else calibrated now (about a second) and cached. A
    calibration that fails (no memory left on the device, ...) falls back to the defaults,
    logged, and is retried by the next process."""
    with _CALIBRATE_LOCK:
        if not force and index in _CALIBRATED:
            return _CALIBRATED[index]
        name = name or torch.cuda.get_device_name(index)
        got = None if force else load_paths(name, path)
        if got is None:
            try:
                timings = (measure or measure_paths)(index)
                got = choose_paths(timings)
                save_paths(name, got, timings, path)
                log.info("copy paths calibrated on %s: %s", name, describe_paths(got))
            except Exception as e:  # noqa: BLE001 - a calibration is never worth a failure
                log.warning("copy path calibration on %s failed (%s): using the defaults",
                            name, e)
                return dict(DEFAULT_PATHS)
        _CALIBRATED[index] = got
        return got


def describe_paths(paths: Mapping[tuple[str, str], str]) -> str:
    return ", ".join(f"{d} {s.replace('_', ' ')}: {m}" for (d, s), m in sorted(paths.items()))


def time_on_stream(fn: Callable[[], object], iters: int, stream: Any = None) -> float:
    """Seconds per ``fn()``: CUDA events around ``iters`` calls queued on ``stream``."""
    stream = stream or torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def forward_slowdown(copy: Callable[[], object], copy_seconds: float, device: int,
                     forward: Callable[[], object] | None = None, iters: int = 3) -> float:
    """How much longer ``forward`` (default: a chain of bf16 matmuls, a prefill's shape of
    work) runs on the current stream while ``copy`` repeats on a side stream, as a fraction
    (0.1 = 10% slower). Both streams are held by a one-thread spin kernel until every copy is
    queued, so the copies start with the forward whatever the host's issue rate, and enough
    are queued to outlast it."""
    if forward is None:
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) / 64  # stays finite

        def forward() -> None:
            x = a
            for _ in range(16):
                x = torch.mm(x, a)
    forward()
    torch.cuda.synchronize(device)
    alone = min(time_on_stream(forward, 1) for _ in range(iters))
    compute = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    reps = max(1, int(alone / max(copy_seconds, 1e-6)) + 2)
    hold = getattr(torch.cuda, "_sleep", None)
    best = float("inf")
    for _ in range(iters):
        if hold is not None:
            hold(100_000_000)  # ~50 ms of one thread spinning: the host queues meanwhile
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            for _ in range(reps):
                copy()
        best = min(best, time_on_stream(forward, 1))
        torch.cuda.synchronize(device)
    return max(0.0, best / alone - 1)


def measure_paths(index: int, *, tokens: int = 2048, layers: int = 8, heads: int = 8,
                  head_size: int = 128, iters: int = 5, interference: bool = True,
                  gather_blocks: int | None = None
                  ) -> dict[tuple[str, str, str], PathTiming]:
    """Time every (direction, shape, mode) on device ``index`` over a scratch bf16 cache
    (vLLM's flash layout, shuffled whole blocks, 256-token chunks of one pinned buffer);
    with ``interference``, also each path's slowdown of a concurrent forward.
    ``gather_blocks``: the gathers' grid cap (:class:`CudaTransfer`)."""
    dev = torch.device("cuda", index)
    bs, chunk = 16, 256
    nb = 2 * tokens // bs + 8
    spec = KVSpec(num_layers=layers, num_kv_heads=heads, head_size=head_size,
                  dtype=torch.bfloat16, block_size=bs, layout="vllm_flash", num_blocks=nb)
    with torch.cuda.device(index):
        caches = [torch.randn(spec.layer_shape(), device=dev, dtype=spec.dtype)
                  for _ in range(layers)]
        blocks = torch.randperm(nb, device="cpu")[: tokens // bs]
        slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()
        ranges = [(s, s + chunk) for s in range(0, tokens, chunk)]
        host = torch.empty(spec.chunk_nbytes(tokens), dtype=torch.uint8, pin_memory=True)
        per = spec.chunk_nbytes(chunk)
        bufs = [host[i * per: (i + 1) * per].view(spec.dtype).view(spec.chunk_shape(chunk))
                for i in range(len(ranges))]
        out: dict[tuple[str, str, str], PathTiming] = {}
        for mode in MODES:
            tr = CudaTransfer(spec, caches, gather_mode=mode, scatter_mode=mode,
                              gather_blocks=gather_blocks)
            plan = tr.plan(slots, ranges)
            for direction in DIRECTIONS:
                run = tr.scatter if direction == "scatter" else tr.gather
                calls = {"per_layer": lambda run=run, plan=plan: run(plan, bufs, [0]),
                         "all_layers": lambda run=run, plan=plan: run(plan, bufs)}
                for shape, fn in calls.items():
                    fn()
                    secs = min(time_on_stream(fn, iters) for _ in range(2))
                    slow = forward_slowdown(fn, secs, index) if interference else None
                    out[(direction, shape, mode)] = PathTiming(secs, slow)
        torch.cuda.synchronize(dev)
    return out


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
    while layer-wise copies overlap compute. ``gather_blocks``: the gathers' own cap (saves
    run beside the forward that computed the KV; a load is what the forward waits for),
    default ``LMC_CUDA_GATHER_BLOCKS`` else ``max_blocks``. ``backend``: the CUDA runtime
    shim (the tests pass a host emulation).
    """

    def __init__(self, spec: KVSpec, kv_caches: KVCaches, *, gather_mode: str | None = None,
                 scatter_mode: str | None = None, max_blocks: int | None = None,
                 backend: Any = None, paths: Mapping[tuple[str, str], str] | None = None,
                 gather_blocks: int | None = None) -> None:
        super().__init__(spec, kv_caches)
        calibrate = backend is None
        if backend is None:
            if self.device.type != "cuda":
                raise ValueError(f"CudaTransfer needs the KV cache on a CUDA device, it is on "
                                 f"{self.device}; use TorchTransfer")
            backend = CupyBackend(self.device)
        self.backend = backend
        forced = {"gather": _mode("gather", gather_mode, None),
                  "scatter": _mode("scatter", scatter_mode, None)}
        if paths is None:  # calibrated per device (real GPUs only), else the defaults
            paths = (device_paths(backend.index) if calibrate and None in forced.values()
                     else DEFAULT_PATHS)
        self.paths = resolve_paths(paths, forced)
        self.path_calls: dict[tuple[str, str, str], int] = {}
        self.gather_mode = self.paths[("gather", "all_layers")]
        self.scatter_mode = self.paths[("scatter", "all_layers")]
        self.max_blocks = max_blocks or BLOCKS_PER_SM * backend.sm_count
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        env = os.environ.get("LMC_CUDA_GATHER_BLOCKS")
        if gather_blocks is None and env:
            try:
                gather_blocks = int(env)
            except ValueError:
                raise ValueError(f"LMC_CUDA_GATHER_BLOCKS must be a whole number of thread "
                                 f"blocks, got {env!r}") from None
        if gather_blocks is not None and gather_blocks < 1:
            raise ValueError(f"gather_blocks must be >= 1, got {gather_blocks}")
        self.gather_blocks = gather_blocks or self.max_blocks
        # a per-layer save needs few SMs (module doc): that cap unless one was given
        self.layer_gather_blocks = min(
            self.max_blocks, gather_blocks or max(LAYER_GATHER_MIN_BLOCKS,
                                                  backend.sm_count // LAYER_GATHER_SM_SHARE))
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
        """A point on ``stream`` (default: the current one) after everything issued to it.
        No device context is entered: an event records on its stream's own device, and this
        runs on the engine's thread once per layer saved (three context managers a call)."""
        stream = self.backend.stream(stream)
        return EventCompletion(self.backend.event(stream))

    def path_stats(self) -> dict[str, Any]:
        """The copy path per (direction, shape) and the calls made on each, for stats."""
        out: dict[str, Any] = {f"copy_path.{d}.{s}": m for (d, s), m in self.paths.items()}
        with self._lock:
            out.update({f"copy_calls.{d}.{s}.{m}": n
                        for (d, s, m), n in self.path_calls.items()})
        return out

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
        key = ("scatter" if to_cache else "gather", call_shape(len(lids), self.spec.num_layers))
        mode = self.paths[key]
        with self._lock:
            calls = (*key, mode)
            self.path_calls[calls] = self.path_calls.get(calls, 0) + 1
        with self.backend.context(stream):
            places = self._places(plan, bufs)
            if after is not None:
                after.wait(stream)
            if plan.n_tokens and lids:
                self.backend.wait(stream, plan)
                staged = [kind == "host" or (kind == "mapped" and mode == "staged")
                          for kind, _ in places]
                if len(lids) == 1 and not any(staged):
                    self._launch_layer(plan, lids[0], places, stream, to_cache)
                else:
                    self._launch(plan, bufs, lids, places, staged, stream, to_cache)
            ev = self.backend.event(stream)
        with self._lock:
            self._pending[getattr(stream, "cuda_stream", 0)] = ev
        return EventCompletion(ev, plan.bad_slots)

    def _places(self, plan: CudaPlan, bufs: list[torch.Tensor]) -> list[tuple[str, int]]:
        """Each buffer checked and located (:meth:`_place`); a call with the very tensor
        objects of the plan's previous call (the layers of one layer-wise copy) reuses that
        call's answer instead of checking every chunk again on every layer."""
        last = plan.checked
        if last is not None and len(last[0]) == len(bufs) and all(
                a is b for a, b in zip(last[0], bufs)):
            return last[1]
        places = [self._place(plan, i, b) for i, b in enumerate(bufs)]
        plan.checked = (bufs, places)  # references: the ids compared stay theirs
        return places

    def _layer_tables(self, plan: CudaPlan, places: list[tuple[str, int]], stream: Any,
                      to_cache: bool) -> tuple[Any, np.ndarray]:
        """The call table of every layer for one layer's call on buffers the kernel reaches
        itself (no staging), uploaded once: ``([layers, width] device table, vector width
        per layer)``. Why: a layer-wise copy makes a call per layer with the same plan and
        buffers; building and uploading a table each time held lmc's I/O thread (and the
        GIL) for work that differs between layers only by two addresses. Kept per stream:
        the upload is ordered on the stream of the calls that read it."""
        key = (to_cache, getattr(stream, "cuda_stream", 0), tuple(ptr for _, ptr in places))
        got = plan.layer_tables.get(key)
        if got is not None:
            return got
        P, rb, L = self.num_planes, self.row_bytes, self.spec.num_layers
        counts = np.array(plan.counts, dtype=np.int64)
        base = np.array([ptr for _, ptr in places], dtype=np.int64)
        # dst[layer, chunk, plane]: a direct buffer holds every layer of its chunk
        lp = np.arange(L)[:, None, None] * P + np.arange(P)[None, None, :]
        dst = base[None, :, None] + lp * counts[None, :, None] * rb
        table = np.concatenate([np.broadcast_to(self.geom.ravel(), (L, self.geom.size)),
                                self.cache_ptrs.reshape(L, P), dst.reshape(L, -1)], axis=1)
        align = np.bitwise_or.reduce(dst.reshape(L, -1), axis=1) if dst.size else \
            np.zeros(L, dtype=np.int64)
        vecs = np.array([vector_bytes(self._static_align | int(a)) for a in align])
        got = (self.backend.upload(np.ascontiguousarray(table)), vecs)
        if len(plan.layer_tables) >= 4:  # a plan is used with one set of buffers or two
            plan.layer_tables.clear()
        plan.layer_tables[key] = got
        return got

    def _launch_layer(self, plan: CudaPlan, lid: int, places: list[tuple[str, int]],
                      stream: Any, to_cache: bool) -> None:
        """One layer on buffers the kernel reads or writes itself: the same launch as
        :meth:`_launch`, from the plan's table of every layer."""
        tables, vecs = self._layer_tables(plan, places, stream, to_cache)
        P, rb = self.num_planes, self.row_bytes
        vec = int(vecs[lid])
        lanes = lanes_for(rb, vec)
        assert plan.tokens is not None  # planned calls always carry their tokens
        row_bytes = tables.shape[1] * tables.element_size()
        args = KVCopyArgs(tokens=plan.tokens.data_ptr(),
                          table=tables.data_ptr() + lid * row_bytes,
                          n_tokens=plan.n_tokens, block_size=self.spec.block_size,
                          n_layers=1, n_planes=P, head_size=self.spec.head_size,
                          row_bytes=rb, lanes=lanes, reserved=0)
        rows = plan.n_tokens * P
        blocks = max(1, min(-(-rows * lanes // THREADS), self._grid_cap(to_cache, 1)))
        self.backend.launch(f"lmc_kv_{'scatter' if to_cache else 'gather'}_v{vec}", blocks,
                            args, stream)

    def _grid_cap(self, to_cache: bool, n_call_layers: int) -> int:
        """The most thread blocks a call may take: loads ``max_blocks``, a per-layer gather
        (a save beside the forward) ``layer_gather_blocks``, other gathers ``gather_blocks``."""
        if to_cache:
            return self.max_blocks
        if call_shape(n_call_layers, len(self.layers)) == "per_layer":
            return self.layer_gather_blocks
        return self.gather_blocks

    def _memcpy(self, copy: tuple[int, int, int, int, int, int], stream: Any) -> None:
        """One (2D where ``height > 1``) copy: ``(dst, dpitch, src, spitch, width, height)``."""
        dst, dpitch, src, spitch, width, height = copy
        if height == 1:
            self.backend.memcpy(dst, src, width, stream)
            return
        two_d = getattr(self.backend, "memcpy2d", None)
        if two_d is not None:
            two_d(dst, dpitch, src, spitch, width, height, stream)
            return
        for r in range(height):  # a backend without 2D copies: row by row
            self.backend.memcpy(dst + r * dpitch, src + r * spitch, width, stream)

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
        # (chunk, host, staging, nbytes) per layer run and staged chunk, run-major: a run's
        # pieces of evenly spaced chunks (a pool's batch) then move in one 2D copy
        spans = []
        if staging is not None:
            chunks = np.flatnonzero(staged & (counts > 0)).tolist()
            for first, length in layer_runs(lids):
                for c in chunks:
                    host, stage, per = bufs[c].data_ptr(), int(base[c]), int(layer_bytes[c])
                    spans.append((c, host + lids[first] * per, stage + first * per,
                                  length * per))
        # each piece inside one host window (the driver refuses a copy across two); the
        # window of a buffer's first byte is kept with the plan: per-layer calls of one plan
        # reuse it, and only a span past it is cut (a buffer across a pinning step)
        pieces = []
        for c, h, s, n in spans:
            key = bufs[c].data_ptr()
            win = plan.windows.get(key)
            if win is None:
                win = plan.windows[key] = host_window(bufs[c])(key)
            if win[0] <= h and h + n <= win[1]:
                pieces.append((c, h, s, n, win[0]))
            else:
                pieces += [(c, *p) for p in cut_at_windows([(h, s, n)], host_window(bufs[c]))]
        to_stage = strided(coalesce([(s, h, n, w) for c, h, s, n, w in pieces
                                     if to_cache or plan.holes[c]]))
        from_stage = [] if to_cache else strided(coalesce([(h, s, n, w)
                                                           for _, h, s, n, w in pieces]))

        dev_table = self.backend.upload(table)
        assert plan.tokens is not None  # planned calls always carry their tokens
        args = KVCopyArgs(tokens=plan.tokens.data_ptr(), table=dev_table.data_ptr(),
                          n_tokens=plan.n_tokens, block_size=self.spec.block_size,
                          n_layers=n_layers, n_planes=P, head_size=self.spec.head_size,
                          row_bytes=rb, lanes=lanes, reserved=0)
        rows = plan.n_tokens * n_layers * P
        blocks = max(1, min(-(-rows * lanes // THREADS), self._grid_cap(to_cache, n_layers)))
        name = f"lmc_kv_{'scatter' if to_cache else 'gather'}_v{vec}"
        # Scatter fills the staging area first. Gather copies it back whole, so a chunk with
        # skipped rows (slot < 0) is first loaded too: those rows must come back unchanged.
        for copy in to_stage:
            self._memcpy(copy, stream)
        self.backend.launch(name, blocks, args, stream)
        for copy in from_stage:
            self._memcpy(copy, stream)
        # staging / dev_table were allocated on `stream`: freeing them here is stream-ordered.
