"""The reference connector's lookups take the one typed path: ``lookup_result`` answers how
many tokens and which tier holds each hit chunk in one pass over the tiers, the scheduler
core keeps it with the request, and the per-tier counts of a load come from it (no second
hash, no second tier walk, no ``engine.lookup`` int)."""

from __future__ import annotations

from pathlib import Path

from lmc.connectors.reference import LMCReferenceConnector
from lmc.reference import LLM
from lmc.storage.lookup import LookupResult
from tests.connectors.reference.helpers import BLOCK, assert_same, plain_llm, prompt, run, stat
from tests.deadlines import HANG_S

P = prompt(7, 150)  # chunks of 32: 0-1 stay in L1, 2-4 only on disk


def test_a_load_split_over_tiers_is_counted_from_the_single_lookup(tiny_dir: Path,
                                                                   tmp_path: Path) -> None:
    # the disk always heard (a loaded host may make its answer late, a miss: that deadline
    # is tests/connectors/reference/test_slow_tier_lookup_e2e.py's subject)
    cfg = {"chunk_size": 32, "local_cpu_size": "32MiB", "local_disk": str(tmp_path / "disk"),
           "local_disk_size": "64MiB", "lookup_min_wait": HANG_S}
    conn = LMCReferenceConnector(cfg, model_dir=tiny_dir)
    llm = LLM(tiny_dir, num_blocks=128, block_size=BLOCK, kv_connector=conn)
    want = run(llm, [P])                                  # cold: stored in L1 and on disk
    engine = conn.engine
    assert engine is not None and engine.flush(30)
    l1 = engine.storage.tiers[0]
    assert l1.delete(engine.db.keys(P)[2:]) == 3          # chunks 2-4 now only on disk

    answers: list[LookupResult] = []
    passes: list[int] = []
    real_lookup, real_sources = conn.scheduler._lookup, engine.storage.sources
    sources_at_alloc: list[dict[str, int]] = []
    real_alloc = conn.update_state_after_alloc

    def lookup(tokens):
        answers.append(real_lookup(tokens))
        return answers[-1]

    def sources(keys):  # the pass over the tiers, whichever lookup method asks for it
        passes.append(len(keys))
        return real_sources(keys)

    def alloc(request, block_ids, num_external_tokens):
        real_alloc(request, block_ids, num_external_tokens)
        sources_at_alloc.append(conn.load_sources(request))

    def no_int_lookup(*a, **k):
        raise AssertionError("the connector asked engine.lookup(): a second, untyped path")

    conn.scheduler._lookup = lookup
    engine.storage.sources = sources
    conn.update_state_after_alloc = alloc
    engine.lookup = no_int_lookup
    got = run(llm, [P])

    assert_same(got, want)
    assert_same(got, run(plain_llm(tiny_dir), [P]))
    assert got[0].num_cached_tokens == len(P) - 1
    assert len(answers) == 1 and len(passes) == 1        # one lookup, one pass over the tiers
    hit = answers[0]
    assert hit.tokens == len(P) and hit.tiers == ("cpu", "disk")
    assert hit.tokens_by_tier() == {"cpu": 64, "disk": 86}
    # what the scheduler keeps for the admitted load: its 149 positions by tier
    assert sources_at_alloc == [{"cpu": 64, "disk": 85}]
    assert stat(conn, "worker.tokens_from_disk") == 85
    assert stat(conn, "worker.tokens_from_cpu") == 64


def test_before_registration_a_lookup_is_a_typed_miss(tiny_dir: Path) -> None:
    conn = LMCReferenceConnector({"chunk_size": 32, "local_cpu_size": "8MiB"},
                                 model_dir=tiny_dir)
    assert conn._lookup(P) == LookupResult.miss(32)
    conn.shutdown()
