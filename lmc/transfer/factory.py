"""Choosing a copy path for a cache: :func:`make_transfer`."""

from __future__ import annotations

from collections.abc import Callable

from lmc.transfer.kv_spec import KVCaches, KVSpec
from lmc.transfer.plan import KVTransfer
from lmc.transfer.torch_copy import TorchTransfer

TransferFactory = Callable[[KVSpec, KVCaches], KVTransfer]


def make_transfer(spec: KVSpec, kv_caches: KVCaches, prefer: str | TransferFactory = "auto"
                  ) -> KVTransfer:
    """The CUDA kernels when the cache is on CUDA and CuPy imports, else the torch path.

    ``prefer="torch"`` forces the portable path (tests compare the two bit for bit); a
    callable ``(spec, kv_caches) -> KVTransfer`` builds the transfer itself (a test backend).
    """
    if callable(prefer):
        return prefer(spec, kv_caches)
    if prefer not in ("auto", "torch", "cuda"):
        raise ValueError(f"prefer must be 'auto', 'torch' or 'cuda', got {prefer!r}")
    layers = spec.validate(kv_caches)
    on_cuda = layers[0][0].device.type == "cuda"
    if prefer != "torch" and on_cuda:
        try:
            from lmc.transfer.cuda_copy import CudaTransfer, cuda_kernels_available
        except ImportError:
            pass
        else:
            if cuda_kernels_available():
                return CudaTransfer(spec, kv_caches)
        if prefer == "cuda":
            raise RuntimeError("prefer='cuda' but CuPy (pip install lmc-kvcache[gpu]) is missing")
    elif prefer == "cuda":
        raise ValueError(f"prefer='cuda' but the KV cache is on {layers[0][0].device}")
    return TorchTransfer(spec, kv_caches)
