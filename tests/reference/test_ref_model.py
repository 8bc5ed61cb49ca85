"""The paged-KV model against a dense, no-paging forward written in the test."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lmc.reference import make_tiny_checkpoint
from lmc.reference.attention import SequenceChunk, build_attention_metadata
from lmc.reference.kv_cache import allocate_kv_caches
from lmc.reference.loader import load_model
from tests.reference.prompts import random_prompt
from tests.reference.ref_dense import dense_logits

BLOCK = 16


def paged_logits(model_dir: Path, prompts: list[list[int]], chunk_plan: list[list[int]], dtype=torch.float32):
    """Run ``prompts`` through the paged model in several steps. ``chunk_plan[s][i]`` is
    how many tokens of sequence ``i`` step ``s`` computes (0 = not scheduled). Blocks
    are handed out in a shuffled order so slots are far from contiguous. Returns each
    sequence's logits for every position, assembled across steps."""
    model = load_model(model_dir, dtype)
    num_blocks = 64
    caches = allocate_kv_caches(model.config, num_blocks, BLOCK, dtype, "cpu")
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-len(p) // BLOCK))] for p in prompts]
    done = [0] * len(prompts)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in chunk_plan:
        chunks, ids, pos, owners = [], [], [], []
        for i, n in enumerate(step):
            if n == 0:
                continue
            start = done[i]
            chunks.append(SequenceChunk(start, n, tables[i]))
            ids += prompts[i][start : start + n]
            pos += list(range(start, start + n))
            owners += [i] * n
            done[i] += n
        meta = build_attention_metadata(chunks, BLOCK, "cpu", model.config.sliding_windows)
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(pos), caches, meta)
            logits = model.compute_logits(hidden)
        for row, owner in enumerate(owners):
            rows[owner].append(logits[row])
    assert done == [len(p) for p in prompts]
    return [torch.stack(r) for r in rows]


def test_one_shot_prefill_matches_dense(tiny_dir: Path) -> None:
    prompt = random_prompt(1, 45)
    (got,) = paged_logits(tiny_dir, [prompt], [[45]])
    torch.testing.assert_close(got, dense_logits(tiny_dir, prompt), rtol=1e-4, atol=1e-4)


def test_mixed_batch_chunks_and_decodes_match_dense(tiny_dir: Path) -> None:
    # seq 0: chunked prefill 20 + 17, then 3 decodes; seq 1: 5-token prefill, decodes;
    # seq 2 joins late with a one-token prompt. Every step mixes chunk sizes.
    prompts = [random_prompt(2, 40), random_prompt(3, 9), random_prompt(4, 4)]
    plan = [[20, 5, 0], [17, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    got = paged_logits(tiny_dir, prompts, plan)
    for p, g in zip(prompts, got, strict=True):
        torch.testing.assert_close(g, dense_logits(tiny_dir, p), rtol=1e-4, atol=1e-4)


def test_sliding_window_layers_match_dense(tmp_path: Path) -> None:
    """A hybrid sliding-window/full model (``layer_types``): chunked prefills after cached
    context, decodes past the window and one-shot prefills all match a dense forward whose
    sliding layers mask keys W or more positions back -- and differ from all-full."""
    model_dir = make_tiny_checkpoint(tmp_path / "swa", sliding_window=24)
    prompts = [random_prompt(5, 71), random_prompt(6, 33), random_prompt(7, 22)]
    plan = [[40, 30, 0], [25, 1, 20], [5, 1, 1], [1, 1, 1]]
    got = paged_logits(model_dir, prompts, plan)
    for p, g in zip(prompts, got, strict=True):
        torch.testing.assert_close(g, dense_logits(model_dir, p), rtol=1e-4, atol=1e-4)
    full = dense_logits(model_dir, prompts[0], windows=False)
    assert not torch.allclose(got[0][-1], full[-1], rtol=1e-3, atol=1e-3)


def test_qwen2_bias_and_tied_embeddings_match_dense(qwen_dir: Path) -> None:
    prompt = random_prompt(5, 30)
    got = paged_logits(qwen_dir, [prompt], [[12], [17], [1]])[0]
    torch.testing.assert_close(got, dense_logits(qwen_dir, prompt), rtol=1e-4, atol=1e-4)


def test_llama3_rope_scaling_matches_dense(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    }
    model_dir = make_tiny_checkpoint(tmp_path, layers=2, rope_theta=500000.0, rope_scaling=scaling)
    prompt = random_prompt(6, 70)
    got = paged_logits(model_dir, [prompt], [[33], [36], [1]])[0]
    torch.testing.assert_close(got, dense_logits(model_dir, prompt), rtol=1e-4, atol=1e-4)
    # and the scaling really changes the result
    plain = make_tiny_checkpoint(tmp_path / "plain", layers=2, rope_theta=500000.0)
    assert not torch.allclose(got, dense_logits(plain, prompt), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(tiny_dir: Path, dtype: torch.dtype) -> None:
    prompt = random_prompt(7, 24)
    got = paged_logits(tiny_dir, [prompt], [[16], [8]], dtype=dtype)[0]
    ref = dense_logits(tiny_dir, prompt)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() < 0.5  # ~4-std logits; loose, just "same model"
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_metadata_rejects_missing_blocks() -> None:
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build_attention_metadata([SequenceChunk(10, 10, [3])], BLOCK, "cpu")


def test_rotary_embedding_keeps_module_apply():
    """``nn.Module.apply(fn)`` (how weights are initialised over a model tree) must reach the
    rotary module too: a static ``apply(x, cos, sin)`` there once shadowed it (mypy found it),
    so ``model.apply(init)`` raised a TypeError at that module."""
    from lmc.reference.model_config import RopeConfig
    from lmc.reference.rope import RotaryEmbedding

    rope = RotaryEmbedding(8, RopeConfig())
    seen: list[str] = []
    assert rope.apply(lambda m: seen.append(type(m).__name__)) is rope
    assert seen == ["RotaryEmbedding"]
    cos, sin = rope.cos_sin(torch.arange(3), torch.float32)
    x = torch.randn(3, 2, 8)
    assert torch.equal(RotaryEmbedding.rotate(x, torch.ones_like(cos), torch.zeros_like(sin)), x)
    assert not torch.equal(RotaryEmbedding.rotate(x, cos, sin), x)  # position 1, 2 turn
