"""The KV codecs on a CUDA device (``lmc/transfer/csrc/kv_codecs.cu``, beside the copy
kernels, compiled at run time by CuPy's NVRTC as they are): a chunk in device memory coded there, so the coded bytes are what
crosses PCIe, and decoded there after a load. The bytes are the CPU path's
(:mod:`lmc.storage.kvcodecs`), bit for bit (``tests/transfer/test_kv_codecs_cu.py`` runs
these kernels on the CPU; the device run is marked ``gpu``).

Not yet wired into the gather/scatter paths (:mod:`lmc.transfer.cuda_copy`): a tier's codec
runs on the CPU today, on the pool's copy of the chunk.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from lmc.storage.kvcodecs.base import KVCodec, NotEncodable

SOURCE = Path(__file__).parents[2] / "transfer" / "csrc" / "kv_codecs.cu"
OPTIONS = ("--std=c++17", "--fmad=false")  # no fused multiply-adds: the CPU path's rounding
THREADS = 256
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@functools.cache
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=SOURCE.read_text(), options=OPTIONS)


def _launch(name: str, work: int, *args: Any) -> None:
    import cupy

    blocks = max(1, min(65535, -(-work // THREADS)))
    conv = [cupy.int32(a[0]) if isinstance(a, tuple) else
            (a.data_ptr() if isinstance(a, torch.Tensor) else cupy.int64(a)) for a in args]
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    with stream:
        _module().get_function(name)((blocks,), (THREADS,), tuple(conv))


def encode(codec: KVCodec, x: torch.Tensor, out: torch.Tensor) -> None:
    """``x`` (a chunk on the device, contiguous) into ``out`` (``encoded_bytes`` uint8 on the
    device), on the current stream. Raises :class:`NotEncodable` (which synchronises)."""
    n, p, t, w = x.shape
    k = codec.kernel_param(w)
    dt = (DTYPES[x.dtype],)
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    if codec.kernel == "fp8":
        rowmax = torch.empty(n * p * t * k, dtype=torch.float32, device=x.device)
        _launch("lmc_fp8_rowmax", n * p * t * k, x, dt, rowmax, bad, n, p, t, w, k)
        _launch("lmc_fp8_scales", n * p * k, rowmax, out, n, p, t, w, k)
        _launch("lmc_fp8_encode", x.numel(), x, dt, out, n, p, t, w, k)
    elif codec.kernel == "int8":
        _launch("lmc_int8_encode", n * p * t * k, x, dt, out, bad, n, p, t, w, k)
    else:
        _launch("lmc_int4_params", x.numel() // max(1, k), x, dt, out, bad, n, p, t, w, k)
        _launch("lmc_int4_pack", x.numel() // 2 + 1, x, dt, out, n, p, t, w, k)
    if bool(bad.item()):
        raise NotEncodable("the chunk holds a non-finite value or one past the codec's range")


def decode(codec: KVCodec, buf: torch.Tensor, out: torch.Tensor) -> None:
    """``buf`` (the codes, on the device) into ``out`` (the chunk), on the current stream."""
    n, p, t, w = out.shape
    _launch(f"lmc_{codec.kernel}_decode", out.numel(), buf, out, (DTYPES[out.dtype],), n, p,
            t, w, codec.kernel_param(w))
