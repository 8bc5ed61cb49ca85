"""Placing a cached segment at a new position: rotate its K by the position difference.

RoPE rotates each (i, i + d/2) pair of a key by ``position * inv_freq[i]``; rotations of one
plane compose by adding angles, so K computed at position ``p`` and rotated by ``delta``
equals K computed at ``p + delta`` (exactly in real arithmetic; in floats, to the rounding of the angle of the
position itself, which a direct computation at ``p + delta`` has too). That
holds whenever the angle is linear in the position with fixed frequencies: the plain RoPE of
Llama 2 and Qwen2, linear scaling, and Llama 3's scaling (which only changes the
frequencies). V carries no position and is placed as is.

Anything whose angle is not a fixed multiple of the position (dynamic NTK, YaRN's attention
temperature, LongRoPE's length-switched factors, M-RoPE's sections) cannot be placed by a
rotation, and blending is refused for it by name (:func:`check_placeable`) rather than
approximated. The rotation runs in fp32 and rounds once to the cache dtype.
"""

from __future__ import annotations

import torch

from lmc.reference.model_config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeConfig
from lmc.reference.rope import RotaryEmbedding

PLACEABLE_ROPE_KINDS = ("default", "linear", "llama3")


class BlendUnsupported(ValueError):
    """This model cannot be blended; the message names what is not supported."""


def check_placeable(config: ModelConfig) -> None:
    """Raise :class:`BlendUnsupported` unless segments of this model can be re-placed."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise BlendUnsupported(f"blending does not support model_type {config.model_type!r} "
                               f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    check_rope(config.rope)


def check_rope(rope: RopeConfig) -> None:
    if rope.kind not in PLACEABLE_ROPE_KINDS:
        raise BlendUnsupported(
            f"blending does not support rope scaling {rope.kind!r}: its rotation is not a fixed "
            f"multiple of the position, so a cached K cannot be moved by rotating it "
            f"(supported: {', '.join(PLACEABLE_ROPE_KINDS)})")


class KeyShifter:
    """Rotates cached keys by per-token position differences for one model's RoPE."""

    def __init__(self, config: ModelConfig) -> None:
        check_placeable(config)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)

    def shift(self, keys: torch.Tensor, delta: torch.Tensor | int) -> torch.Tensor:
        """``keys [T, kv_heads, head_dim]`` (or ``[layers, T, kv_heads, head_dim]``) computed at
        positions ``p`` -> the same keys at ``p + delta`` (``delta``: one int, or ``[T]`` per
        token). Same dtype as ``keys``."""
        if keys.dim() not in (3, 4) or keys.shape[-1] != self.rotary.head_dim:
            raise ValueError(f"keys must be [tokens, heads, {self.rotary.head_dim}] (or with "
                             f"layers first), got {tuple(keys.shape)}")
        n = keys.shape[-3]
        if isinstance(delta, int):
            delta = torch.full((n,), delta, dtype=torch.long)
        delta = delta.to(device=keys.device, dtype=torch.long)
        if delta.shape != (n,):
            raise ValueError(f"delta must be one int or [{n}], got {tuple(delta.shape)}")
        if not bool((delta != 0).any()):
            return keys
        # angles in fp64: the shift adds no rounding of its own beyond the final fp32 product
        inv_freq = self.rotary.inv_freq(keys.device).double()
        freqs = delta.double()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().float(), emb.sin().float()
        return RotaryEmbedding.rotate(keys.float(), cos, sin).to(keys.dtype)
