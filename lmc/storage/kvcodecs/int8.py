"""``int8``: symmetric 8-bit integers, one fp32 scale per (layer, plane, token, head).

Per token and head, ``scale = amax / 127`` and ``q = round(x / scale)``: a head's outlier
token costs only that token's precision. A layer's block is its scales (``[planes, tokens,
heads]`` fp32), then its values (``[planes, tokens, width]`` int8). For head size 64: 68 bytes
per 64 values against 128 in fp16/bf16 (0.53). Error: half a step, ``scale / 2``.
"""

from __future__ import annotations

import torch

from lmc.storage.kvcodecs.base import KVCodec, check_finite, fp32_rounding

TINY = 2.0 ** -100


class Int8(KVCodec):
    name = "int8"
    kernel = "int8"

    def layer_bytes(self, planes: int, tokens: int, width: int) -> int:
        return 4 * planes * tokens * self.heads(width) + planes * tokens * width

    def _scales(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, p, t, w = x.shape
        h = self.heads(w)
        xf = x.float().reshape(n, p, t, h, w // h)
        amax = xf.abs().amax(dim=4)
        check_finite(amax)
        return xf, (amax / 127.0).clamp_min(TINY)

    def encode_layers(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n = x.shape[0]
        xf, scale = self._scales(x)
        s = scale.numel() // n * 4
        q = (xf / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8)
        out[:, :s].copy_(scale.reshape(n, -1).view(torch.uint8))
        out[:, s:].copy_(q.reshape(n, -1).view(torch.uint8))

    def decode_layers(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        n, p, t, w = out.shape
        h = self.heads(w)
        s = 4 * p * t * h
        scale = buf[:, :s].contiguous().view(torch.float32).view(n, p, t, h, 1)
        q = buf[:, s:].view(torch.int8).view(n, p, t, h, w // h)
        out.view(n, p, t, h, w // h).copy_(q.float().mul_(scale))

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        _, scale = self._scales(x)
        n, p, t, w = x.shape
        h = self.heads(w)
        bound = (scale[..., None] * 0.5 * (1 + 2.0 ** -20)).expand(n, p, t, h, w // h)
        bound = bound.reshape(x.shape)
        return bound + fp32_rounding(x.float().abs() + bound, x.dtype)
