"""``int4-kivi``: 4-bit asymmetric integers, keys per channel and values per token.

Keys have outlier *channels* (a few dimensions large for every token), values do not, so
keys are grouped along tokens -- each channel of each run of ``group`` tokens gets its own
scale and zero point -- and values along channels -- each run of ``group`` channels of each
token. MLA's single latent plane is grouped as values. Per group ``scale = (max - min) / 15``
and ``q = round((x - min) / scale)``, both kept as fp16 in the value (4 bytes per group), two
``q`` per byte. A partial group (the last tokens of a short chunk, a width not a multiple of
``group``) is grouped as far as it goes.

A layer's block, per plane in order: the packed values (``ceil(tokens * width / 2)`` bytes),
then the scales and the zero points (fp16, one per group each). For group 32: 0.31 bytes per
value against 2 in fp16/bf16 (0.28 with the scales). Error: half a step, ``scale / 2``, plus
what storing the scale and zero point as fp16 moves them (counted in :meth:`error_bound`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from lmc.storage.kvcodecs.base import KVCodec, check_finite, fp32_rounding

TINY = 2.0 ** -100
FP16_LIMIT = 60000.0  # scales and zero points are fp16: a chunk past this is stored exact
LEVELS = 15


class Int4Kivi(KVCodec):
    name = "int4-kivi"
    kernel = "int4"

    def __init__(self, head_size: int | None = None, group: int = 32) -> None:
        super().__init__(head_size)
        if not isinstance(group, int) or not 1 <= group <= 4096:
            raise ValueError(f"{self.name}: group must be an int in 1..4096, got {group!r}")
        self.group = group

    def params(self) -> Mapping[str, int]:
        return {"g": self.group}

    def settings(self) -> Mapping[str, int]:
        return {"group": self.group}

    def kernel_param(self, width: int) -> int:
        return self.group

    # -------------------------------------------------------------------- sizes
    def _plane_bytes(self, keys: bool, tokens: int, width: int) -> int:
        groups = (math.ceil(tokens / self.group) * width if keys
                  else tokens * math.ceil(width / self.group))
        return (tokens * width + 1) // 2 + 4 * groups

    def _kinds(self, planes: int) -> list[bool]:
        """Per plane: grouped per channel (keys) or per token (values, MLA's latent)."""
        return [True, False] if planes == 2 else [False] * planes

    def layer_bytes(self, planes: int, tokens: int, width: int) -> int:
        return sum(self._plane_bytes(k, tokens, width) for k in self._kinds(planes))

    # ---------------------------------------------------------------- groupings
    def _grouped(self, x: torch.Tensor, keys: bool) -> torch.Tensor:
        """``x`` ``[n, tokens, width]`` as fp32 groups, the group axis last:
        ``[n, token groups, width, group]`` (keys) or ``[n, tokens, channel groups, group]``
        (values); a partial group is padded with its last element (which changes no min or
        max)."""
        g = self.group
        xf = x.float()
        axis = 1 if keys else 2
        size = xf.shape[axis]
        pad = -size % g
        if pad:
            edge = xf.narrow(axis, size - 1, 1)
            xf = torch.cat([xf, edge.expand(*(pad if a == axis else s
                                               for a, s in enumerate(xf.shape)))], axis)
        n, t, w = xf.shape
        if keys:
            return xf.view(n, t // g, g, w).transpose(2, 3)
        return xf.view(n, t, w // g, g)

    @staticmethod
    def _ungroup(v: torch.Tensor, keys: bool, tokens: int, width: int) -> torch.Tensor:
        """The inverse of :meth:`_grouped`: ``[n, tokens, width]``, padding dropped."""
        n = v.shape[0]
        v = v.transpose(2, 3).reshape(n, -1, v.shape[2]) if keys else v.reshape(n, v.shape[1], -1)
        return v[:, :tokens, :width]

    def _params(self, grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp16 scale and zero point of each group (fp16 values, as stored)."""
        lo = grouped.amin(-1)
        hi = grouped.amax(-1)
        check_finite(lo, hi, limit=FP16_LIMIT)
        return ((hi - lo) / LEVELS).half(), lo.half()

    # ------------------------------------------------------------------- coding
    def encode_layers(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n, planes, t, w = x.shape
        off = 0
        for p, keys in enumerate(self._kinds(planes)):
            grouped = self._grouped(x[:, p], keys)
            scale, zero = self._params(grouped)
            sf = scale.float().clamp_min_(TINY)[..., None]
            q = ((grouped - zero.float()[..., None]) / sf).round_().clamp_(0, LEVELS)
            q = self._ungroup(q.to(torch.uint8), keys, t, w).reshape(n, -1)
            packed = _pack4(q)
            k = packed.shape[1]
            out[:, off:off + k].copy_(packed)
            off += k
            for part in (scale, zero):
                b = part.reshape(n, -1).view(torch.uint8)
                out[:, off:off + b.shape[1]].copy_(b)
                off += b.shape[1]

    def decode_layers(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        n, planes, t, w = out.shape
        g = self.group
        off = 0
        for p, keys in enumerate(self._kinds(planes)):
            k = (t * w + 1) // 2
            q = _unpack4(buf[:, off:off + k], t * w).view(n, t, w)
            off += k
            shape = (n, math.ceil(t / g), w) if keys else (n, t, math.ceil(w / g))
            groups = shape[1] * shape[2]
            scale = buf[:, off:off + 2 * groups].contiguous().view(torch.float16).view(shape)
            off += 2 * groups
            zero = buf[:, off:off + 2 * groups].contiguous().view(torch.float16).view(shape)
            off += 2 * groups
            qg = self._grouped(q, keys)
            v = qg.mul_(scale.float()[..., None]).add_(zero.float()[..., None])
            out[:, p].copy_(self._ungroup(v, keys, t, w))

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=torch.float32)
        for p, keys in enumerate(self._kinds(x.shape[1])):
            grouped = self._grouped(x[:, p], keys)
            lo, hi = grouped.amin(-1), grouped.amax(-1)
            scale, zero = self._params(grouped)
            exact = (hi - lo) / LEVELS
            per_group = (0.5 * scale.float() + (LEVELS + 1) * (exact - scale.float()).abs()
                         + (lo - zero.float()).abs()
                         + 2.0 ** -20 * torch.maximum(lo.abs(), hi.abs()))
            b = per_group[..., None].expand(grouped.shape)
            out[:, p] = self._ungroup(b, keys, x.shape[2], x.shape[3])
        return out + fp32_rounding(x.float().abs() + out, x.dtype)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` values 0..15 as ``[n, ceil(m / 2)]`` bytes, low nibble first."""
    if q.shape[1] % 2:
        q = torch.cat([q, q.new_zeros(q.shape[0], 1)], 1)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _unpack4(b: torch.Tensor, m: int) -> torch.Tensor:
    """The inverse of :func:`_pack4`: ``[n, m]`` uint8."""
    n = b.shape[0]
    return torch.stack([b & 15, b >> 4], -1).view(n, -1)[:, :m]
