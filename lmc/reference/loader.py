"""Load a local Hugging Face checkpoint directory into a ``CausalLM``. Never touches the
network: the directory must hold ``config.json`` and ``*.safetensors`` (one file, or
shards listed in ``model.safetensors.index.json``).

The model is built on the meta device and the checkpoint tensors are assigned in place
(cast to the target dtype and device one at a time), so loading costs one copy of the
weights, not two.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from lmc.reference.model import CausalLM
from lmc.reference.model_config import ModelConfig
from lmc.strict_json import load_json_file

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # a shard index names each tensor once: megabytes at most

# Keys some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig | None = None) -> torch.dtype:
    """Accept ``torch.float32`` or "float32"/"fp32"/"bfloat16"/"bf16"/"float16"/"fp16";
    "auto" takes the checkpoint's ``torch_dtype`` (fp32 if absent)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        dtype = (config.torch_dtype if config else None) or "float32"
    names = {
        "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
        "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(names)} or 'auto'")
    return names[dtype]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files: the shards named by the index, else every
    ``*.safetensors`` in the directory (sorted, so load order is stable)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        doc = load_json_file(index, MAX_INDEX_BYTES)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: missing or empty 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, cpu_tensor)`` for every tensor in the checkpoint, file by file."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> CausalLM:
    """Build the model described by ``model_dir/config.json`` and load its weights.

    Raises ``ValueError`` naming the tensor on a missing weight or a shape mismatch.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_file(model_dir / "config.json")
    torch_dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    with torch.device("meta"):
        model = CausalLM(config)

    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)  # shared with the embeddings
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in iter_checkpoint_tensors(model_dir):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name not in expected:
            if not (config.tie_word_embeddings and name == "lm_head.weight"):
                logger.warning("ignoring unexpected checkpoint tensor %s", name)
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(expected[name].shape)}"
            )
        loaded[name] = tensor.to(device=device, dtype=torch_dtype)

    missing = sorted(set(expected) - set(loaded))
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {model_dir} is missing weight(s): {shown}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval().requires_grad_(False)
    return model
