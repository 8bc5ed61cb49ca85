"""The model identity covers every byte of the weights (issue 33, section 1).

The attack: copy a checkpoint and overwrite 256 KiB of ``model.safetensors`` at 30% of its
length (a fine-tune that touched a few tensors looks like this). The sampled fingerprint
(first, middle and last MiB) gave both the same identity, and the changed model was served
the original's KV. The rule of which identity is used when (an explicit ``model_id``, the
``model_revision`` setting, the bytes) is in ``lmc/connectors/core/model_id.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from lmc.connectors.core import digest_cache, weight_digest
from lmc.connectors.core.model_id import engine_model_id, model_identity
from lmc.reference import make_tiny_checkpoint


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own lmc cache folder (the digests of the weights live there); files
    written a moment ago are cached (``test_digest_cache.py`` tests that window)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(digest_cache, "RACY_NS", 0)


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("orig") / "m")


def copy_of(src: Path, where: Path) -> Path:
    """A copy under the same folder name (the name is part of the identity)."""
    dst = where / src.name
    shutil.copytree(src, dst)
    return dst


def overwrite(path: Path, at: float, nbytes: int, data: bytes | None = None) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(int(size * at))
        f.write(data if data is not None else os.urandom(nbytes))


def test_256_kib_changed_at_30_percent_is_another_model(original, tmp_path):
    same = copy_of(original, tmp_path / "a")
    changed = copy_of(original, tmp_path / "b")
    overwrite(changed / "model.safetensors", 0.30, 256 << 10)
    assert model_identity(same) == model_identity(original)  # where it lies does not count
    assert model_identity(changed) != model_identity(original)


@pytest.mark.parametrize("at", [0.0001, 0.17, 0.5, 0.83, 0.99999])
def test_one_byte_anywhere_is_another_model(original, tmp_path, at):
    changed = copy_of(original, tmp_path / "c")
    path = changed / "model.safetensors"
    offset = int(path.stat().st_size * at)
    byte = path.read_bytes()[offset]
    overwrite(path, at, 1, bytes([byte ^ 0x01]))
    assert model_identity(changed) != model_identity(original)


def test_every_segment_of_a_large_file_counts(tmp_path, monkeypatch):
    """Files longer than a segment are hashed segment by segment (in parallel): a change in
    any segment, and segments swapped, change the digest."""
    monkeypatch.setattr(weight_digest, "SEGMENT", 1 << 16)
    ckpt = tmp_path / "big"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    data = bytearray(os.urandom(5 * (1 << 16) + 123))
    (ckpt / "w.safetensors").write_bytes(data)
    seen = {model_identity(ckpt)}
    for i in range(6):
        mutated = bytearray(data)
        mutated[i * (1 << 16) + 7] ^= 0xFF
        (ckpt / "w.safetensors").write_bytes(mutated)
        seen.add(model_identity(ckpt))
    swapped = data[1 << 16: 2 << 16] + data[: 1 << 16] + data[2 << 16:]
    (ckpt / "w.safetensors").write_bytes(swapped)
    seen.add(model_identity(ckpt))
    assert len(seen) == 8


def test_shards_config_and_names_count(original, tmp_path):
    """Each shard's bytes, config.json, quantization configs and the files' names count."""
    sharded = make_tiny_checkpoint(tmp_path / "s" / "m", shards=3)
    base = model_identity(sharded)
    overwrite(sharded / "model-00002-of-00003.safetensors", 0.5, 64)
    assert model_identity(sharded) != base
    cfg = copy_of(original, tmp_path / "cfg")
    (cfg / "config.json").write_text((cfg / "config.json").read_text().replace(
        '"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    assert model_identity(cfg) != model_identity(original)
    quant = copy_of(original, tmp_path / "q")
    (quant / "quantize_config.json").write_text('{"bits": 4}')
    assert model_identity(quant) != model_identity(original)
    renamed = copy_of(original, tmp_path / "r")
    os.rename(renamed / "model.safetensors", renamed / "model-renamed.safetensors")
    assert model_identity(renamed) != model_identity(original)


def test_a_folder_without_weights_is_refused_unless_a_revision_names_them(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weight files .*model_revision"):
        model_identity(tmp_path)
    assert model_identity(tmp_path, revision="v1") != model_identity(tmp_path, revision="v2")


def test_a_named_revision_replaces_the_bytes_but_not_config_or_sizes(original, tmp_path, caplog):
    """Rule 2: start-up reads no weights; config.json and each file's size still count; the
    operator's risk is a change in place that keeps the revision and the sizes."""
    changed = copy_of(original, tmp_path / "c")
    overwrite(changed / "model.safetensors", 0.30, 256 << 10)
    with caplog.at_level(logging.INFO, "lmc.connectors.core.model_id"):
        rev = model_identity(original, revision="v1")
    assert "revision 'v1' as named by model_revision" in caplog.text
    assert rev != model_identity(original)  # a revision is not the bytes' identity
    assert model_identity(changed, revision="v1") == rev  # the documented risk
    assert model_identity(changed, revision="v2") != rev
    grown = copy_of(original, tmp_path / "g")
    with open(grown / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    assert model_identity(grown, revision="v1") != rev


def test_engine_model_id_follows_the_rule(original, tmp_path, caplog):
    """vLLM's and SGLang's adapters: the operator's model_id as given; a local folder by its
    bytes (the same identity the reference engine derives); a model not on disk by its name
    and revision, with a WARNING unless the revision is pinned."""
    assert engine_model_id(str(original), explicit="named") == "named"
    assert engine_model_id(str(original)) == model_identity(original)
    assert engine_model_id(str(original), revision="r") == model_identity(original, revision="r")
    with caplog.at_level(logging.INFO, "lmc.connectors.core.model_id"):
        caplog.clear()
        assert engine_model_id("no-such-org/no-such-model") == "no-such-org/no-such-model@main"
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert "pin a commit" in caplog.text
        caplog.clear()
        commit = "0123456789abcdef0123456789abcdef01234567"
        assert engine_model_id("no-such-org/x", hub_revision=commit) == f"no-such-org/x@{commit}"
        assert [r.levelname for r in caplog.records] == ["INFO"]


def test_weights_rewritten_while_hashed_are_not_given_an_identity(tmp_path, monkeypatch):
    """A digest of half old, half new bytes names no checkpoint: the change is noticed (here
    made after the first block is hashed, through the progress report) and refused."""
    ckpt = tmp_path / "w"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    path = ckpt / "w.safetensors"
    path.write_bytes(os.urandom(3 * weight_digest.BLOCK))

    class Rewriting(weight_digest.Progress):
        def add(self, n: int) -> None:
            super().add(n)
            if self.done == weight_digest.BLOCK:
                with open(path, "r+b") as f:
                    f.write(b"changed")

    monkeypatch.setattr(weight_digest, "Progress", Rewriting)
    import lmc.connectors.core.model_id as mid

    monkeypatch.setattr(mid, "Progress", Rewriting)
    monkeypatch.setattr(weight_digest, "threads_for", lambda total: 1)
    with pytest.raises(weight_digest.WeightsChanged, match="changed while it was being hashed"):
        model_identity(ckpt)


def test_a_long_digest_reports_progress_and_one_line_at_the_end(tmp_path, monkeypatch, caplog):
    ckpt = tmp_path / "p"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "w.safetensors").write_bytes(os.urandom(32 << 20))
    import lmc.connectors.core.model_id as mid

    monkeypatch.setattr(mid, "Progress", lambda total, say: weight_digest.Progress(total, say,
                                                                                   every=0.0))
    with caplog.at_level(logging.INFO, "lmc.connectors.core.model_id"):
        model_identity(ckpt)
    lines = [r.getMessage() for r in caplog.records]
    assert any("of weights hashed (" in line for line in lines), lines
    assert "hashed 32.0 MiB of weights in" in lines[-1] and "digests cached in" in lines[-1]
    caplog.clear()
    with caplog.at_level(logging.INFO, "lmc.connectors.core.model_id"):
        model_identity(ckpt)
    assert [r.getMessage() for r in caplog.records] == [
        "model identity of p: digests of 1 weight files (32.0 MiB) from the cache, not read"]
