"""lmc on vs off in the reference engine: identical greedy tokens and fp32 logits within
``helpers.ATOL/RTOL`` for every scenario of the issue, with the cache hits that prove lmc
actually supplied the KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmc.reference import LLM
from tests.connectors.reference.helpers import (
    BLOCK,
    assert_same,
    lmc_llm,
    plain_llm,
    prompt,
    run,
    stat,
)
from tests.late_transfer import (
    LateTransfer,
    copies,  # noqa: F401 - the fixture below
    late_factory,
    new_seed,
)

pytestmark = pytest.mark.usefixtures("copies")  # every test: copies now, then late

P = prompt(1, 150)  # 4 chunks of 32 + 22


@pytest.fixture(scope="module")
def baseline(tiny_dir: Path) -> LLM:
    return plain_llm(tiny_dir)


def test_one_request_cold_matches(tiny_dir: Path, baseline: LLM) -> None:
    llm, conn = lmc_llm(tiny_dir)
    got = run(llm, [P])
    assert got[0].num_cached_tokens == 0
    assert_same(got, run(baseline, [P]))
    assert stat(conn, "worker.saved_tokens") == len(P)


@pytest.mark.parametrize("chunk, block, length", [(16, 16, 150), (32, 16, 150), (24, 16, 150),
                                                  (16, 32, 150), (32, 8, 150), (32, 16, 128)])
def test_same_prompt_again_is_a_hit(tiny_dir: Path, chunk: int, block: int, length: int
                                    ) -> None:
    p = P[:length]
    llm, conn = lmc_llm(tiny_dir, chunk_size=chunk, block_size=block)
    want = run(plain_llm(tiny_dir, block_size=block), [p])
    assert_same(run(llm, [p]), want)
    again = run(llm, [p])
    assert again[0].num_cached_tokens == len(p) - 1  # full hit: only the last token computed
    assert_same(again, want)
    assert stat(conn, "worker.loaded_tokens") == len(p) - 1
    assert llm.block_manager.num_free_blocks == llm.num_blocks


def test_without_unfull_chunks_the_hit_is_chunk_aligned(tiny_dir: Path, baseline: LLM) -> None:
    conn_cfg = {"chunk_size": 32, "local_cpu_size": "32MiB", "save_unfull_chunk": False}
    llm = LLM(tiny_dir, num_blocks=128, block_size=BLOCK, lmc_config=conn_cfg)
    run(llm, [P])
    again = run(llm, [P])
    assert again[0].num_cached_tokens == 128
    assert_same(again, run(baseline, [P]))


def test_shared_prefix_different_suffixes(tiny_dir: Path, baseline: LLM) -> None:
    system = prompt(2, 100)
    prompts = [system + prompt(s, 40)[1:] for s in (3, 4, 5)]
    llm, _ = lmc_llm(tiny_dir)
    got = [run(llm, [p])[0] for p in prompts]
    assert [g.num_cached_tokens for g in got] == [0, 96, 96]
    assert_same(got, [run(baseline, [p])[0] for p in prompts])


def test_batch_mixing_hits_and_misses(tiny_dir: Path, baseline: LLM) -> None:
    warm_a, warm_b = prompt(6, 90), prompt(7, 130)
    llm, _ = lmc_llm(tiny_dir)
    run(llm, [warm_a, warm_b])
    batch = [prompt(8, 70), warm_b, warm_a + prompt(9, 30)[1:], prompt(10, 50), warm_a]
    got = run(llm, batch)
    assert [g.num_cached_tokens for g in got] == [0, 129, 64, 0, 89]
    assert_same(got, run(baseline, batch))


def test_prompts_longer_than_the_prefill_budget(tiny_dir: Path) -> None:
    long = prompt(11, 300)
    base = plain_llm(tiny_dir, max_num_batched_tokens=48)
    llm, conn = lmc_llm(tiny_dir, max_num_batched_tokens=48)
    want = run(base, [long])
    assert_same(run(llm, [long]), want)
    s = conn.stats()
    # saved across 7 steps, each chunk once, when complete; nothing saved twice
    assert s["worker.saved_tokens"] == 300 and s.get("cache.skipped_present", 0) == 0
    assert s["scheduler.save_tokens"] == 300
    assert_same(run(llm, [long]), want)
    # a longer prompt: 299 tokens loaded, the suffix prefilled over several steps
    longer = long + prompt(12, 120)[1:]
    got = run(llm, [longer])
    assert got[0].num_cached_tokens == 288
    assert_same(got, run(base, [longer]))


def test_eviction_between_requests(tiny_dir: Path, baseline: LLM) -> None:
    # 4 KiB of KV per token: 1 MiB holds ~7 chunks of 32, less than two 160-token prompts
    a, b = prompt(13, 160), prompt(14, 160)
    llm, conn = lmc_llm(tiny_dir, local_cpu_size="1MiB")
    want = run(baseline, [a]) + run(baseline, [b])
    got = run(llm, [a]) + run(llm, [b])
    assert_same(got, want)
    assert stat(conn, "cache.cpu.evictions") > 0
    again = run(llm, [a]) + run(llm, [b]) + run(llm, [a])
    assert again[0].num_cached_tokens < 159  # a's first chunks were evicted (LRU): recomputed
    assert_same(again, want + want[:1])


def test_load_failure_mid_layer_is_recomputed(tiny_dir: Path, baseline: LLM,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    llm, conn = lmc_llm(tiny_dir)
    want = run(baseline, [P])
    run(llm, [P])
    tr = conn.engine.transfer_for(conn.worker.kv_caches)
    real_scatter = tr.scatter
    failed: list[int] = []

    def scatter(plan, bufs, layers=None, arrays=None, **kw):
        layers = list(layers)
        if layers == [2] and not failed:  # layers 0 and 1 land, layer 2 breaks
            failed.append(2)
            raise OSError("injected: tier read failed mid-load")
        return real_scatter(plan, bufs, layers, arrays, **kw)

    monkeypatch.setattr(tr, "scatter", scatter)
    got = run(llm, [P])
    assert failed == [2]
    assert got[0].num_cached_tokens == 0  # rolled back to the first bad block
    assert_same(got, want)
    s = conn.stats()
    assert s["worker.load_failures"] == 1 and s["worker.saves_dropped"] == 1
    again = run(llm, [P])  # the store is intact: the next request loads fine
    assert again[0].num_cached_tokens == len(P) - 1
    assert_same(again, want)


def test_chunk_lost_between_lookup_and_load(tiny_dir: Path, baseline: LLM) -> None:
    llm, conn = lmc_llm(tiny_dir)
    want = run(baseline, [P])
    run(llm, [P])
    real_lookup = conn.scheduler._lookup

    def lookup_then_lose_chunk_2(tokens):
        hit = real_lookup(tokens)
        conn.engine.storage.delete([conn.engine.db.keys(tokens)[2]])
        return hit

    conn.scheduler._lookup = lookup_then_lose_chunk_2
    got = run(llm, [P])
    assert got[0].num_cached_tokens == 64  # chunks 0-1 loaded, the rest recomputed
    assert_same(got, want)
    assert stat(conn, "worker.load_failures") == 1


def test_abort_mid_prefill(tiny_dir: Path, baseline: LLM) -> None:
    llm, conn = lmc_llm(tiny_dir, max_num_batched_tokens=40)
    rid = llm.add_request(P)
    llm.step()
    llm.step()  # 80 tokens computed: chunks 0 and 1 complete and saved
    out = llm.abort_request(rid)
    assert out is not None and out.finish_reason == "abort" and not out.token_ids
    assert conn.scheduler.num_tracked_requests == 0
    assert stat(conn, "worker.saved_tokens") == 64
    got = run(llm, [P])
    assert got[0].num_cached_tokens == 64
    assert_same(got, run(baseline, [P]))
    assert llm.block_manager.num_free_blocks == llm.num_blocks


def test_abort_while_waiting_forgets_the_lookup(tiny_dir: Path) -> None:
    llm, conn = lmc_llm(tiny_dir, num_blocks=12)  # 192 token slots: b cannot be admitted
    run(llm, [P])
    a = llm.add_request(P + prompt(15, 30)[1:])
    b = llm.add_request(P)
    llm.step()
    assert conn.scheduler.num_tracked_requests == 1  # b was looked up, is still waiting
    llm.abort_request(b)
    llm.abort_request(a)
    assert conn.scheduler.num_tracked_requests == 0


def test_preemption_and_resumption_reload(tiny_dir: Path) -> None:
    # 24 blocks = 384 slots; two 170-token prompts decoding 40 tokens cannot both fit
    prompts = [prompt(16, 170), prompt(17, 170)]
    kw = {"num_blocks": 24, "max_num_batched_tokens": 64}
    base = plain_llm(tiny_dir, **kw)
    want = run(base, prompts, max_tokens=40)
    assert base.scheduler.num_preemptions > 0
    llm, conn = lmc_llm(tiny_dir, **kw)
    got = run(llm, prompts, max_tokens=40)
    assert llm.scheduler.num_preemptions > 0
    assert_same(got, want)
    # the preempted request came back and reloaded its saved prompt chunks
    assert stat(conn, "worker.loads") >= 1 and stat(conn, "worker.loaded_tokens") >= 160
    assert conn.scheduler.num_tracked_requests == 0


def test_save_decode_extends_the_stored_prefix(tiny_dir: Path, baseline: LLM) -> None:
    llm, _ = lmc_llm(tiny_dir, connector_kw={"save_decode": True})
    first = run(llm, [P], max_tokens=20)  # positions up to 168 computed: chunk 4 completes
    follow_up = P + first[0].token_ids + prompt(18, 20)[1:]
    got = run(llm, [follow_up])
    assert got[0].num_cached_tokens == 160
    assert_same(got, run(baseline, [follow_up]))


def test_lmc_config_from_yaml(tiny_dir: Path, baseline: LLM, tmp_path: Path) -> None:
    cfg = tmp_path / "lmc.yaml"
    cfg.write_text(yaml.safe_dump({"chunk_size": 32, "local_cpu_size": "8MiB"}))
    with LLM(tiny_dir, num_blocks=128, block_size=BLOCK, lmc_config=cfg) as llm:
        run(llm, [P])
        got = run(llm, [P])
    assert got[0].num_cached_tokens == len(P) - 1
    assert_same(got, run(baseline, [P]))
    with pytest.raises(ValueError, match="not both"):
        LLM(tiny_dir, num_blocks=8, lmc_config=cfg, kv_connector=llm.kv_connector)


def test_sync_loading_matches_layerwise(tiny_dir: Path, baseline: LLM) -> None:
    llm, conn = lmc_llm(tiny_dir, connector_kw={"layerwise": False})
    run(llm, [P])
    got = run(llm, [P])
    assert got[0].num_cached_tokens == len(P) - 1
    assert_same(got, run(baseline, [P]))


def test_transfer_choice_reaches_the_cache_engine(tiny_dir: Path, baseline: LLM) -> None:
    llm, conn = lmc_llm(tiny_dir, connector_kw={"transfer": late_factory(new_seed())})
    assert isinstance(conn.engine.transfer_for(conn.worker.kv_caches), LateTransfer)
    want = run(baseline, [P])
    assert_same(run(llm, [P]), want)
    again = run(llm, [P])
    assert again[0].num_cached_tokens == len(P) - 1
    assert_same(again, want)
