"""Model configuration: the subset of a Hugging Face ``config.json`` the engine needs.

Only Llama-family decoders (Llama 2/3, Qwen2) are supported. Reading the config is
strict on purpose: a missing or malformed field raises ``ValueError`` naming the field
and the file, so a bad checkpoint fails at load time instead of producing garbage.

A hybrid sliding-window/full model names each layer's kind in ``layer_types``
(``"full_attention"`` or ``"sliding_attention"``, as Hugging Face's configs and vLLM's Llama
read it) with the window in ``sliding_window``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmc.strict_json import load_json_file

MAX_CONFIG_BYTES = 16 << 20  # config.json is kilobytes; a larger file is not one

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
FULL, SLIDING = "full_attention", "sliding_attention"  # layer_types' kinds

# Fields without which the model cannot be built. Everything else has a default.
REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. ``kind`` is "default", "linear" or "llama3"."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, with HF defaults filled in."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope: RopeConfig = RopeConfig()
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()  # per layer; empty: every layer full attention
    sliding_window: int | None = None

    def layer_window(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s sliding window in tokens; ``None``: full attention."""
        if self.layer_types and self.layer_types[layer_idx] == SLIDING:
            return self.sliding_window
        return None

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The windows of the sliding-window layers (empty for a plain model)."""
        return tuple(sorted({w for i in range(self.num_hidden_layers)
                             if (w := self.layer_window(i)) is not None}))

    @property
    def num_query_groups(self) -> int:
        """How many query heads share one KV head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Validate a parsed ``config.json``; errors name the offending field."""
        missing = [k for k in REQUIRED_FIELDS if k not in raw]
        if missing:
            raise ValueError(f"{source}: missing required field(s): {', '.join(missing)}")
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type={model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if raw.get("use_sliding_window") and "layer_types" not in raw:
            raise ValueError(f"{source}: use_sliding_window=true without layer_types is not "
                             "supported (name each layer's kind in layer_types)")

        def positive_int(key: str, value: Any) -> int:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
            return value

        hidden = positive_int("hidden_size", raw["hidden_size"])
        heads = positive_int("num_attention_heads", raw["num_attention_heads"])
        kv_heads = positive_int(
            "num_key_value_heads", raw.get("num_key_value_heads") or heads
        )
        if heads % kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}"
                )
            head_dim = hidden // heads
        head_dim = positive_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"{source}: head_dim={head_dim} must be even for rotary embeddings")

        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=positive_int("intermediate_size", raw["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            num_hidden_layers=positive_int("num_hidden_layers", raw["num_hidden_layers"]),
            vocab_size=positive_int("vocab_size", raw["vocab_size"]),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=positive_int(
                "max_position_embeddings", raw.get("max_position_embeddings", 2048)
            ),
            rope=_parse_rope(raw, source),
            # Qwen2 always has q/k/v biases; Llama declares them with attention_bias.
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(raw.get("eos_token_id"), "eos_token_id", source),
            **_layer_kinds(raw, source),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        raw = load_json_file(path, MAX_CONFIG_BYTES)  # InputError (a ValueError) names it
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, source=str(path))


def _layer_kinds(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """``layer_types`` and ``sliding_window``, checked: one known kind per layer, a positive
    window when any layer slides (a window on a model without sliding layers is ignored,
    as Hugging Face's Llama ignores it)."""
    kinds = raw.get("layer_types")
    if kinds is None:
        return {}
    layers = raw["num_hidden_layers"]
    if not isinstance(kinds, list) or len(kinds) != layers or any(
            k not in (FULL, SLIDING) for k in kinds):
        raise ValueError(f"{source}: field 'layer_types' must list {layers} entries, each "
                         f"{FULL!r} or {SLIDING!r}, got {kinds!r:.200}")
    window = raw.get("sliding_window")
    if SLIDING not in kinds:
        return {"layer_types": tuple(kinds)}
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"{source}: layer_types has sliding_attention layers, so field "
                         f"'sliding_window' must be a positive integer, got {window!r}")
    return {"layer_types": tuple(kinds), "sliding_window": window}


def _as_id_tuple(value: Any, key: str, source: str) -> tuple[int, ...]:
    """HF stores token ids as an int, a list of ints, or null."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{source}: field {key!r} must be an int or a list of ints, got {value!r}")
    return tuple(values)


def _parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    theta = float(raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling")
    if not scaling:
        return RopeConfig(theta=theta)
    if not isinstance(scaling, dict):
        raise ValueError(f"{source}: field 'rope_scaling' must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if "factor" not in scaling:
        raise ValueError(f"{source}: rope_scaling of type {kind!r} is missing field 'factor'")
    factor = float(scaling["factor"])
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"{source}: rope_scaling.factor must be positive, got {factor!r}")
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=factor)
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise ValueError(f"{source}: rope_scaling of type 'llama3' is missing field {key!r}")
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=factor,
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"{source}: rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )
