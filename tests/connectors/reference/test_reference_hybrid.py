"""lmc on a hybrid sliding-window/full model in the reference engine (``layer_types``):
greedy tokens and fp32 logits equal to the engine without lmc, hits reported and served
(every KV group's part loaded, the window only for sliding layers), across a restart from
disk, and a chunk missing one group's part never served halfway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmc.connectors.reference import LMCReferenceConnector
from lmc.hybrid.rules import part_key
from lmc.reference import LLM, make_tiny_checkpoint
from lmc.token_database import key_hex
from lmc.transfer.kv_groups import FULL, SLIDING
from tests.connectors.reference.helpers import BLOCK, assert_same, prompt, run, stat
from tests.deadlines import HANG_S
from tests.late_transfer import (
    copies,  # noqa: F401 - the fixture below
)

pytestmark = pytest.mark.usefixtures("copies")

W = 40  # layers 0 and 2 see the last 40 positions, 1 and 3 everything
CS = 16


@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("swa") / "llama-swa",
                                sliding_window=W)


@pytest.fixture(scope="module")
def baseline(swa_dir: Path) -> LLM:
    return LLM(swa_dir, num_blocks=128, block_size=BLOCK)


def hybrid_llm(model_dir: Path, disk: Path | None = None, budget: int = 2048, **cfg: Any
               ) -> tuple[LLM, LMCReferenceConnector]:
    config = {"chunk_size": CS, "local_cpu_size": "32MiB", "hybrid_checkpoint_interval": 64,
              **cfg}
    if disk is not None:  # always heard, however loaded the host (the deadline: elsewhere)
        config |= {"local_disk": str(disk), "local_disk_size": "256MiB",
                   "lookup_min_wait": HANG_S}
    conn = LMCReferenceConnector(config, model_dir=model_dir)
    llm = LLM(model_dir, kv_connector=conn, num_blocks=128, block_size=BLOCK,
              max_num_batched_tokens=budget)
    return llm, conn


def test_the_groups_are_the_models_layer_kinds(swa_dir: Path) -> None:
    llm, conn = hybrid_llm(swa_dir)
    groups = conn.cache.spec.groups
    assert [(g.kind, g.layers, g.window) for g in groups] == [(FULL, (1, 3), 0),
                                                            (SLIDING, (0, 2), W)]
    llm.close()


def test_same_prompt_again_is_a_hit_with_the_same_output(swa_dir: Path, baseline: LLM) -> None:
    p = prompt(1, 150)
    llm, conn = hybrid_llm(swa_dir)
    want = run(baseline, [p])
    assert_same(run(llm, [p]), want)
    again = run(llm, [p])
    assert again[0].num_cached_tokens == len(p) - 1
    assert_same(again, want)
    assert stat(conn, "worker.loaded_tokens") == len(p) - 1
    llm.close()


def test_shared_prefixes_hit_where_every_group_is_served(swa_dir: Path, baseline: LLM
                                                         ) -> None:
    system = prompt(2, 150)
    prompts = [system + prompt(s, 40)[1:] for s in (3, 4)]
    llm, conn = hybrid_llm(swa_dir)
    got = [run(llm, [p])[0] for p in prompts]
    # the shared whole chunks end at 144; the first request kept the sliding parts its
    # checkpoints (64, 128, 176, 189) need, which cover 144's window and slack too
    assert got[1].num_cached_tokens == 144
    assert_same(got, [run(baseline, [p])[0] for p in prompts])
    llm.close()


def test_prompts_longer_than_the_prefill_budget(swa_dir: Path) -> None:
    """Chunked prefill saves each chunk's parts in the step that completes it; the sliding
    parts kept are the ones around the prompt's checkpoints."""
    long = prompt(11, 300)
    base = LLM(swa_dir, num_blocks=128, block_size=BLOCK, max_num_batched_tokens=48)
    llm, conn = hybrid_llm(swa_dir, budget=48)
    want = run(base, [long])
    assert_same(run(llm, [long]), want)
    again = run(llm, [long])
    assert again[0].num_cached_tokens == len(long) - 1
    assert_same(again, want)
    llm.close()


def test_restart_from_disk_and_a_missing_part(swa_dir: Path, baseline: LLM,
                                              tmp_path: Path) -> None:
    """A new engine over the disk tier serves the hit whole; with the sliding part of one
    chunk of the prompt's last window removed from disk, the hit drops to an end every
    group can serve, and the output is still the engine's own."""
    p = prompt(20, 150)
    want = run(baseline, [p])
    llm, conn = hybrid_llm(swa_dir, disk=tmp_path / "disk")
    assert_same(run(llm, [p]), want)
    keys = conn.cache.db.keys(p)
    assert conn.cache.flush(30)
    llm.close()
    llm, conn = hybrid_llm(swa_dir, disk=tmp_path / "disk")
    again = run(llm, [p])
    assert again[0].num_cached_tokens == len(p) - 1
    assert stat(conn, "worker.loaded_tokens") == len(p) - 1
    assert_same(again, want)
    llm.close()
    victim = key_hex(part_key(keys[8], 1))  # the sliding part of chunk [128, 144)
    (f,) = [f for f in (tmp_path / "disk").rglob("*.kv") if f.name.startswith(victim)]
    f.unlink()
    llm, conn = hybrid_llm(swa_dir, disk=tmp_path / "disk")
    short = run(llm, [p])
    assert short[0].num_cached_tokens == 128  # 144 and 150 need chunk 8's window
    assert_same(short, want)
    llm.close()


def test_hybrid_stores_fewer_bytes_than_every_layer_for_every_token(swa_dir: Path) -> None:
    """With checkpoints far apart, the sliding layers' parts are kept for the windows before
    the prompt's end only: the pool holds the full layers' bytes for every token and the
    sliding layers' for a few chunks."""
    p = prompt(30, 600)
    llm, conn = hybrid_llm(swa_dir, hybrid_checkpoint_interval=1024)
    run(llm, [p], max_tokens=1)
    used = conn.cache.pool.used_bytes
    per_layer_token = 2 * 2 * 64 * 4  # K and V, 2 heads of 64, fp32
    every = 4 * per_layer_token * 600
    assert 2 * per_layer_token * 600 <= used < 0.6 * every
    llm.close()
