"""One lookup pass: a LookupResult says how many tokens lmc holds and which tier holds each
hit chunk, computed while the tiers answer (each asked once), never by a second walk."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmc import CacheConfig, CacheEngine
from lmc.cache_engine import FUNNEL_ROOT
from lmc.storage.lookup import LookupResult, minimum
from tests.kvutil import make_caches, random_tokens, spec_for

CHUNK = 16
N = 5 * CHUNK
SLOTS = torch.arange(N) + 8


def test_result_checks_its_fields():
    with pytest.raises(ValueError, match="2 sources for 40 tokens"):
        LookupResult(40, 16, ("cpu",), (0, 0))
    with pytest.raises(ValueError, match="source 2 names no tier"):
        LookupResult(20, 16, ("cpu", "disk"), (0, 2))
    with pytest.raises(ValueError, match="sources must be tier indices"):
        LookupResult(20, 16, ("cpu", "disk"), (0, -1))
    assert LookupResult(20, 16, ("cpu",), [0, 0]).sources == b"\0\0"
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        LookupResult(0, 0)
    with pytest.raises(ValueError, match="at most 16"):
        LookupResult(0, 1, tuple(f"t{i}" for i in range(17)))


def test_tokens_by_tier_over_a_range():
    r = LookupResult(40, 16, ("cpu", "disk", "redis"), (0, 2, 1))  # last chunk: 8 tokens
    assert r.tokens_by_tier() == {"cpu": 16, "disk": 8, "redis": 16}
    assert r.tokens_by_tier(10, 39) == {"cpu": 6, "disk": 7, "redis": 16}
    assert r.tokens_by_tier(16, 16) == {"cpu": 0, "disk": 0, "redis": 0}
    assert r.clipped(17) == LookupResult(17, 16, r.tiers, (0, 2))
    assert r.clipped(0).tokens_by_tier() == {"cpu": 0, "disk": 0, "redis": 0}
    assert LookupResult(40, 16).tokens_by_tier() == {}, "an unattributed hit says nothing"


@given(st.data())
def test_tokens_by_tier_matches_a_position_by_position_count(data):
    cs = data.draw(st.integers(1, 9), "chunk_size")
    tiers = tuple(f"t{i}" for i in range(data.draw(st.integers(1, 4), "tiers")))
    tokens = data.draw(st.integers(0, 60), "tokens")
    src = data.draw(st.lists(st.integers(0, len(tiers) - 1), min_size=-(-tokens // cs),
                             max_size=-(-tokens // cs)), "sources")
    start = data.draw(st.integers(-3, 70), "start")
    end = data.draw(st.none() | st.integers(-3, 70), "end")
    want = dict.fromkeys(tiers, 0)
    for p in range(max(0, start), tokens if end is None else min(end, tokens)):
        want[tiers[src[p // cs]]] += 1
    assert LookupResult(tokens, cs, tiers, src).tokens_by_tier(start, end) == want


def test_minimum_is_what_every_rank_can_load_from_its_slowest_tier():
    tiers = ("cpu", "disk")
    a = LookupResult(48, 16, tiers, (0, 0, 1))
    b = LookupResult(40, 16, tiers, (1, 0, 0))
    assert minimum([a, b]) == LookupResult(40, 16, tiers, (1, 0, 1))
    assert minimum([a, LookupResult.miss()]).tokens == 0  # a rank without an engine yet
    assert minimum([a, LookupResult(48, 16, ("cpu", "redis"), (0, 0, 0))]) == \
        LookupResult(48, 16), "tier lists that disagree drop attribution, not guess it"
    with pytest.raises(ValueError, match="disagree on chunk_size"):
        minimum([a, LookupResult(48, 8, tiers, (0,) * 6)])
    with pytest.raises(ValueError, match="no lookup results"):
        minimum([])


def _count_calls(monkeypatch, tier) -> dict[str, list[int]]:
    calls: dict[str, list[int]] = {"contains": [], "get": []}
    for name in calls:
        real = getattr(tier, name)

        def counted(keys, _real=real, _name=name):
            calls[_name].append(len(keys))
            return _real(keys)

        monkeypatch.setattr(tier, name, counted)
    return calls


@pytest.fixture
def split_engine(tmp_path, request):
    """An engine whose prompt has chunks 0-1 in L1 and chunks 2-4 only on disk (its hit-rate
    funnel on unless the test's indirect parameter says ``False``)."""
    src = make_caches("vllm_flash", blocks=64, block_size=4, seed=5)
    spec = spec_for("vllm_flash", src)
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size="2MiB", local_disk=str(tmp_path),
                      funnel=getattr(request, "param", True))
    toks = random_tokens(N)
    with CacheEngine(cfg, spec, "m") as eng:
        eng.store(toks, src, SLOTS)
        assert eng.flush(10)
    eng = CacheEngine(cfg, spec, "m")
    dst = make_caches("vllm_flash", blocks=64, block_size=4, zeros=True)
    assert eng.retrieve(toks[:2 * CHUNK], dst, SLOTS[:2 * CHUNK]) == 2 * CHUNK  # promoted
    yield eng, toks
    eng.close()


def test_engine_lookup_attributes_each_chunk_from_one_pass(split_engine, monkeypatch):
    eng, toks = split_engine
    calls = _count_calls(monkeypatch, eng.storage.tiers[1])
    r = eng.lookup_result(toks)
    assert r == LookupResult(N, CHUNK, ("cpu", "disk"), (0, 0, 1, 1, 1))
    assert calls == {"contains": [3], "get": []}, "disk asked once, only about L1's misses"
    assert r.tokens_by_tier(0, N - 1) == {"cpu": 32, "disk": 47}
    assert eng.lookup(toks) == N
    r_pinned = eng.lookup_result(toks, pin=True)
    assert r_pinned == r and eng.stats()["pinned_chunks"] == 2  # the L1 chunks
    assert eng.unpin(toks) == 2
    # a prefix whose last chunk is partial: the partial chunk is not stored, the answer stops
    assert eng.lookup_result(toks[: N - 3]).tokens == 4 * CHUNK


@pytest.mark.parametrize("split_engine", [True, False], ids=["funnel", "no_funnel"],
                         indirect=True)
def test_precomputed_keys_skip_the_hash(split_engine, monkeypatch):
    """The request's own chain is never hashed again; the funnel's chain of the tokens
    alone (its documented extra hash, ``funnel`` in the config) is the only one left."""
    eng, toks = split_engine
    keys = eng.db.request_keys().keys(toks)
    hashed: list[bytes | None] = []
    real = eng.db.keys

    def recorded(tokens, limit=None, root=None):
        hashed.append(root)
        return real(tokens, limit, root)

    monkeypatch.setattr(eng.db, "keys", recorded)
    assert eng.lookup_result(toks, keys=keys).tokens == N
    assert hashed == ([FUNNEL_ROOT] if eng.config.funnel else [])
    with pytest.raises(ValueError, match="precomputed keys"):
        eng.lookup(toks, keys=keys[:-1])


def test_fetch_reports_the_tier_each_object_came_from(split_engine, monkeypatch):
    eng, toks = split_engine
    keys = eng.db.keys(toks)
    calls = _count_calls(monkeypatch, eng.storage.tiers[1])
    objs, where = eng.storage.fetch_prefix(keys)
    try:
        assert where == [0, 0, 1, 1, 1] and len(objs) == 5
        assert calls == {"contains": [], "get": [3]}
    finally:
        for o in objs:
            o.release()
    assert eng.storage.prefix_sources(keys) == [0] * 5, "disk hits were promoted"
