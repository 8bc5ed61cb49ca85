"""Allocation and sizing of the paged KV cache.

One tensor per layer, vLLM flash layout ``[2, num_blocks, block_size, num_kv_heads,
head_size]`` (K plane 0, V plane 1). All ``num_blocks`` blocks are usable: block 0 is
an ordinary block, not a reserved null block (nothing in this engine needs one, since
padding reads a sequence's own slots). Tensors are zero-filled so that a slot never
written holds zeros, not NaN from uninitialised memory.
"""

from __future__ import annotations

import torch

from lmc.reference.model_config import ModelConfig


def layer_name(layer_idx: int) -> str:
    """Name under which a layer's cache is registered with a connector (HF module path)."""
    return f"model.layers.{layer_idx}.self_attn"


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes one block costs across all layers."""
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim
    return per_layer * config.num_hidden_layers * torch.empty((), dtype=dtype).element_size()


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
    shape = kv_cache_shape(config, num_blocks, block_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
