"""The KV a codec tier would serve for a prompt: what the quality harness judges.

A tier codes each chunk on its own (``chunk_size`` tokens, the last one partial), so the
served KV of a prompt is each chunk's round trip through the stage, in the chunk layout the
tier stores (``[layers, planes, tokens, heads * head_size]``), put back in the harness's
``[layers, 2, tokens, heads, head_size]``.
"""

from __future__ import annotations

import torch

from lmc.storage.kvcodecs.stage import CodecStage


def served_kv(exact: torch.Tensor, stage: CodecStage, chunk_size: int) -> torch.Tensor:
    """``exact`` (``[layers, planes, tokens, heads, head_size]``, not modified) as a tier
    with ``stage`` gives it back, chunk by chunk."""
    layers, planes, tokens, heads, dim = exact.shape
    flat = exact.reshape(layers, planes, tokens, heads * dim)
    parts = []
    for a in range(0, tokens, chunk_size):
        chunk = flat[:, :, a:a + chunk_size].contiguous()
        parts.append(stage.round_trip(chunk))
    return torch.cat(parts, 2).reshape(exact.shape)
