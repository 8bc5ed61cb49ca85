"""Selective recompute on the random-weight models: ratio 1 is full prefill, ratio 0 is naive
concatenation, and the deviation from full prefill falls as the ratio rises."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from lmc.blend.quality import compare, run_prompt
from lmc.reference import LLM
from lmc.reference.request import SamplingParams
from tests.blend.helpers import blend_llm, naive_concatenation_logits, rag_prompt, tokens

DOCS = [tokens(10 + i, 37 + 5 * i) for i in range(4)]
SYSTEM = tokens(1, 21)


def test_ratio_one_equals_full_prefill(model_dir: Path) -> None:
    ids, spans = rag_prompt([DOCS[2], DOCS[0], DOCS[1]], tokens(2, 9), SYSTEM)
    full = run_prompt(LLM(model_dir, num_blocks=96), ids, None, 6)
    with blend_llm(model_dir, 1.0) as llm:
        warm_ids, warm_spans = rag_prompt([DOCS[0], DOCS[1], DOCS[2]], tokens(3, 7))
        run_prompt(llm, warm_ids, warm_spans, 2)  # the segments are stored, alone
        blended = run_prompt(llm, ids, spans, 6)
        stats = llm.kv_connector.blender.stats
        assert stats.segments_hit == 3 and stats.tokens_reused == sum(e - s for s, e in spans)
    torch.testing.assert_close(blended.logits, full.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(blended.kv, full.kv, rtol=1e-4, atol=1e-4)
    assert blended.tokens == full.tokens


def test_ratio_zero_equals_naive_concatenation(model_dir: Path) -> None:
    ids, spans = rag_prompt([DOCS[1], DOCS[3]], tokens(4, 11), SYSTEM)
    with blend_llm(model_dir, 0.0) as llm:
        blended = run_prompt(llm, ids, spans, 2)
        assert llm.kv_connector.blender.stats.tokens_recomputed == 0
    naive = naive_concatenation_logits(model_dir, ids, spans)
    torch.testing.assert_close(blended.logits, naive, rtol=1e-4, atol=1e-4)
    full = run_prompt(LLM(model_dir, num_blocks=96), ids, None, 2)
    assert not torch.allclose(naive, full.logits, atol=1e-2)  # blending has something to fix


def test_deviation_falls_as_the_ratio_rises(model_dir: Path) -> None:
    prompts = [rag_prompt([DOCS[a], DOCS[b], DOCS[c]], tokens(20 + a, 8), SYSTEM)
               for a, b, c in ((0, 1, 2), (3, 1, 0), (2, 3, 1))]
    base = LLM(model_dir, num_blocks=96)
    fulls = [run_prompt(base, ids, None, 4) for ids, _ in prompts]
    kv_dev, kls = [], []
    for ratio in (0.0, 0.15, 0.5, 1.0):
        with blend_llm(model_dir, ratio) as llm:
            cmp = [compare(f, run_prompt(llm, ids, spans, 4))
                   for f, (ids, spans) in zip(fulls, prompts, strict=True)]
        kv_dev.append(sum(sum(c.kv_deviation) for c in cmp))
        kls.append(sum(c.kl for c in cmp))
    assert all(a > b for a, b in zip(kv_dev, kv_dev[1:])), kv_dev
    assert all(a >= b - 1e-6 for a, b in zip(kls, kls[1:])), kls
    assert kv_dev[-1] < 1e-4 and kls[-1] < 1e-6 and kls[0] > 1e-3


def test_prefix_segment_and_new_tokens_in_one_forward(llama_dir: Path) -> None:
    """A prefix hit (the system prompt, saved by an earlier blended request), a cached
    segment, a never-seen segment and a question, prefilled in one step."""
    first, first_spans = rag_prompt([DOCS[0], DOCS[1]], tokens(5, 6), SYSTEM)
    ids, spans = rag_prompt([DOCS[1], DOCS[3]], tokens(6, 10), SYSTEM)
    full = run_prompt(LLM(llama_dir, num_blocks=96), ids, None, 4)
    with blend_llm(llama_dir, 1.0) as llm:
        run_prompt(llm, first, first_spans, 2)
        before = llm.kv_connector.blender.stats.as_dict()
        rid = llm.add_request(ids, segments=spans)
        out = next(iter(llm.step()), None)
        request = llm.scheduler.requests.get(rid)
        cached = out.num_cached_tokens if out is not None else request.num_cached_tokens
        stats = llm.kv_connector.blender.stats
        assert cached == len(SYSTEM) // 16 * 16 > 0  # the prefix chunk is loaded
        assert stats.segments_hit - before["segments_hit"] == 1  # DOCS[1]
        assert stats.segments_computed - before["segments_computed"] == 1  # DOCS[3]
        llm.abort_request(rid)
        blended = run_prompt(llm, ids, spans, 4)
    torch.testing.assert_close(blended.logits, full.logits, rtol=1e-4, atol=1e-4)


def test_text_prompts_split_at_the_separator(llama_dir: Path) -> None:
    text = "The system says hello. # # the cache keeps a block # # a river near the road # # why?"
    with blend_llm(llama_dir, 1.0) as llm:
        ids, spans = llm.encode_segments(text, separator=" # # ")
        assert len(spans) == 3 and ids[spans[1][0]:spans[1][1]] == llm.tokenizer.encode(
            "the cache keeps a block", False)
        blended = llm.generate(text, max_tokens=4, segment_separator=" # # ", ignore_eos=True)
        assert llm.kv_connector.blender.stats.requests == 1
    plain = LLM(llama_dir, num_blocks=96).generate(ids, max_tokens=4, ignore_eos=True)
    assert blended[0].token_ids == plain[0].token_ids


def test_bad_segments_are_refused_by_name(llama_dir: Path) -> None:
    llm = LLM(llama_dir, num_blocks=32)
    with pytest.raises(ValueError, match=r"segment 0 \(5, 99\)"):
        llm.generate([1, 2, 3, 4, 5, 6], segments=[(5, 99)])
    with pytest.raises(ValueError, match="text prompts"):
        llm.generate([1, 2, 3], segment_separator=" # # ")
    with pytest.raises(ValueError, match="blend needs lmc_config"):
        LLM(llama_dir, num_blocks=32, blend=True)


def test_a_failing_segment_store_is_a_miss_not_a_failure(llama_dir: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """lmc's engine behind the segments is closed: every load and store raises. Segments are
    computed alone and blended; the request completes as a full prefill would (ratio 1)."""
    from lmc.blend.blender import SegmentBlender
    from lmc.blend.store import SegmentStore
    from lmc.cache_engine import CacheEngine
    from lmc.config import CacheConfig
    from lmc.transfer.kv_spec import KVSpec

    ids, spans = rag_prompt([DOCS[0], DOCS[2]], tokens(7, 8), SYSTEM)
    full = run_prompt(LLM(llama_dir, num_blocks=96), ids, None, 3)
    llm = LLM(llama_dir, num_blocks=96)
    spec = KVSpec.from_tensors(llm.runner.named_kv_caches(), "vllm_flash")
    engine = CacheEngine(CacheConfig.load(overrides={"chunk_size": 16,
                                                     "local_cpu_size": "8MiB"}), spec, "m")
    store = SegmentStore(engine)
    engine.close()
    llm.runner.blender = SegmentBlender(store, llm.config, 1.0)
    with caplog.at_level(logging.WARNING, logger="lmc.blend.blender"):
        blended = run_prompt(llm, ids, spans, 3)
    assert "loading a 37-token segment failed" in caplog.text
    assert "storing a 37-token segment failed" in caplog.text
    assert llm.runner.blender.stats.segments_computed == 2
    torch.testing.assert_close(blended.logits, full.logits, rtol=1e-4, atol=1e-4)
    assert blended.tokens == full.tokens


@pytest.mark.parametrize("ratio", [1.0, 0.15])
def test_blended_prefills_share_a_step_with_decodes_and_each_other(qwen_dir: Path,
                                                                   ratio: float) -> None:
    """Two blended prefills and a plain request's decode in one step: every output equals
    the same request run alone, so the step's row subsets and masks are per request."""
    plain_ids = tokens(30, 40)
    a, a_spans = rag_prompt([DOCS[0], DOCS[1]], tokens(31, 6), SYSTEM)
    b, b_spans = rag_prompt([DOCS[3], DOCS[0]], tokens(32, 9))
    want = {"plain": LLM(qwen_dir, num_blocks=96).generate(plain_ids, max_tokens=5,
                                                           ignore_eos=True)[0].token_ids}
    for name, ids, spans in (("a", a, a_spans), ("b", b, b_spans)):
        with blend_llm(qwen_dir, ratio) as alone:
            want[name] = alone.generate(ids, max_tokens=5, ignore_eos=True,
                                        segments=spans)[0].token_ids
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with blend_llm(qwen_dir, ratio, max_num_batched_tokens=1024) as llm:
        ids = {"plain": llm.add_request(plain_ids, params)}
        llm.step()  # the plain request is decoding from now on
        ids["a"] = llm.add_request(a, params, segments=a_spans)
        ids["b"] = llm.add_request(b, params, segments=b_spans)
        got: dict[str, list[int]] = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                got[out.request_id] = out.token_ids
        step = llm.kv_connector.blender.last_step
        assert step is not None and len(step.requests) == 2 and step.meta_before.decode_rows \
            is not None
    assert {name: got[rid] for name, rid in ids.items()} == want


