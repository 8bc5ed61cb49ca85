"""Engine behaviour: determinism, batching, chunked prefill, preemption, abort, stops,
sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmc.reference import LLM, SamplingParams
from lmc.reference.block_manager import BlockManager
from lmc.reference.sampling import top_p_filter
from tests.reference.prompts import random_prompt
from tests.reference.ref_dense import dense_logits

PROMPTS = [random_prompt(10, 37), random_prompt(11, 5), random_prompt(12, 64), random_prompt(13, 20)]


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, num_blocks=128)


def greedy(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, max_tokens=n, ignore_eos=True)]


def test_greedy_is_deterministic_and_outputs_are_filled(llm: LLM) -> None:
    a = llm.generate(["The cache of the engine", PROMPTS[0]], max_tokens=10, ignore_eos=True)
    b = llm.generate(["The cache of the engine", PROMPTS[0]], max_tokens=10, ignore_eos=True)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    text_out, ids_out = a
    assert text_out.prompt == "The cache of the engine" and text_out.prompt_token_ids[0] == 0
    assert ids_out.prompt is None and ids_out.prompt_token_ids == PROMPTS[0]
    assert len(text_out.token_ids) == 10 and text_out.finish_reason == "length"
    assert text_out.text == llm.tokenizer.decode(text_out.token_ids) and text_out.text
    assert len(set(text_out.token_ids)) > 3  # not stuck on one token
    assert text_out.ttft_s is not None and text_out.ttft_s > 0
    assert text_out.num_cached_tokens == 0 and text_out.logits is None
    assert llm.block_manager.num_free_blocks == llm.num_blocks


def test_first_logits_match_dense(llm: LLM, tiny_dir: Path) -> None:
    out = llm.generate([PROMPTS[1]], max_tokens=3, return_logits=True, ignore_eos=True)[0]
    assert out.logits.shape == (3, 2048) and out.logits.dtype == torch.float32
    full = PROMPTS[1] + out.token_ids[:-1]
    ref = dense_logits(tiny_dir, full)[len(PROMPTS[1]) - 1 :]
    torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-4)
    assert out.token_ids == out.logits.argmax(-1).tolist()


def test_batch_matches_single(llm: LLM) -> None:
    batched = greedy(llm, PROMPTS)
    singles = [greedy(llm, [p])[0] for p in PROMPTS]
    assert batched == singles


def test_chunked_prefill_matches_one_shot(tiny_dir: Path, llm: LLM) -> None:
    chunked = LLM(tiny_dir, num_blocks=128, max_num_batched_tokens=16)
    assert greedy(chunked, PROMPTS) == greedy(llm, PROMPTS)
    long_prompt = random_prompt(14, 150)
    assert greedy(chunked, [long_prompt]) == greedy(llm, [long_prompt])


def test_preemption_gives_same_tokens(tiny_dir: Path, llm: LLM) -> None:
    # 10 blocks of 16 = 160 slots for 4 requests needing up to 64 + 24 tokens each.
    small = LLM(tiny_dir, num_blocks=10)
    got = greedy(small, PROMPTS, n=24)
    assert small.scheduler.num_preemptions > 0
    assert got == greedy(llm, PROMPTS, n=24)
    assert small.block_manager.num_free_blocks == 10


def test_preemption_keeps_sampled_stream(tiny_dir: Path, llm: LLM) -> None:
    kwargs = {"max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "seed": 3, "ignore_eos": True}
    small = LLM(tiny_dir, num_blocks=10)
    got = [o.token_ids for o in small.generate(PROMPTS, **kwargs)]
    assert small.scheduler.num_preemptions > 0
    assert got == [o.token_ids for o in llm.generate(PROMPTS, **kwargs)]


def test_max_num_seqs_limits_running(tiny_dir: Path, llm: LLM) -> None:
    narrow = LLM(tiny_dir, num_blocks=128, max_num_seqs=2)
    ids = [narrow.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in PROMPTS]
    while narrow.has_unfinished_requests():
        narrow.step()
        assert len(narrow.scheduler.running) <= 2
    assert ids == ["0", "1", "2", "3"]


def test_abort_frees_blocks(llm: LLM) -> None:
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    running = llm.add_request(PROMPTS[2], params)
    other = llm.add_request(PROMPTS[0], params)
    for _ in range(3):
        llm.step()
    assert llm.block_manager.num_free_blocks < llm.num_blocks
    out = llm.abort_request(running)
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) <= 3
    assert llm.abort_request(running) is None  # already gone
    llm.abort_request(other)
    assert not llm.has_unfinished_requests()
    assert llm.block_manager.num_free_blocks == llm.num_blocks
    # aborting a request that never ran is fine too
    waiting = llm.add_request(PROMPTS[1], params)
    assert llm.abort_request(waiting).ttft_s is None
    assert llm.block_manager.num_free_blocks == llm.num_blocks


def test_stop_on_eos_from_generation_config(tmp_path: Path, tiny_dir: Path, llm: LLM) -> None:
    free_run = greedy(llm, [PROMPTS[3]], n=12)[0]
    stop = free_run[5]
    first = free_run.index(stop)
    model_dir = tmp_path / "eos"
    model_dir.mkdir()
    for f in tiny_dir.iterdir():
        (model_dir / f.name).symlink_to(f)
    (model_dir / "generation_config.json").unlink()
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop]}))
    out = LLM(model_dir, num_blocks=32).generate([PROMPTS[3]], max_tokens=12)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run[: first + 1]  # the EOS token is reported


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    free_run = greedy(llm, [PROMPTS[0]], n=8)[0]
    out = llm.generate([PROMPTS[0]], max_tokens=8, stop_token_ids=[free_run[3]])[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run[: free_run.index(free_run[3]) + 1]
    out = llm.generate([PROMPTS[0]], max_tokens=1)[0]
    assert out.finish_reason in ("length", "stop") and len(out.token_ids) == 1


def test_max_model_len(tiny_dir: Path) -> None:
    short = LLM(tiny_dir, num_blocks=4)  # 64 slots: max_model_len lowered to 64
    assert short.max_model_len == 64
    out = short.generate([random_prompt(15, 60)], max_tokens=50, ignore_eos=True)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        short.generate([random_prompt(15, 65)])


def test_seeded_sampling(llm: LLM) -> None:
    kwargs = {"max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    a = llm.generate([PROMPTS[0], PROMPTS[0]], seed=7, **kwargs)
    b = llm.generate([PROMPTS[0]], seed=7, **kwargs)
    c = llm.generate([PROMPTS[0]], seed=8, **kwargs)
    assert a[0].token_ids == a[1].token_ids == b[0].token_ids
    assert c[0].token_ids != a[0].token_ids
    nucleus = llm.generate([PROMPTS[0]], seed=7, top_p=1e-6, **kwargs)[0]
    assert nucleus.token_ids == greedy(llm, [PROMPTS[0]], n=16)[0]


def test_top_p_filter_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])

    def kept(top_p: float) -> list[bool]:
        return (top_p_filter(probs, top_p) > 0).tolist()

    assert kept(0.7) == [False, True, False, True]
    assert kept(0.75) == [False, True, False, True]
    assert kept(0.76) == [False, True, True, True]
    assert kept(0.01) == [False, True, False, False]
    assert torch.equal(top_p_filter(probs, 0.76)[1:], probs[1:])


def test_bad_requests(llm: LLM) -> None:
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[0, 5, 99999]])
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_block_manager_ref_counts() -> None:
    bm = BlockManager(4)
    a = bm.allocate(3)
    assert bm.num_free_blocks == 1 and not bm.can_allocate(2)
    bm.share(a[:1])
    bm.free(a)
    assert bm.num_free_blocks == 3 and bm.ref_count(a[0]) == 1
    bm.free(a[:1])
    assert bm.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(a[:1])
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(5)
