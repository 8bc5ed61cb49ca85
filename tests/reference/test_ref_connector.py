"""The KV connector hooks, proven with the in-memory test connector: a repeated prompt
is served from the connector with identical greedy tokens and fp32 logits, and a load
failure makes the engine recompute instead of using the bad blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmc.reference import LLM, KVConnector, SamplingParams
from tests.reference.prompts import random_prompt
from tests.reference.ref_connector import InMemoryConnector

BLOCK = 16
PROMPT = random_prompt(20, 75)  # 4 full blocks + 11 tokens


@pytest.fixture(scope="module")
def baseline(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, num_blocks=64)


def make(tiny_dir: Path, **kwargs: object) -> tuple[LLM, InMemoryConnector]:
    connector = InMemoryConnector(BLOCK)
    kwargs.setdefault("num_blocks", 64)
    return LLM(tiny_dir, kv_connector=connector, **kwargs), connector


def run(llm: LLM, prompts: list[list[int]], n: int = 8):
    return llm.generate(prompts, max_tokens=n, ignore_eos=True, return_logits=True)


def assert_same(got, want, tol: float = 1e-5) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(g.logits, w.logits, rtol=tol, atol=tol)


def test_repeated_prompt_is_served_by_connector(tiny_dir: Path, baseline: LLM) -> None:
    llm, conn = make(tiny_dir)
    want = run(baseline, [PROMPT])
    first = run(llm, [PROMPT])
    assert first[0].num_cached_tokens == 0
    assert_same(first, want)
    # prompt blocks and the block completed during decode were saved
    assert len(conn.store) == (len(PROMPT) + 8 - 1) // BLOCK
    second = run(llm, [PROMPT])
    assert second[0].num_cached_tokens == 64
    assert_same(second, want)
    assert llm.block_manager.num_free_blocks == 64


def test_hook_order_and_registration(tiny_dir: Path) -> None:
    llm, conn = make(tiny_dir)
    layers = llm.config.num_hidden_layers
    assert conn.layer_names == [f"model.layers.{i}.self_attn" for i in range(layers)]
    assert all(t is c for t, c in zip(conn.kv_caches, llm.kv_caches, strict=True))
    assert conn.kv_caches[0].shape == (2, 64, BLOCK, 2, 64)
    run(llm, [PROMPT], n=2)
    conn.events.clear()
    run(llm, [PROMPT], n=2)
    kinds = [e[0] for e in conn.events]
    assert kinds[:3] == ["lookup", "alloc", "meta"]
    assert conn.events[0] == ("lookup", "1", 64) and conn.events[1] == ("alloc", "1", 64)
    per_step = ["start_load"] + [k for _ in range(layers) for k in ("wait_layer", "save_layer")]
    per_step += ["wait_save"]
    assert kinds[3:] == per_step + ["meta"] + per_step
    waits = [e[1] for e in conn.events if e[0] == "wait_layer"]
    assert waits == list(range(layers)) * 2
    assert conn.finished == ["0", "1"]


def test_partial_prefix_hit_and_batching(tiny_dir: Path, baseline: LLM) -> None:
    llm, _ = make(tiny_dir)
    run(llm, [PROMPT])
    shares_two_blocks = PROMPT[:32] + random_prompt(21, 30)[1:]
    prompts = [shares_two_blocks, PROMPT, random_prompt(22, 40)]
    got = run(llm, prompts)
    assert [o.num_cached_tokens for o in got] == [32, 64, 0]
    assert_same(got, run(baseline, prompts))


def test_whole_prompt_hit_still_computes_last_token(tiny_dir: Path, baseline: LLM) -> None:
    prompt = random_prompt(23, 48)  # exactly 3 blocks, all stored after one run
    llm, conn = make(tiny_dir)
    run(llm, [prompt])
    assert conn.get_num_new_matched_tokens(type("R", (), {"all_token_ids": prompt, "request_id": "x"}), 0) == 48
    got = run(llm, [prompt])
    assert got[0].num_cached_tokens == 47  # clamped: the last prompt token is computed
    assert_same(got, run(baseline, [prompt]))


def test_chunked_prefill_after_hit(tiny_dir: Path, baseline: LLM) -> None:
    long_prompt = random_prompt(24, 120)
    llm, _ = make(tiny_dir, max_num_batched_tokens=16)
    run(llm, [long_prompt])
    got = run(llm, [long_prompt])
    assert got[0].num_cached_tokens == 112
    assert_same(got, run(baseline, [long_prompt]))


def test_load_failure_is_recomputed(tiny_dir: Path, baseline: LLM) -> None:
    llm, conn = make(tiny_dir)
    run(llm, [PROMPT])
    conn.fail_next_load = True
    got = run(llm, [PROMPT])
    assert not conn.fail_next_load  # the failure was injected (NaN in the first block)
    assert got[0].num_cached_tokens == 0  # first block failed: nothing from the connector
    assert_same(got, run(baseline, [PROMPT]))
    assert torch.isfinite(got[0].logits).all()
    # the store was not polluted: a clean reload still matches
    again = run(llm, [PROMPT])
    assert again[0].num_cached_tokens == 64
    assert_same(again, run(baseline, [PROMPT]))


def test_load_failure_in_a_later_block_keeps_the_good_prefix(tiny_dir: Path, baseline: LLM) -> None:
    llm, conn = make(tiny_dir)
    run(llm, [PROMPT])

    original = conn.start_load_kv

    def fail_third_block(meta) -> None:
        original(meta)
        if not meta.loads:
            return
        load = meta.loads[0]
        conn._failed_blocks.add(load.block_ids[2])
        conn._failed_requests.add(load.request_id)

    conn.start_load_kv = fail_third_block
    got = run(llm, [PROMPT])
    assert got[0].num_cached_tokens == 32
    assert_same(got, run(baseline, [PROMPT]))


def test_preempted_request_reloads_through_connector(tiny_dir: Path, baseline: LLM) -> None:
    prompts = [random_prompt(30 + i, 40) for i in range(4)]
    llm, conn = make(tiny_dir, num_blocks=10)
    got = llm.generate(prompts, max_tokens=24, ignore_eos=True, return_logits=True)
    assert llm.scheduler.num_preemptions > 0
    resumed = [e for e in conn.events if e[0] == "lookup" and e[2] > 0]
    assert resumed  # a resumed request found its own saved blocks
    # Batches differ from the baseline's after preemption (decode padding widths), so
    # allow fp32 reduction-order noise.
    want = baseline.generate(prompts, max_tokens=24, ignore_eos=True, return_logits=True)
    assert_same(got, want, tol=1e-4)


def test_abort_calls_request_finished_before_free(tiny_dir: Path) -> None:
    seen: list[tuple[str, list[int], int]] = []

    class Spy(InMemoryConnector):
        def request_finished(self, request) -> None:
            seen.append((request.request_id, list(request.block_ids), llm.block_manager.num_free_blocks))

    conn = Spy(BLOCK)
    llm = LLM(tiny_dir, num_blocks=64, kv_connector=conn)
    rid = llm.add_request(PROMPT, SamplingParams(max_tokens=10))
    llm.step()
    llm.abort_request(rid)
    (req_id, blocks, free_then), = seen
    assert req_id == rid and len(blocks) == 5 and free_then == 59
    assert llm.block_manager.num_free_blocks == 64


def test_base_class_defaults() -> None:
    class Minimal(KVConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0

        def update_state_after_alloc(self, request, block_ids, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            return None

        def start_load_kv(self, meta):
            pass

        def wait_for_layer_load(self, layer_idx):
            pass

        def save_kv_layer(self, layer_idx, kv_layer, meta):
            pass

        def wait_for_save(self):
            pass

    conn = Minimal()
    assert conn.get_block_ids_with_load_errors() == set()
    conn.register_kv_caches({})
    conn.request_finished(None)
    conn.shutdown()
    with pytest.raises(TypeError):
        KVConnector()
