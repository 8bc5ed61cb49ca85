"""A plain dense forward for Llama/Qwen2 checkpoints, written independently of the
engine (straight from the Hugging Face math, no paging, no engine modules), used as
ground truth for the paged model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


def read_checkpoint(model_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = json.loads((model_dir / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update({k: v.float() for k, v in load_file(str(f)).items()})
    return cfg, weights


def inv_frequencies(cfg: dict, head_dim: int) -> torch.Tensor:
    base = cfg.get("rope_theta", 10000.0)
    freqs = [1.0 / base ** (2 * i / head_dim) for i in range(head_dim // 2)]
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        out = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                out.append(f)
            elif wavelen > old / lo:
                out.append(f / factor)
            else:
                s = (old / wavelen - lo) / (hi - lo)
                out.append((1 - s) * f / factor + s * f)
        freqs = out
    return torch.tensor(freqs, dtype=torch.float32)


def dense_logits(model_dir: Path, token_ids: list[int], windows: bool = True) -> torch.Tensor:
    """fp32 logits ``[len(token_ids), vocab]`` for every position: causal attention, over
    the last ``sliding_window`` positions in a layer ``layer_types`` marks sliding (unless
    ``windows`` is False: every layer full, to show the windows change the result)."""
    cfg, w = read_checkpoint(Path(model_dir))
    hidden, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_heads)
    head_dim = cfg.get("head_dim", hidden // n_heads)
    eps = cfg.get("rms_norm_eps", 1e-6)
    t = len(token_ids)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    pos = torch.arange(t, dtype=torch.float32)
    angles = pos[:, None] * inv_frequencies(cfg, head_dim)[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)

    def rope(x: torch.Tensor) -> torch.Tensor:  # [heads, t, d]
        half = head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    causal = torch.full((t, t), float("-inf")).triu(1)
    kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    if windows and "sliding_attention" in kinds:  # key j is out of query i's window: j <= i - W
        far = torch.full((t, t), float("-inf")).tril(-cfg["sliding_window"])
        sliding = causal + far
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        mask = sliding if windows and kinds[i] == "sliding_attention" else causal
        h = rms(x, w[p + "input_layernorm.weight"])
        q = linear(h, p + "self_attn.q_proj").view(t, n_heads, head_dim).transpose(0, 1)
        k = linear(h, p + "self_attn.k_proj").view(t, n_kv, head_dim).transpose(0, 1)
        v = linear(h, p + "self_attn.v_proj").view(t, n_kv, head_dim).transpose(0, 1)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(n_heads // n_kv, 0)
        v = v.repeat_interleave(n_heads // n_kv, 0)
        probs = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(head_dim) + mask, -1)
        attn = (probs @ v).transpose(0, 1).reshape(t, n_heads * head_dim)
        x = x + linear(attn, p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = linear(h, p + "mlp.gate_proj"), linear(h, p + "mlp.up_proj")
        x = x + linear(torch.nn.functional.silu(gate) * up, p + "mlp.down_proj")
    x = rms(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T
