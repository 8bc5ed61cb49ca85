"""A request's cache hints (lmc/connectors/core/hints.py): a session's chain pinned in L1
between turns and given its priority, on the reference engine with lmc's connector and a
small pool flooded by background traffic between turns; the same flood without hints evicts
it (the control). Hints out of range are dropped, never a failed request; a body's
``cache_hints`` are checked and named."""

from __future__ import annotations

import pytest

from lmc.connectors.core.hints import CacheHints, parse_hints
from lmc.connectors.reference.connector import LMCReferenceConnector
from lmc.reference import LLM, make_tiny_checkpoint
from lmc.reference.openai_api import BadRequest, parse_completion
from lmc.storage.control import body_hints
from tests.kvutil import random_tokens

CHUNK = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hints") / "tiny", hidden=64,
                                layers=2, vocab=512, max_position_embeddings=1024)


def _llm(ckpt, chunks: int) -> LLM:
    conn = LMCReferenceConnector({"chunk_size": CHUNK, "local_cpu_prefault": "off",
                                  "pin_memory": "false", "local_cpu_size": "64MiB"},
                                 model_dir=ckpt)
    llm = LLM(ckpt, num_blocks=256, kv_connector=conn)
    llm.generate([[1, 2, 3]], max_tokens=1)  # binds the caches: the engine exists now
    eng = conn.engine
    # a pool of ``chunks`` chunks: the same engine, re-made small (the spec is known now)
    small = chunks * eng.spec.chunk_nbytes(CHUNK)
    llm.close()
    conn = LMCReferenceConnector({"chunk_size": CHUNK, "local_cpu_prefault": "off",
                                  "pin_memory": "false", "local_cpu_size": small},
                                 model_dir=ckpt)
    return LLM(ckpt, num_blocks=256, kv_connector=conn)


def _turns(llm: LLM, hints: dict | None) -> tuple[int, int]:
    """Turn 1, a flood of background prompts, turn 2 (turn 1 and more): turn 2's cached
    tokens, and turn 1's length."""
    turn1 = [t % 512 for t in random_tokens(6 * CHUNK, seed=11)]
    llm.generate([turn1], max_tokens=1, ignore_eos=True, kv_transfer_params=hints)
    for seed in range(20, 28):  # 8 x 6 chunks of other traffic through a 16-chunk pool
        llm.generate([[t % 512 for t in random_tokens(6 * CHUNK, seed=seed)]], max_tokens=1,
                     ignore_eos=True)
    turn2 = turn1 + [t % 512 for t in random_tokens(2 * CHUNK, seed=12)]
    out = llm.generate([turn2], max_tokens=1, ignore_eos=True, kv_transfer_params=hints)
    return out[0].num_cached_tokens, len(turn1)


def test_a_sessions_chain_stays_in_l1_between_turns(ckpt):
    with _llm(ckpt, chunks=16) as llm:
        cached, n1 = _turns(llm, {"lmc_session": "agent-1", "lmc_ttl": 60,
                                  "lmc_priority": 3})
        conn = llm.kv_connector
        assert cached >= n1 - CHUNK, f"turn 2 found {cached} of turn 1's {n1} tokens"
        st = conn.stats()
        assert st["worker.kept_warm"] >= 2 and st["cache.ttl_pinned_chunks"] >= 6
        eng = conn.engine
        assert eng.unpin(session="agent-1") >= 6


def test_without_hints_the_flood_evicts_the_session(ckpt):
    with _llm(ckpt, chunks=16) as llm:
        cached, n1 = _turns(llm, None)
        assert cached < CHUNK, f"turn 2 still found {cached} tokens without hints"
        assert llm.kv_connector.stats()["worker.kept_warm"] == 0


def test_hints_are_parsed_leniently_from_kv_transfer_params():
    assert parse_hints(None) is None and parse_hints({"do_remote_decode": True}) is None
    assert parse_hints({"lmc_session": "s", "lmc_ttl": 5, "lmc_priority": -2}) == \
        CacheHints("s", -2, 5.0)
    assert parse_hints({"lmc_session": "s"}) is None  # a session alone asks nothing
    for bad in ({"lmc_ttl": -1}, {"lmc_ttl": float("nan")}, {"lmc_ttl": True},
                {"lmc_priority": 99}, {"lmc_priority": "3"}):
        assert parse_hints(bad) is None, bad
    assert parse_hints({"lmc_ttl": 5, "lmc_session": "x" * 300}) == CacheHints(None, None, 5.0)


def test_a_body_cache_hints_object_is_checked_and_named():
    c = parse_completion({"prompt": [1, 2], "cache_hints": {"session": "a", "ttl": 30,
                                                            "priority": 1}})
    assert c.kv_transfer_params == {"lmc_session": "a", "lmc_ttl": 30, "lmc_priority": 1}
    c = parse_completion({"prompt": [1], "kv_transfer_params": {"x": 1},
                          "cache_hints": {"ttl": 2}})
    assert c.kv_transfer_params == {"x": 1, "lmc_ttl": 2}
    for bad, words in (({"ttl": 0}, "cache_hints.ttl"), ({"priority": 11}, "cache_hints.priority"),
                       ({"session": ""}, "cache_hints.session"), ({"when": 1}, "unknown field"),
                       ([], "must be an object")):
        with pytest.raises(BadRequest, match=words):
            parse_completion({"prompt": [1], "cache_hints": bad})
        with pytest.raises(ValueError, match=words):
            body_hints(bad)
