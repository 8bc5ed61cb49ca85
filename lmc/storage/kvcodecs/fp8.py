"""``fp8-e4m3``: every value as an e4m3 float scaled per (chunk, layer, plane, head).

One scale per head of each layer's K (and V) over the chunk's tokens: ``amax / 448`` (448 is
e4m3's largest finite value), so each head uses e4m3's whole range and its largest value is
exact. A layer's block is its scales (``[planes, heads]`` fp32), then its values (``[planes,
tokens, width]``, one byte each). Half the bytes of fp16/bf16, a quarter of fp32. Error: e4m3
keeps 3 mantissa bits, so within 1/16 of each value (half an ulp), or half its smallest step
(``scale * 2**-10``) near zero.
"""

from __future__ import annotations

import torch

from lmc.storage.kvcodecs.base import KVCodec, check_finite, fp32_rounding

E4M3_MAX = 448.0
TINY = 2.0 ** -100  # the scale of an all-zero head: any positive number decodes zeros exactly


class Fp8E4M3(KVCodec):
    name = "fp8-e4m3"
    kernel = "fp8"

    def layer_bytes(self, planes: int, tokens: int, width: int) -> int:
        return 4 * planes * self.heads(width) + planes * tokens * width

    def _scales(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` as fp32 ``[n, planes, tokens, heads, dim]`` and its ``[n, planes, heads]``
        scales."""
        n, p, t, w = x.shape
        h = self.heads(w)
        xf = x.float().reshape(n, p, t, h, w // h)
        amax = xf.abs().amax(dim=(2, 4))
        check_finite(amax)
        return xf, (amax / E4M3_MAX).clamp_min(TINY)

    def encode_layers(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n, p = x.shape[:2]
        xf, scale = self._scales(x)
        s = scale.numel() // n * 4
        q = (xf / scale[:, :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        out[:, :s].copy_(scale.reshape(n, -1).view(torch.uint8))
        out[:, s:].copy_(q.to(torch.float8_e4m3fn).reshape(n, -1).view(torch.uint8))

    def decode_layers(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        n, p, t, w = out.shape
        h = self.heads(w)
        s = 4 * p * h
        scale = buf[:, :s].contiguous().view(torch.float32).view(n, p, 1, h, 1)
        q = buf[:, s:].view(torch.float8_e4m3fn).view(n, p, t, h, w // h)
        out.view(n, p, t, h, w // h).copy_(q.float().mul_(scale))

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        n, p, t, w = x.shape
        xf, scale = self._scales(x)
        step = scale[:, :, None, :, None] * 2.0 ** -10
        bound = (xf.abs() * 2.0 ** -4 + step).reshape(x.shape)
        return bound + fp32_rounding(x.float().abs() + bound, x.dtype)
