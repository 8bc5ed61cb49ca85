"""Llama-family decoder (Llama 2/3, Qwen2) over a paged KV cache.

Module and parameter names mirror Hugging Face (``model.layers.N.self_attn.q_proj``...)
so checkpoints load by name. The forward takes a flat batch of tokens from many
sequences (``input_ids [T]``, ``positions [T]``) plus an ``AttentionMetadata`` that says
where each token's K/V goes and which slots each sequence attends over.

Each layer's attention has two hook points, which is where a KV connector plugs in:

1. ``hooks.before_attention(layer_idx)`` runs before the layer touches its cache (before
   the new K/V are written and before attention reads the context), so a connector
   loading external KV into this layer's blocks can wait for that load here. Because
   the new tokens are written *after* it, a connector may write a whole block even when
   the engine computes the block's tail itself.
2. ``hooks.after_kv_write(layer_idx, kv_cache)`` runs once the layer's new K/V are in
   the cache (and its attention output is computed), so a connector can save them.

A *blended* forward (segment caching with selective recompute, ``lmc.blend``) passes a
``BlendStep``: some rows' K/V come from cached segments and are written after the layer's
connector load; at ``check_layer`` the step compares those rows' cached K/V with freshly
projected ones and keeps computing only the rows it selects (plus every row that is not
cached), so later layers run on fewer rows. ``forward`` then returns hidden states for the
rows still computed at the end (``BlendStep.output_rows``).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from lmc.reference.attention import AttentionMetadata, attend, write_kv
from lmc.reference.layers import RMSNorm, SwiGLU
from lmc.reference.model_config import ModelConfig
from lmc.reference.rope import RotaryEmbedding


class LayerHooks(Protocol):
    """Per-layer callbacks around the cache accesses (see the module docstring)."""

    def before_attention(self, layer_idx: int) -> None: ...

    def after_kv_write(self, layer_idx: int, kv_cache: torch.Tensor) -> None: ...


class BlendStep(Protocol):
    """What a blended forward asks of its planner (implemented by ``lmc.blend.step``)."""

    check_layer: int
    meta_before: AttentionMetadata  # the batch's metadata, writing only the uncached rows

    def cached_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(k, v, slots)`` of the rows whose K/V stay cached at this layer, or None."""
        ...

    def select(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, AttentionMetadata]:
        """Given every current row's fresh K/V at ``check_layer``: the rows to keep computing
        (indices into the current rows, ascending) and their attention metadata."""
        ...

    def output_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Where batch ``rows`` (all kept) are in the forward's result."""
        ...


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window = config.layer_window(layer_idx)  # None: full attention
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        # Llama's o_proj follows attention_bias; Qwen2's never has a bias.
        o_bias = bias and config.model_type != "qwen2"
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        hooks: LayerHooks | None,
        cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        q = RotaryEmbedding.rotate(q, cos, sin)
        k, v = self.project_kv(x, cos, sin)

        if hooks is not None:
            hooks.before_attention(self.layer_idx)  # external KV must be in place now
        if cached is not None:  # a blended step's cached segment rows, after the load
            write_kv(kv_cache, *cached)
        if meta.write_rows is None:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        else:
            rows = meta.write_rows
            write_kv(kv_cache, k[rows], v[rows], meta.slot_mapping[rows])
        out = attend(q, kv_cache, meta.for_window(self.window))
        if hooks is not None:
            hooks.after_kv_write(self.layer_idx, kv_cache)  # this layer's new K/V are stored
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated) and V ``[T, kv_heads, head_dim]`` of normed hidden states ``x``."""
        t = x.shape[0]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return RotaryEmbedding.rotate(k, cos, sin), v


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then SwiGLU."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        hooks: LayerHooks | None,
        cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, hooks, cached)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fresh_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V this layer would write for hidden states ``x`` (a blended step's check)."""
        return self.self_attn.project_kv(self.input_layernorm(x), cos, sin)


class DecoderStack(nn.Module):
    """Embeddings, layers and final norm: HF's ``model.*`` namespace."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The full model. ``forward`` returns final hidden states for every token;
    ``compute_logits`` projects only the rows the caller samples from."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        hooks: LayerHooks | None = None,
        blend: BlendStep | None = None,
    ) -> torch.Tensor:
        """``input_ids, positions [T]`` -> hidden states ``[T, hidden_size]``.

        Writes every token's K/V into ``kv_caches`` (one tensor per layer) at
        ``meta.slot_mapping`` as a side effect. With ``blend``, see the module docstring:
        the result has one row per row the step kept computing.
        """
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV cache tensors, got {len(kv_caches)}")
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if blend is not None:
            meta = blend.meta_before
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            cached = None
            if blend is not None:
                if i == blend.check_layer:
                    k, v = cast(DecoderLayer, layer).fresh_kv(x, cos, sin)
                    keep, meta = blend.select(k, v)
                    x, cos, sin = x[keep], cos[keep], sin[keep]
                cached = blend.cached_kv(i)
            x = layer(x, cos, sin, kv_cache, meta, hooks, cached)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32, whatever the model dtype, so sampling and tests see one dtype."""
        return self.lm_head(hidden).float()
