"""``CacheEngine.delete`` and ``clear`` reach a shared lower tier and publish the removals:
against a real redis-server, a real ``mooncake_master`` (values held by another process's
segment) and a real ``lmc server`` daemon, each the engine's second tier after L1.

For each: a deleted prompt is gone from L1 and the shared tier and its blocks are published
as removed from both media while another prompt stays; a clear empties the engine's own
namespace there (and publishes it) while another engine's namespace on the same server keeps
its values. (The tier-level rules, a key prefix and a dead server, are
:class:`lmc.testing.ClearContract`'s, run on every tier.)"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lmc import CacheConfig
from lmc.cache_engine import CacheEngine
from lmc.events import wire
from lmc.events.engine import attach
from tests.deadlines import HANG_S
from tests.events.helpers import LOCAL, Collector
from tests.kvutil import make_caches, random_tokens, spec_for
from tests.server.daemon_proc import DaemonProc

from .conftest import RedisServer, require_redis
from .mooncake.mooncake_cluster import MooncakeMaster, Peer, require_mooncake, wait_client_closes

pytestmark = pytest.mark.integration
CHUNK, BLOCK = 64, 16


@pytest.fixture(scope="module", params=["redis", "mooncake", "daemon"])
def shared(request, tmp_path_factory):
    """``(name, config for one namespace)``: a callable giving each engine its own
    namespace on one real server of the kind."""
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "redis":
        require_redis()
        s = RedisServer(tmp).start()
        yield "redis", lambda: {"remote_url": s.url,
                                "remote_key_prefix": f"k{uuid.uuid4().hex[:10]}"}
        s.stop()
    elif request.param == "mooncake":
        require_mooncake()
        import lmc.storage.backends.mooncake  # noqa: F401  (registers mooncake://)
        master = MooncakeMaster(tmp, client_ttl=60).start()
        holder = None
        closing: list[str] = []
        try:
            holder = Peer("holder", master, segment=64 << 20)
            yield "mooncake", lambda: {"remote_url": master.url,
                                       "remote_key_prefix": f"k{uuid.uuid4().hex[:10]}",
                                       "remote_options": {"segment": 0}}
        finally:
            # the engines' clients close on threads of their own, talking to the master
            # with the GIL held: the master outlives them, or the whole run stalls
            closing = wait_client_closes(HANG_S)
            if holder is not None:
                holder.stop()
            master.stop()
        assert not closing, f"Mooncake clients still closing after {HANG_S:.0f} s"
    else:
        d = DaemonProc(tmp / "d", ["--size", "64MiB"]).start()
        try:
            yield "server", lambda: {"remote_url": f"{d.url}?ns=n{uuid.uuid4().hex[:10]}"}
            d.audit()
        finally:
            d.kill()


@contextlib.contextmanager
def _engine(where: dict[str, Any], events: bool = True) -> Iterator[tuple[CacheEngine, Any,
                                                                           Any]]:
    """A CPU engine (chunk 64, block 16) whose second tier is the shared one, written
    through; KV events on, the shared tier's too (``publish_remote``)."""
    caches = make_caches("vllm_flash", blocks=256, block_size=BLOCK)
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size="4MiB", local_cpu_prefault="off",
                      pin_memory="false", remote_timeout=5.0, **where)
    eng = CacheEngine(cfg, spec_for("vllm_flash", caches), "control-tiers")
    ev = attach(eng, {**LOCAL, "publish_remote": True}) if events else None
    try:
        yield eng, ev, caches
    finally:
        if ev is not None:
            ev.close()
        eng.close()


def _store(eng: CacheEngine, caches: Any, tokens: list[int]) -> None:
    assert eng.store(tokens, caches, torch.arange(len(tokens))) == len(tokens)
    assert eng.flush(HANG_S), "the write-behind to the shared tier did not drain"


def _removed(events: list[wire.Event], medium: str) -> set[int]:
    return {h for e in events if isinstance(e, wire.Removed) and e.medium == medium
            for h in e.hashes}


def _stored(events: list[wire.Event], medium: str) -> set[int]:
    return {h for e in events if isinstance(e, wire.Stored) and e.medium == medium
            for h in e.hashes}


def test_delete_reaches_the_shared_tier_and_is_published(shared):
    name, where = shared
    with _engine(where()) as (eng, ev, caches):
        sub = Collector(ev.endpoint)
        a = random_tokens(3 * CHUNK, seed=1)
        b = random_tokens(2 * CHUNK, seed=2)
        _store(eng, caches, a)
        hashes_a = _stored(sub.settle(ev.publisher), wire.STORAGE)
        assert len(hashes_a) == 3 * CHUNK // BLOCK, "the shared tier's stores not published"
        _store(eng, caches, b)
        sub.settle(ev.publisher)
        remote = eng.storage.tiers[1]
        assert remote.name == name
        ka, kb = eng.db.keys(a), eng.db.keys(b)
        assert remote.contains(ka + kb) == [True] * 5, "the shared tier did not get both"
        assert eng.pin(a, ttl=60) == len(a)
        assert eng.delete(a) == 6  # 3 chunks in L1 and 3 in the shared tier
        assert remote.contains(ka) == [False] * 3, f"{name} kept a deleted chunk"
        assert not any(eng.storage.l1.contains(ka))
        assert eng.stats()["ttl_pinned_chunks"] == 0, "the pins outlived their chunks"
        assert remote.contains(kb) == [True] * 2 and all(eng.storage.l1.contains(kb))
        got = sub.settle(ev.publisher)
        assert _removed(got, wire.STORAGE) == hashes_a, "the shared tier's removal unpublished"
        assert _removed(got, wire.CPU) == hashes_a
        assert eng.lookup(a) == 0 and eng.lookup(b) == len(b)
        sub.close()


def test_clear_reaches_the_shared_tier_is_published_and_spares_other_namespaces(shared):
    name, where = shared
    with _engine(where(), events=False) as (other, _, other_caches), \
            _engine(where()) as (eng, ev, caches):
        sub = Collector(ev.endpoint)
        prompts = [random_tokens(2 * CHUNK, seed=10 + i) for i in range(3)]
        for p in prompts:
            _store(eng, caches, p)
            _store(other, other_caches, p)  # the same prompts, another namespace
        keys = [k for p in prompts for k in eng.db.keys(p)]
        remote, theirs = eng.storage.tiers[1], other.storage.tiers[1]
        assert remote.contains(keys) == [True] * 6
        assert theirs.contains(keys) == [True] * 6
        got = sub.settle(ev.publisher)
        held = _stored(got, wire.STORAGE)
        assert len(held) == 6 * CHUNK // BLOCK
        out = eng.clear()
        assert out.get("cpu") == 6 and name in out, out
        assert out[name] in (6, None), out  # Mooncake and the daemon count, never list
        assert remote.contains(keys) == [False] * 6, f"{name} kept values past a clear"
        assert len(eng.storage.l1) == 0
        assert theirs.contains(keys) == [True] * 6, "a clear reached another namespace"
        assert all(other.contains_chunks(prompts[0]))
        got = sub.settle(ev.publisher)
        # each block removed from the shared tier's medium, or everything cleared at once
        assert wire.Cleared() in got or _removed(got, wire.STORAGE) == held, got
        assert wire.Cleared() in got or _removed(got, wire.CPU) == held, got
        sub.close()
