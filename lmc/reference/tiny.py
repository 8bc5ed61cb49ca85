"""A tiny, deterministic, offline Hugging Face-style checkpoint for demos and tests.

``make_tiny_checkpoint`` writes ``config.json``, ``generation_config.json``, weights
(``model.safetensors``, or shards plus ``model.safetensors.index.json``) and a byte-level
BPE ``tokenizer.json`` trained on the spot with ``tokenizers`` on sentences generated
from a fixed word list. Nothing is downloaded, and the same arguments always give
byte-identical files.

Weights are random but scaled so the forward is well conditioned: projections have unit
gain (std ``1/sqrt(fan_in)``), residual writes are damped by ``1/sqrt(2 * layers)``, and
the embeddings/LM head are sized for logits of std ~4, so greedy text wanders over the
vocabulary instead of collapsing onto one token, and sampling is neither flat nor greedy.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lmc.reference.model import CausalLM
from lmc.reference.model_config import ModelConfig
from lmc.user_cache import cache_dir

# Bump when the generator's output changes, so cached default checkpoints are remade.
TINY_FORMAT_VERSION = 1

BOS, EOS = "<s>", "</s>"

_WORD_LINES = (
    "the a an one two three some many every each this that these those my your our their",
    "cache key value token prompt model layer block engine memory disk server request reply",
    "query answer system user agent document chunk prefix hash store load save copy move",
    "river mountain forest ocean city village garden window door table chair book letter",
    "morning evening night winter summer spring autumn rain snow wind storm cloud light",
    "red green blue yellow quiet loud small large old new fast slow bright dark warm cold",
    "cat dog bird horse fish tree flower stone road bridge train ship plane car bicycle",
    "teacher student doctor farmer writer painter singer driver builder sailor keeper",
    "run walk read write sing paint build open close carry find keep send take give make",
    "see hear know think want need like love help watch call ask tell show leave bring",
    "is was are were has had will would can could should may might must does did",
    "and or but so because while when where after before until since if then than",
    "in on at by for with from into over under between through about across behind near",
    "always never often sometimes again already still just only even also very quite",
    "table column number letter word sentence story chapter page line paper record list",
    "first second third last next early late long short high low deep wide narrow full",
)
_WORDS = [w for line in _WORD_LINES for w in line.split()]


def _sentences(seed: int, count: int) -> list[str]:
    """Deterministic pseudo-English: word-list sentences with numbers and punctuation."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.1:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99)))
        if rng.random() < 0.3:
            i = rng.randrange(1, len(words))
            words[i - 1] += ","
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", ".", ".", "?", "!"]))
    return lines


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab: int, seed: int) -> str:
    """Train a byte-level BPE with exactly ``vocab`` ids (cached: training is the slow
    part and its result depends only on these two numbers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_sentences(seed, 4000), trainer)
    # Like Llama 3, fill unused ids with reserved special tokens so every id the model
    # can emit decodes, and the tokenizer's vocabulary equals the model's.
    missing = vocab - tok.get_vocab_size(with_added_tokens=True)
    if missing < 0:
        raise ValueError(f"vocab={vocab} is too small for a byte-level tokenizer")
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok.to_str()


def _init_std(name: str, config: ModelConfig) -> tuple[float, float]:
    """(mean, std) for a parameter, by role."""
    emb_std = 4.0 / math.sqrt(config.hidden_size)
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith("bias"):
        return 0.0, 0.1
    if "embed_tokens" in name or name.startswith("lm_head"):
        return 0.0, emb_std
    fan_in = config.intermediate_size if "down_proj" in name else config.hidden_size
    if "o_proj" in name:
        fan_in = config.num_attention_heads * config.head_dim
    std = 1.0 / math.sqrt(fan_in)
    if "o_proj" in name or "down_proj" in name:
        std /= math.sqrt(2 * config.num_hidden_layers)
    return 0.0, std


def _junk_token_ids(tokenizer_json: str) -> list[int]:
    """Ids that decode to no readable text: reserved specials and lone bytes that are
    not printable ASCII (halves of UTF-8 sequences, control bytes)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    junk = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=True)
        if not text or "\ufffd" in text or not text.isprintable():
            junk.append(i)
    return junk


def _random_weights(
    config: ModelConfig, seed: int, dtype: torch.dtype, junk_ids: list[int]
) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        mean, std = _init_std(name, config)
        t = torch.randn(shapes[name], generator=gen, dtype=torch.float32) * std + mean
        weights[name] = t
    # Make the output head unlikely to pick tokens that decode to nothing readable, so
    # generated text reads as words and numbers (random weights would pick them often).
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    weights[head][junk_ids] *= 0.25
    return {name: t.to(dtype).contiguous() for name, t in weights.items()}


