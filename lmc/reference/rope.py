"""Rotary position embeddings (RoPE), in the Hugging Face "rotate half" convention.

Llama and Qwen2 checkpoints split each head into two halves (not interleaved pairs), so
a position's rotation is ``x * cos + rotate_half(x) * sin`` with cos/sin repeated over
both halves. Frequencies are computed in fp32 and cast to the activation dtype at the
end, as Hugging Face does, so fp32 results match a dense HF-style forward.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmc.reference.model_config import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32), with any rope scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 long-context scaling: slow down low frequencies, keep high ones,
    blend smoothly in between (wavelengths measured against the original context)."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for arbitrary (non-contiguous) positions, so chunked prefill and
    decode of many sequences at different offsets need no cached table.

    The frequencies are a plain CPU tensor (not a buffer) so that building the model on
    the meta device, as the loader does, leaves them real; they are copied to the
    positions' device on first use.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._inv_freq = rope_inv_freq(head_dim, rope)
        self._per_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._per_device:
            self._per_device[device] = self._inv_freq.to(device)
        return self._per_device[device]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> cos, sin ``[T, head_dim]`` in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` by per-token ``cos/sin [T, head_dim]``."""
        return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
