"""The hit-rate funnel (lmc/storage/funnel.py) on real engines: every lookup's tokens split
into found (per tier) and missed with the reason -- evicted by capacity, deleted, dropped by a
full write queue, expired in Redis (TTL), seen under another salt, never seen -- and, through
the reference engine and its connector, the funnel's "used by the engine" equal to the
engine's own cached-token count, request by request summed."""

from __future__ import annotations

import torch

from lmc import CacheConfig, CacheEngine
from lmc.connectors.reference.connector import LMCReferenceConnector
from lmc.reference import LLM, make_tiny_checkpoint
from lmc.storage.funnel import funnel_view
from tests.kvutil import make_caches, random_tokens, spec_for

CHUNK = 16
LAYOUT = "vllm_flash"
GEOM = dict(layers=2, heads=2, dim=64, blocks=64, block_size=4)


def _engine(chunks: int, **cfg) -> tuple:
    src = make_caches(LAYOUT, **GEOM)
    spec = spec_for(LAYOUT, src)
    config = CacheConfig(**{"chunk_size": CHUNK, "local_cpu_prefault": "off",
                            "pin_memory": "false",
                            "local_cpu_size": chunks * spec.chunk_nbytes(CHUNK), **cfg})
    return src, CacheEngine(config, spec, model_id="funnel")


def _store(eng: CacheEngine, src, toks: list[int], **kw) -> None:
    eng.store(toks, src, torch.arange(len(toks)), **kw)


def _delta(eng: CacheEngine, before: dict) -> dict:
    now = eng.stats()
    return {k: now[k] - before.get(k, 0) for k in now if k.startswith("funnel.")
            and now[k] != before.get(k, 0)}


def test_found_capacity_deleted_never_seen_and_other_salt():
    src, eng = _engine(chunks=8)
    with eng:
        a = random_tokens(4 * CHUNK, 1)
        st = eng.stats()
        eng.lookup(a)  # first sight: never seen
        assert _delta(eng, st) == {"funnel.lookups": 1, "funnel.prompt": 64,
                                   "funnel.miss.never_seen": 64}
        _store(eng, src, a)
        st = eng.stats()
        eng.lookup(a)
        assert _delta(eng, st) == {"funnel.lookups": 1, "funnel.prompt": 64,
                                   "funnel.best": 64, "funnel.found": 64,
                                   "funnel.found.cpu": 64}
        for seed in (2, 3, 4):  # 12 chunks through 8: a is evicted
            _store(eng, src, random_tokens(4 * CHUNK, seed))
        st = eng.stats()
        eng.lookup(a)
        assert _delta(eng, st) == {"funnel.lookups": 1, "funnel.prompt": 64,
                                   "funnel.best": 64, "funnel.miss.capacity": 64}
        b = random_tokens(3 * CHUNK, 5)
        eng.lookup(b)
        _store(eng, src, b)
        eng.delete(b)
        st = eng.stats()
        eng.lookup(b)
        assert _delta(eng, st)["funnel.miss.deleted"] == 48
        # the same tokens under a cache_salt: a chain of their own, seen as another salt's
        salted = eng.control.keys(b, "tenant-salt", None)
        st = eng.stats()
        eng.lookup_result(b, keys=salted)
        d = _delta(eng, st)
        assert d["funnel.miss.other_salt"] == 48 and "funnel.miss.never_seen" not in d


def test_a_full_write_queue_is_the_reason_once_l1_evicts(tmp_path):
    """A disk tier behind a link too slow for the stores: the write queue (half the pool)
    fills, later chunks' disk writes are dropped, and when L1 evicts them the funnel says
    why they are gone."""
    disk = {"backend": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"}
    src, eng = _engine(chunks=8, tiers=["memory", {"wrap": "rate_limit",
                                                   "bytes_per_second": 1024,
                                                   "max_delay": 0.01, "tier": disk}])
    with eng:
        prompts = [random_tokens(4 * CHUNK, 10 + i) for i in range(4)]
        for p in prompts:
            eng.lookup(p)
            _store(eng, src, p)
        assert eng.stats()["disk.dropped_queue_full"] > 0
        st = eng.stats()
        for p in prompts:
            eng.lookup(p)
        d = _delta(eng, st)
        assert d.get("funnel.miss.write_queue_full", 0) > 0, d


def test_the_funnel_and_the_engines_cached_tokens_agree(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", hidden=64, layers=2, vocab=512,
                                max_position_embeddings=1024)
    conn = LMCReferenceConnector({"chunk_size": CHUNK, "local_cpu_prefault": "off",
                                  "pin_memory": "false", "local_cpu_size": "1MiB"},
                                 model_dir=ckpt)
    with LLM(ckpt, num_blocks=48, kv_connector=conn) as llm:
        base = [t % 512 for t in random_tokens(8 * CHUNK, 30)]
        prompts = [base, base + [1, 2, 3], [t % 512 for t in random_tokens(5 * CHUNK, 31)],
                   base[:5 * CHUNK], base + [9] * 40]
        engine_cached = 0
        for p in prompts * 3:
            out = llm.generate([p], max_tokens=2, ignore_eos=True)[0]
            engine_cached += out.num_cached_tokens
        view = funnel_view(conn.stats())
        assert view["engine_used"] == engine_cached > 0, view
        assert view["lmc_found"] >= view["loaded"] > 0
        assert view["prompt_tokens"] >= sum(len(p) for p in prompts * 3) - 1
        assert view["best_possible"] >= view["lmc_found"]
        assert sum(view["found_by_tier"].values()) == view["lmc_found"]
