"""Another checkpoint's KV is never served (issue 33, section 1), end to end.

Two reference engines share one disk tier, one after the other, as two deployments share a
store: the first runs the original checkpoint, the second a copy whose ``model.safetensors``
differs in 256 KiB at 30% of its length (weights scaled there: a fine-tune that touched a
few tensors). The changed model must load none of the original's chunks, and its output must
equal its own full prefill. With the old sampled fingerprint both had one identity: the
changed model loaded the original's chunks and its logits differed from its own prefill.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lmc.reference import LLM, make_tiny_checkpoint
from tests.connectors.reference.helpers import ATOL, RTOL, prompt, run, stat
from tests.deadlines import HANG_S

P = prompt(3, 150)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def fine_tuned_copy(src: Path, where: Path) -> Path:
    """``src`` copied under the same folder name, 256 KiB of float32 weights at 30% of
    ``model.safetensors`` scaled by 1.5 (still valid weights, aligned to 4 bytes)."""
    dst = where / src.name
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    at = int(path.stat().st_size * 0.30) // 4 * 4
    with open(path, "r+b") as f:
        f.seek(at)
        region = np.frombuffer(f.read(256 << 10), dtype=np.float32) * np.float32(1.5)
        f.seek(at)
        f.write(region.tobytes())
    return dst


def lmc_engine(model: Path, disk: Path) -> LLM:
    # a hit is loaded whole and the disk always heard: which chunks an identity finds is
    # the subject, not whether a loaded host reads them faster than a tiny model computes
    # (the load watch) or answers the lookup within 20 ms (its deadline)
    cfg = {"chunk_size": 32, "local_cpu_size": "32MiB", "local_disk": str(disk),
           "local_disk_size": "64MiB", "load_policy": "load_all", "lookup_min_wait": HANG_S}
    return LLM(model, lmc_config=cfg, num_blocks=128, block_size=16)


def test_a_changed_checkpoint_loads_none_of_the_originals_kv(tmp_path):
    original = make_tiny_checkpoint(tmp_path / "a" / "m")
    changed = fine_tuned_copy(original, tmp_path / "b")
    disk = tmp_path / "shared-disk"

    own = run(LLM(changed, num_blocks=128, block_size=16), [P])
    theirs = run(LLM(original, num_blocks=128, block_size=16), [P])
    assert not torch.allclose(own[0].logits, theirs[0].logits, atol=1e-3), \
        "the change does not reach this prompt: the test would prove nothing"

    first = lmc_engine(original, disk)
    run(first, [P])
    assert stat(first.kv_connector, "worker.saved_tokens") == len(P)
    first.close()

    second = lmc_engine(changed, disk)
    try:
        got = run(second, [P])
        assert got[0].num_cached_tokens == 0
        assert stat(second.kv_connector, "worker.loaded_tokens") == 0
        assert second.kv_connector.model_id != first.kv_connector.model_id
        assert got[0].token_ids == own[0].token_ids
        torch.testing.assert_close(got[0].logits, own[0].logits, atol=ATOL, rtol=RTOL)
    finally:
        second.close()

    again = lmc_engine(original, disk)  # the original still finds its own chunks
    try:
        hit = run(again, [P])
        assert hit[0].num_cached_tokens == len(P) - 1
        torch.testing.assert_close(hit[0].logits, theirs[0].logits, atol=ATOL, rtol=RTOL)
    finally:
        again.close()
