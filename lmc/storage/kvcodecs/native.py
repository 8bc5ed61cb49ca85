"""The codecs' C kernels (``lmc._kvcodecs``, built from ``lmc/csrc/kvcodecs.c`` when a compiler
is there), called on contiguous CPU slices; elsewhere the torch formulation runs (the same
bytes, several times slower). ``ENABLED`` lets a test run both paths."""

from __future__ import annotations

from typing import Any

import torch

from lmc.storage.kvcodecs.base import NotEncodable

try:
    import lmc._kvcodecs as _kernels
except ImportError:  # no compiler at install: the torch path
    _kernels = None

ENABLED = _kernels is not None
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _usable(*tensors: torch.Tensor) -> bool:
    return ENABLED and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def encode(family: str, k: int, x: torch.Tensor, out: torch.Tensor) -> bool:
    """``x`` ``[n, planes, tokens, width]`` into ``out`` ``[n, layer bytes]`` with kernel
    ``family`` (``k``: heads, or int4's group); False when the kernels cannot take it."""
    code = DTYPE_CODES.get(x.dtype)
    if code is None or not _usable(x, out):
        return False
    fn: Any = getattr(_kernels, f"{family}_encode")
    n, p, t, w = x.shape
    if fn(x.data_ptr(), code, out.data_ptr(), n, p, t, w, k):
        raise NotEncodable("the chunk holds a non-finite value or one past the codec's range")
    return True


def decode(family: str, k: int, buf: torch.Tensor, out: torch.Tensor) -> bool:
    """``buf`` ``[n, layer bytes]`` into ``out`` ``[n, planes, tokens, width]``."""
    code = DTYPE_CODES.get(out.dtype)
    if code is None or not _usable(buf, out):
        return False
    fn: Any = getattr(_kernels, f"{family}_decode")
    n, p, t, w = out.shape
    fn(buf.data_ptr(), code, out.data_ptr(), n, p, t, w, k)
    return True