def tiny_config_dict(
    *,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 2048,
    intermediate: int | None = None,
    model_type: str = "llama",
    tie_word_embeddings: bool | None = None,
    attention_bias: bool | None = None,
    rope_theta: float | None = None,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
    sliding_window: int | None = None,
    full_every: int = 2,
) -> dict[str, Any]:
    """The ``config.json`` contents ``make_tiny_checkpoint`` writes. ``sliding_window``: a
    hybrid model whose every ``full_every``-th layer (the last of each run) attends to all
    positions and the others to the last ``sliding_window`` (``layer_types``; 6 is Gemma 3's
    5:1 pattern)."""
    qwen = model_type == "qwen2"
    cfg: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate or 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6 if qwen else 1e-5,
        "rope_theta": rope_theta or (1000000.0 if qwen else 10000.0),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": qwen if tie_word_embeddings is None else tie_word_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": dtype,
    }
    if qwen:
        cfg["use_sliding_window"] = False
    if attention_bias is not None or not qwen:
        cfg["attention_bias"] = bool(attention_bias)
    if sliding_window is not None:
        cfg["layer_types"] = ["full_attention" if (i + 1) % full_every == 0 else
                              "sliding_attention" for i in range(layers)]
        cfg["sliding_window"] = sliding_window
    return cfg


def make_tiny_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 2048,
    intermediate: int | None = None,
    model_type: str = "llama",
    tie_word_embeddings: bool | None = None,
    attention_bias: bool | None = None,
    rope_theta: float | None = None,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
    shards: int = 1,
    progress: Callable[[str], None] | None = None,
    sliding_window: int | None = None,
    full_every: int = 2,
) -> Path:
    """Write a random-weight checkpoint to ``path`` (created if needed); returns it.

    ``model_type="qwen2"`` gives a Qwen2-style model: q/k/v biases and tied embeddings
    by default. ``sliding_window``: a hybrid sliding-window/full model (every
    ``full_every``-th layer full attention, the others attending to that many last
    positions). ``shards > 1`` splits the weights into that many files plus an index.
    ``progress`` is called with one line per step (tokenizer, weights, files) and how long
    it took: a large checkpoint takes minutes, and a silent wait looks like a hang.
    """
    say = progress or (lambda _line: None)
    t0 = time.perf_counter()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config_dict(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab,
        intermediate=intermediate, model_type=model_type,
        tie_word_embeddings=tie_word_embeddings, attention_bias=attention_bias,
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings, dtype=dtype,
        sliding_window=sliding_window, full_every=full_every,
    )
    config = ModelConfig.from_dict(cfg)
    from lmc.reference.loader import resolve_dtype

    say(f"training a {vocab}-id byte-level BPE tokenizer ...")
    tokenizer_json = _tokenizer_json(vocab, seed)
    t1 = time.perf_counter()
    say(f"tokenizer ready in {t1 - t0:.1f} s; drawing random weights ({layers} layers, "
        f"hidden {hidden}) ...")
    weights = _random_weights(config, seed, resolve_dtype(dtype), _junk_token_ids(tokenizer_json))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    t2 = time.perf_counter()
    say(f"{len(weights)} weight tensors, {nbytes / 2**20:.1f} MiB, in {t2 - t1:.1f} s; "
        f"writing {'1 file' if shards <= 1 else f'{shards} shards'} ...")
    _write_json(path / "config.json", cfg)
    _write_json(path / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1})
    (path / "tokenizer.json").write_text(tokenizer_json)
    _write_weights(path, weights, shards)
    say(f"checkpoint written to {path} in {time.perf_counter() - t0:.1f} s")
    return path


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_weights(path: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    if shards <= 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(weights)
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        shard_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[i * per_shard : (i + 1) * per_shard]}
        save_file(part, str(path / shard_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard_name))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(
        path / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/lmc``, else ``~/.cache/lmc``."""
    return cache_dir()


def cached_checkpoint(name: str, progress: Callable[[str], None] | None = None,
                      **params: Any) -> Path:
    """``make_tiny_checkpoint(**params)`` made once as ``cache_root() / name`` and reused.

    Built in a temporary sibling directory and renamed into place, so a concurrent
    caller never sees a half-written checkpoint. ``name`` must change with ``params``.
    ``progress`` hears the steps only when the checkpoint is made.
    """
    target = cache_root() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        make_tiny_checkpoint(tmp, progress=progress, **params)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise  # not a lost race: a real failure
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    """The default tiny Llama checkpoint, made once under ``cache_root()`` and reused."""
    return cached_checkpoint(f"tiny-llama-v{TINY_FORMAT_VERSION}")
