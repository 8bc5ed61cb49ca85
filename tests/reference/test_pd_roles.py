"""Prefill/decode roles in the reference engine, in one process (two engines sharing one
lmc ``CacheEngine``, so no NIXL is needed; ``tests/storage/backends/p2p`` runs them as two processes over
NIXL): a producer answers ``kv_transfer_params``, a consumer given them holds the request
while its asynchronous load runs, then decodes exactly as a single instance would; a load
that never comes is recomputed."""

from __future__ import annotations

import pytest

from lmc import CacheConfig
from lmc.connectors.reference import LMCReferenceConnector
from lmc.reference import LLM, make_tiny_checkpoint
from tests.reference.prompts import random_prompt

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pd") / "llama")


def _pair(ckpt, wait: float = 5.0):
    cfg = CacheConfig(chunk_size=32, local_cpu_size="16MiB", pin_memory="false")
    prod_conn = LMCReferenceConnector(cfg, model_dir=ckpt, kv_role="kv_producer",
                                      engine_id="p1")
    prod = LLM(ckpt, num_blocks=64, kv_connector=prod_conn)
    cons_conn = LMCReferenceConnector(cfg, model_dir=ckpt, kv_role="kv_consumer",
                                      cache_engine=prod_conn.engine, remote_prefill_wait=wait)
    return prod, LLM(ckpt, num_blocks=64, kv_connector=cons_conn)


def test_consumer_decodes_what_the_producer_prefilled(ckpt):
    prompts = [random_prompt(3, 150), random_prompt(4, 70)]
    with LLM(ckpt, num_blocks=64) as ref:
        want = ref.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    prod, cons = _pair(ckpt)
    with prod, cons:
        pre = prod.generate(prompts, max_tokens=1, ignore_eos=True,
                            kv_transfer_params={"do_remote_decode": True})
        params = [o.kv_transfer_params for o in pre]
        assert [p["remote_num_tokens"] for p in params] == [150, 70]
        assert all(p["do_remote_prefill"] and p["remote_engine_id"] == "p1" for p in params)
        got = cons.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True,
                            kv_transfer_params=params)
        w = cons.kv_connector.worker.stats
        assert [g.token_ids for g in got] == [x.token_ids for x in want]
        assert [g.num_cached_tokens for g in got] == [149, 69]  # computed the last one only
        assert (w.async_loads, w.async_load_failures, w.loaded_tokens) == (2, 0, 218)
        assert not cons.scheduler.has_remote_loads
        # a plain request on the consumer is not an asynchronous load
        assert cons.generate([prompts[0]], max_tokens=2, ignore_eos=True)[0].token_ids \
            == want[0].token_ids[:2]
        assert cons.kv_connector.worker.stats.async_loads == 2


def test_a_transfer_that_never_comes_is_recomputed(ckpt):
    prompt = random_prompt(5, 120)
    with LLM(ckpt, num_blocks=64) as ref:
        want = ref.generate([prompt], max_tokens=MAX_TOKENS, ignore_eos=True)[0]
    prod, cons = _pair(ckpt, wait=0.3)
    with prod, cons:
        fake = {"do_remote_prefill": True, "lmc_pd": 1, "remote_num_tokens": 120}
        got = cons.generate([prompt], max_tokens=MAX_TOKENS, ignore_eos=True,
                            kv_transfer_params=fake)[0]
        assert got.token_ids == want.token_ids and got.num_cached_tokens == 0
        w = cons.kv_connector.worker.stats
        assert (w.async_loads, w.async_load_failures, w.loaded_tokens) == (1, 1, 0)


def test_abort_while_loading_frees_the_blocks_once_the_load_ends(ckpt):
    prod, cons = _pair(ckpt, wait=30.0)
    with prod, cons:
        free = cons.block_manager.num_free_blocks
        rid = cons.add_request(random_prompt(6, 100), kv_transfer_params={
            "do_remote_prefill": True, "lmc_pd": 1, "remote_num_tokens": 100})
        cons.step()
        assert cons.scheduler.loading and cons.block_manager.num_free_blocks < free
        cons.abort_request(rid)
        for _ in range(2000):
            cons.step()
            if not cons.scheduler.has_remote_loads:
                break
        assert not cons.scheduler.has_remote_loads
        assert cons.block_manager.num_free_blocks == free
