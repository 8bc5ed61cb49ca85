"""A Llama GGUF file as a Hugging Face Llama checkpoint's parts: ``config.json`` contents from
the metadata, and every weight dequantized to float under its HF name.

Two conventions differ between the formats, and both are undone here:

* GGUF stores the rows of ``attn_q`` and ``attn_k`` permuted for an interleaved rotary layout
  (pairs ``(2i, 2i+1)`` rotate together); HF Llama rotates halves (``i`` with ``i + d/2``).
  :func:`unpermute_rows` restores HF's row order. Without it the model still runs but attends
  by the wrong positions (perplexity ~20x higher on English).
* GGUF lists dimensions innermost first; the dequantized arrays are already ``[out, in]``.

Needs the ``gguf`` package (the ``[model]`` extra).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

Progress = Callable[[str], None]

# GGUF names -> HF Llama names (within a layer: ``blk.N.<key>`` -> ``model.layers.N.<value>``)
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped: nothing is read yet)."""
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs the gguf package: "
                          "pip install 'lmc-kvcache[model]'") from None
    return gguf.GGUFReader(str(path))


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field as a Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): the number the original config had."""
    return float(str(np.float32(value)))


def llama_config(meta: dict[str, Any], tensor_names: set[str], dtype: str) -> dict[str, Any]:
    """``config.json`` (``LlamaForCausalLM``) for a GGUF whose architecture is llama."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only llama)")

    def need(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return meta[f"llama.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get("llama.rope.dimension_count", hidden // heads))
    if head_dim * heads != hidden:
        raise ValueError(f"GGUF rope.dimension_count {head_dim} x {heads} heads != {hidden}: "
                         "partial rotary embeddings are not supported")
    vocab = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    eos = int(meta["tokenizer.ggml.eos_token_id"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "num_hidden_layers": int(need("block_count")),
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "torch_dtype": HF_DTYPE_NAMES[dtype],
    }


def unpermute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo GGUF's q/k row order: within each head, rows ``0, 2, 4, ..., 1, 3, 5, ...`` of
    HF's layout were stored as pairs; put the even rows first, then the odd ones."""
    out, inp = weight.shape
    head_dim = out // n_head
    return (weight.reshape(n_head, head_dim // 2, 2, inp).transpose(1, 2)
            .reshape(out, inp).contiguous())


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m is None or m.group(2) not in LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama name")
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"


def dequantize(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as float32 ``[out, in]`` (a copy: F32 tensors come back as read-only
    views of the memory-mapped file)."""
    import gguf

    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))


def hf_tensors(reader: Any, config: dict[str, Any], dtype: str,
               progress: Progress | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every weight, dequantized, rows restored, cast to ``dtype``;
    ``progress`` hears about every tenth of the way."""
    say = progress or (lambda _line: None)
    heads = {"attn_q.weight": config["num_attention_heads"],
             "attn_k.weight": config["num_key_value_heads"]}
    tensors = list(reader.tensors)
    step = max(1, len(tensors) // 10)
    t0 = time.perf_counter()
    for i, tensor in enumerate(tensors, 1):
        weight = dequantize(tensor)
        suffix = tensor.name.split(".", 2)[-1]
        if tensor.name.startswith("blk.") and suffix in heads:
            weight = unpermute_rows(weight, heads[suffix])
        yield hf_name(tensor.name), weight.to(TORCH_DTYPES[dtype]).contiguous()
        if i % step == 0 or i == len(tensors):
            say(f"  dequantized {i}/{len(tensors)} tensors ({100 * i // len(tensors)}%, "
                f"{time.perf_counter() - t0:.1f} s)")