def test_a_busy_batch_cannot_starve_a_blended_prefill(llama_dir: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Ten decoding requests leave 90 of a 100-token budget: a 95-token blended prefill never
    fits whole, waits a few steps, then runs as a plain chunked prompt; a prompt longer than
    the budget runs plainly at once."""
    ids, spans = rag_prompt([DOCS[0], DOCS[1][:40]], tokens(8, 18))
    assert len(ids) == 95
    with blend_llm(llama_dir, 0.15, max_num_batched_tokens=100) as llm:
        busy = [llm.add_request(tokens(40 + i, 5), SamplingParams(max_tokens=60,
                                                                   ignore_eos=True))
                for i in range(10)]
        llm.step()
        with caplog.at_level(logging.INFO, logger="lmc.reference.scheduler"):
            out = llm.generate(ids, max_tokens=2, ignore_eos=True, segments=spans)[0]
            assert "did not fit 8 steps' budgets" in caplog.text
            long_ids, long_spans = rag_prompt([DOCS[2], DOCS[3], DOCS[1]], tokens(9, 4))
            llm.generate(long_ids, max_tokens=1, segments=long_spans)
            assert "exceed max_num_batched_tokens 100" in caplog.text
        assert llm.kv_connector.blender.stats.requests == 0
        for rid in busy:
            llm.abort_request(rid)
    assert len(out.token_ids) == 2
