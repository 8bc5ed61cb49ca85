"""Checkpoint loading: shards, Qwen2 bias/tied embeddings, config validation, and the
tiny checkpoint maker's determinism."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lmc.reference import LLM, default_model_dir, make_tiny_checkpoint
from lmc.reference.loader import load_model, safetensors_files
from lmc.reference.model_config import ModelConfig
from lmc.reference.tokenizer import Tokenizer, load_eos_token_ids

SMALL = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512}


def test_sharded_round_trip(tmp_path: Path) -> None:
    single = make_tiny_checkpoint(tmp_path / "single", **SMALL)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", shards=3, **SMALL)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) == 3
    a, b = load_model(single).state_dict(), load_model(sharded).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_index_naming_absent_shard_is_an_error(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, shards=2, **SMALL)
    next(model_dir.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_model(model_dir)


def test_qwen2_has_biases_and_tied_head(qwen_dir: Path) -> None:
    with safe_open(str(qwen_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names
    assert "model.layers.0.self_attn.q_proj.bias" in names
    model = load_model(qwen_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None
    assert attn.o_proj.bias is None
    assert not any(p.is_meta for p in model.parameters())


def test_llama_untied_head(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.q_proj.bias is None


def _edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"hidden_size": None, "vocab_size": None}, "hidden_size, vocab_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"intermediate_size": "big"}, "'intermediate_size'"),
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, changes: dict, message: str) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, **SMALL)
    _edit_config(model_dir, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(model_dir)


def test_missing_weight_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_checkpoint(tmp_path, **SMALL)
    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model_dir)


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, **SMALL)
    _edit_config(model_dir, intermediate_size=96)
    with pytest.raises(ValueError, match=r"down_proj\.weight has shape \(64, 128\), the config implies \(64, 96\)"):
        load_model(model_dir)


def test_eos_ids_are_union_of_configs(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, **SMALL)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    config = ModelConfig.from_file(model_dir / "config.json")
    assert load_eos_token_ids(model_dir, config) == {1, 7, 9}


@pytest.mark.parametrize("name", ["config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
def test_a_checkpoint_json_nested_deep_is_named_not_a_recursion_error(tmp_path: Path,
                                                                      name: str) -> None:
    """Every JSON file of a checkpoint is read by lmc.strict_json (issue 33, section 5):
    200 KB of brackets raised RecursionError out of the loader."""
    model_dir = make_tiny_checkpoint(tmp_path, **SMALL)
    (model_dir / name).write_text("[" * 200_000)
    with pytest.raises(ValueError, match=f"{name}:1: JSON nested deeper than 32 levels"):
        LLM(model_dir, num_blocks=4)


def test_tiny_checkpoint_is_byte_identical(tmp_path: Path) -> None:
    a = make_tiny_checkpoint(tmp_path / "a", model_type="qwen2", **SMALL)
    b = make_tiny_checkpoint(tmp_path / "b", model_type="qwen2", **SMALL)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = make_tiny_checkpoint(tmp_path / "c", seed=1, model_type="qwen2", **SMALL)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_tokenizer_round_trip_and_bos(tiny_dir: Path) -> None:
    tok = Tokenizer(tiny_dir / "tokenizer.json")
    assert tok.vocab_size == 2048
    text = "The river keeps 42 letters, quietly!"
    ids = tok.encode(text)
    assert ids[0] == 0  # BOS from the template
    assert tok.decode(ids) == text


def test_default_model_dir_is_made_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = default_model_dir()
    assert first.parent == tmp_path / "lmc"
    mtime = os.stat(first / "model.safetensors").st_mtime_ns
    assert default_model_dir() == first
    assert os.stat(first / "model.safetensors").st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dirs left
    llm = LLM(first, num_blocks=16)
    out = llm.generate(["The cache"], max_tokens=4)[0]
    assert len(out.token_ids) == 4 and out.text
