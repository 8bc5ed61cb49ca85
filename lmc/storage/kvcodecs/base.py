"""What a KV codec is: a lossy (or exact) transform of one chunk, layer by layer.

A chunk is ``[layers, planes, tokens, width]`` (``lmc.transfer.kv_spec.KVSpec.chunk_shape``):
``planes`` is 2 (K, V) or 1 (MLA's latent), ``width`` is ``heads * head_size``. A codec
declares the geometry it works in -- ``head_size`` (the scales' granularity along the width;
``None``: the whole width is one group, as for MLA) and its own parameters -- and turns each
layer into a block of bytes of a size it can say from the shape alone
(:meth:`KVCodec.layer_bytes`), so a value's length is checked before anything is decoded and
the blocks of a chunk lie layer after layer (a reader could decode layer ``i`` once its bytes
are in).

Encoding and decoding are torch operations over whole slices of layers (no Python loop per
element): torch releases the GIL inside each, and a slice is bounded (:data:`SLICE_BYTES`
of source per call), so a store on another thread is never held for a whole chunk's work and
the temporaries stay small.

Each codec states its error bound (:meth:`KVCodec.error_bound`), which the tests hold every
round trip to; the quality harness judges whether a model keeps its answers under it.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from collections.abc import Mapping

SLICE_BYTES = 4 << 20
"""Source bytes one encode or decode call works on at most (whole layers; at least one)."""

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NotEncodable(ValueError):
    """This chunk's values do not fit the codec (a non-finite value, one past the scales'
    range): the chunk is stored exact instead, and its header says so."""


class KVCodec(abc.ABC):
    """One lossy stage: a chunk's float KV to bytes and back, within :meth:`error_bound`."""

    name: ClassVar[str]
    """The codec's name in config (``fp8-e4m3``, ``int8``, ``int4-kivi``)."""

    def __init__(self, head_size: int | None = None) -> None:
        if head_size is not None and (not isinstance(head_size, int) or head_size < 1):
            raise ValueError(f"{self.name}: head_size must be a positive int, got {head_size!r}")
        self.head_size = head_size

    # ----------------------------------------------------------------- description
    def params(self) -> Mapping[str, int]:
        """The parameters that change the stored bytes (beyond ``head_size``)."""
        return {}

    def settings(self) -> Mapping[str, int]:
        """The parameters by their config names (``int4-kivi,group=32``)."""
        return {}

    @property
    def ident(self) -> str:
        """Name and every parameter: what a value's header carries and the key namespace is
        derived from, so a reader configured otherwise misses instead of misreading."""
        parts = [self.name, *(f"{k}{v}" for k, v in sorted(self.params().items()))]
        parts.append(f"h{self.head_size or 0}")
        return ".".join(parts)

    def accepts(self, dtype: torch.dtype) -> bool:
        """Whether chunks of ``dtype`` are encoded (others are stored exact)."""
        return dtype in FLOAT_DTYPES

    def heads(self, width: int) -> int:
        """Scale groups along the width: one per head, or one when no head size is known
        (or it does not divide the width)."""
        h = self.head_size
        return width // h if h and width % h == 0 else 1

    # -------------------------------------------------------------------- sizes
    @abc.abstractmethod
    def layer_bytes(self, planes: int, tokens: int, width: int) -> int:
        """Bytes one layer of ``[planes, tokens, width]`` encodes to."""

    def encoded_bytes(self, shape: tuple[int, ...]) -> int:
        layers, planes, tokens, width = shape
        return layers * self.layer_bytes(planes, tokens, width)

    # ------------------------------------------------------------------- coding
    @abc.abstractmethod
    def encode_layers(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Encode ``x`` (``[n, planes, tokens, width]``, a float dtype) into ``out``
        (``[n, layer_bytes]`` uint8). Raises :class:`NotEncodable`."""

    @abc.abstractmethod
    def decode_layers(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        """Decode ``buf`` (``[n, layer_bytes]`` uint8) into ``out`` (``[n, planes,
        tokens, width]``, the chunk's dtype)."""

    @abc.abstractmethod
    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per element of ``x`` (a chunk), the largest ``|decode(encode(x)) - x|`` the codec
        allows (fp32), including the rounding to ``x``'s dtype."""

    # -------------------------------------------------------- whole chunks, sliced
    kernel: ClassVar[str]
    """The C kernels' family (``lmc.storage.kvcodecs.native``) that codes as this class does."""

    def kernel_param(self, width: int) -> int:
        """The kernels' last argument: scale groups per token width (heads)."""
        return self.heads(width)

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``x`` (a 4-D chunk) into ``out`` (``encoded_bytes`` uint8), a slice of layers at
        a time: the C kernels where built, else :meth:`encode_layers`."""
        from lmc.storage.kvcodecs import native

        layers = x.shape[0]
        lb = self.layer_bytes(*x.shape[1:])
        rows = out.view(layers, lb)
        k = self.kernel_param(x.shape[3])
        for a, b in _slices(x):
            if not native.encode(self.kernel, k, x[a:b], rows[a:b]):
                self.encode_layers(x[a:b], rows[a:b])

    def decode(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        """``buf`` (``encoded_bytes`` uint8) into ``out`` (the chunk), a slice at a time."""
        from lmc.storage.kvcodecs import native

        layers = out.shape[0]
        lb = self.layer_bytes(*out.shape[1:])
        rows = buf.view(layers, lb)
        k = self.kernel_param(out.shape[3])
        for a, b in _slices(out):
            if not native.decode(self.kernel, k, rows[a:b], out[a:b]):
                self.decode_layers(rows[a:b], out[a:b])

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: what a tier holding ``x`` through this codec gives back
        (the contract suite's expectation; chunks it does not encode come back as they
        were)."""
        if not self.accepts(x.dtype):
            return x.clone()
        buf = torch.empty(self.encoded_bytes(tuple(x.shape)), dtype=torch.uint8)
        try:
            self.encode(x, buf)
        except NotEncodable:
            return x.clone()
        out = torch.empty_like(x)
        self.decode(buf, out)
        return out


def _slices(x: torch.Tensor) -> list[tuple[int, int]]:
    """Whole layers of ``x`` in runs of at most :data:`SLICE_BYTES` (at least one layer)."""
    layers = x.shape[0]
    per = max(1, x[0].numel() * x.element_size())
    step = max(1, SLICE_BYTES // per)
    return [(a, min(a + step, layers)) for a in range(0, layers, step)]


def fp32_rounding(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half an ulp of ``dtype`` at ``|x|``: the rounding of a decoded value to the chunk's
    dtype (relative; subnormals are below every bound the codecs state)."""
    eps = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
           torch.bfloat16: 2.0 ** -8}[dtype]
    return x.abs() * eps


def check_finite(*stats: torch.Tensor, limit: float | None = None) -> None:
    """Raise :class:`NotEncodable` unless every statistic is finite (a NaN or infinity in
    the chunk reaches its max), and within ``limit`` when given."""
    for s in stats:
        if not bool(torch.isfinite(s).all()):
            raise NotEncodable("the chunk holds a non-finite value")
        if limit is not None and bool((s.abs() > limit).any()):
            raise NotEncodable(f"the chunk holds a value past {limit:g}")
