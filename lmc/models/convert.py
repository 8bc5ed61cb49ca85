"""A verified GGUF file -> the files of a Hugging Face Llama checkpoint, in one folder.

Writes ``config.json`` (``LlamaForCausalLM``), ``generation_config.json``,
``model.safetensors`` (in the dtype asked; with tied embeddings there is no ``lm_head``),
``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template), the source's
``LICENSE`` when its distribution ships one, and last the manifest ``lmc-model.json``.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmc.models.gguf_tokenizer import build_tokenizer, tokenizer_config
from lmc.models.gguf_weights import hf_tensors, llama_config, open_gguf, read_metadata
from lmc.models.registry import CONVERTER_VERSION, KnownModel
from lmc.models.store import MANIFEST, file_record, fix_modes

Progress = Callable[[str], None]


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _license_text(model: KnownModel) -> str | None:
    try:
        return importlib.metadata.distribution(model.source.distribution).read_text("LICENSE")
    except importlib.metadata.PackageNotFoundError:
        return None


def convert_gguf(gguf_path: Path, digest: str, model: KnownModel, dtype: str, out: Path,
                 progress: Progress | None = None) -> None:
    """Convert ``gguf_path`` (already verified: ``digest``) into the empty folder ``out``."""
    from safetensors.torch import save_file

    say = progress or (lambda _line: None)
    t0 = time.perf_counter()
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    config = llama_config(meta, {t.name for t in reader.tensors}, dtype)
    say(f"read metadata in {time.perf_counter() - t0:.1f} s: {config['num_hidden_layers']} "
        f"layers, hidden {config['hidden_size']}, {len(reader.tensors)} tensors")
    tokenizer = build_tokenizer(meta)
    weights = dict(hf_tensors(reader, config, dtype, say))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    say(f"writing model.safetensors ({nbytes / 1e6:.0f} MB, {dtype}) ...")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    del weights
    say(f"wrote model.safetensors in {time.perf_counter() - t0:.1f} s; tokenizer and config ...")
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"]})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta))
    license_text = _license_text(model)
    if license_text:
        (out / "LICENSE").write_text(license_text, encoding="utf-8")
    fix_modes(out)
    files = {p.name: file_record(p) for p in sorted(out.iterdir()) if p.is_file()}
    _write_json(out / MANIFEST, {
        "name": model.name,
        "title": model.title,
        "dtype": dtype,
        "license": model.license,
        "converter_version": CONVERTER_VERSION,
        "source": {"requirement": model.source.requirement, "path": model.source.path,
                   "sha256": digest, "size": model.source.size},
        "files": files,
        "converted_s": round(time.perf_counter() - t0, 1),
    })
