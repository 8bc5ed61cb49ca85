"""A GGUF file's tokenizer as ``tokenizer.json`` (the ``tokenizers`` library) plus the
``tokenizer_config.json`` an HF-format checkpoint carries (special tokens, chat template).

Only GPT-2-style byte-level BPE with the "smollm" pre-tokenizer is built: every digit split
apart, then byte-level with GPT-2's word regex and no prefix space. Another pre-tokenizer
splits text differently, and a tokenizer that tokenizes almost right gives a model subtly
wrong inputs, so it is refused rather than approximated.
"""

from __future__ import annotations

from typing import Any

# gguf's token types (llama.cpp's llama_token_type): what decides how a token is added
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4
SUPPORTED_PRE = ("smollm",)


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` equal to the GGUF's (ids, splitting, decoding)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in SUPPORTED_PRE:
        raise ValueError(f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
                         f"(supported: gpt2 with {', '.join(SUPPORTED_PRE)})")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta["tokenizer.ggml.token_type"])
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise ValueError("GGUF tokenizer has a merge that is not two tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=t == TOKEN_CONTROL, normalized=False)
             for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    if meta.get("tokenizer.ggml.add_bos_token"):
        bos = tokens[int(meta["tokenizer.ggml.bos_token_id"])]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, int(meta["tokenizer.ggml.bos_token_id"]))])
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens by text, the chat template, no BOS added
    unless the GGUF says so. ``eos_token`` is what ends a turn (``<|im_end|>`` for SmolLM2)."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta["tokenizer.ggml.token_type"])

    def token(key: str) -> str | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return None if value is None else tokens[int(value)]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "special": t == TOKEN_CONTROL, "lstrip": False,
                     "rstrip": False, "normalized": False, "single_word": False}
            for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)},
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config
