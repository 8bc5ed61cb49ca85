"""A tagged request's prefetch (a LoRA adapter, a ``cache_salt``) pulls its own chain: one real
CacheEngine over L1 and a real disk tier holds the same prompt three times -- plain, salt A,
salt B, each with KV of its own -- all on disk only; a prefetch with a tag brings exactly that
chain's chunks into L1, never the plain chain's or another tag's, and a load of them is then
an L1 hit, bit-exact. Through the engine, the lookup service's prefetch function, the vLLM
worker's and the reference connector's (the per-rank root is computed where the rank's
namespace is known: :func:`lmc.connectors.core.lookup_service.engine_root`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.connectors.core.lookup_service import engine_prefetch, engine_root
from lmc.connectors.reference import LMCReferenceConnector
from lmc.connectors.vllm.worker import WorkerSide
from lmc.token_database import request_root, request_tag
from tests.kvutil import assert_bits_equal, make_caches, random_tokens, spec_for, token_kv

CS = 16
N = 5 * CS + 5  # five chunks and a partial tail
A = request_tag(None, "tenant-a")
B = request_tag(None, "tenant-b")
C = request_tag("nobody-stored-this", None)
CHAINS: dict[str, bytes | None] = {"plain": None, "A": A, "B": B}
PROMPT = random_tokens(N, seed=21)
SLOTS = torch.arange(N) + 4


class Stored:
    """The engine and, per chain, the source caches its KV came from and its keys."""

    def __init__(self, disk: Path) -> None:
        self.src = {name: make_caches("vllm_flash", blocks=32, block_size=4, seed=i + 1)
                    for i, name in enumerate(CHAINS)}
        self.spec = spec_for("vllm_flash", self.src["plain"])
        self.engine = CacheEngine(CacheConfig(chunk_size=CS, local_cpu_size="4MiB",
                                              local_disk=str(disk)), self.spec, "m")
        db = self.engine.db
        self.keys = {name: db.keys(PROMPT, root=request_root(db.namespace, tag))
                     for name, tag in CHAINS.items()}
        for name in CHAINS:
            assert self.engine.store(PROMPT, self.src[name], SLOTS,
                                     keys=self.keys[name]) == N
        assert self.engine.flush(30)
        for keys in self.keys.values():  # on disk only, as L1's eviction would leave them
            self.engine.storage.l1.delete(keys)
        assert self.in_l1() == {name: 0 for name in CHAINS}

    def in_l1(self) -> dict[str, int]:
        """Chunks of each chain L1 holds."""
        return {name: sum(self.engine.storage.l1_contains(keys))
                for name, keys in self.keys.items()}

    def disk_reads(self) -> int:
        return int(self.engine.stats().get("disk.get_hits", 0))  # absent until a read

    def assert_loads_from_l1(self, name: str) -> None:
        """The chain's KV loads bit-exact, every chunk from L1 (the disk is not read)."""
        before = self.disk_reads()
        dst = make_caches("vllm_flash", blocks=32, block_size=4, zeros=True)
        assert self.engine.retrieve(PROMPT, dst, SLOTS, keys=self.keys[name]) == N
        assert self.disk_reads() == before, "served from L1"
        assert_bits_equal(token_kv(self.spec, dst, SLOTS),
                          token_kv(self.spec, self.src[name], SLOTS), f"chain {name}")


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[Stored]:
    s = Stored(tmp_path / "disk")
    yield s
    s.engine.close()


def test_the_three_chains_hold_different_kv(stored: Stored) -> None:
    """(else the bit-exact checks below could not tell one chain's KV from another's)"""
    kv = {n: token_kv(stored.spec, stored.src[n], SLOTS) for n in CHAINS}
    assert not torch.equal(kv["A"], kv["B"]) and not torch.equal(kv["A"], kv["plain"])


@pytest.mark.parametrize("name", ["A", "B", "plain"])
def test_an_engine_prefetch_with_a_root_pulls_that_chain_only(stored: Stored, name: str
                                                               ) -> None:
    db = stored.engine.db
    root = None if CHAINS[name] is None else request_root(db.namespace, CHAINS[name])
    assert stored.engine.prefetch(PROMPT, 0, root=root).result(timeout=30) == N
    assert stored.in_l1() == {n: (6 if n == name else 0) for n in CHAINS}
    stored.assert_loads_from_l1(name)


def test_a_prefetch_from_a_position_pulls_the_rest_of_its_chain(stored: Stored) -> None:
    root = request_root(stored.engine.db.namespace, A)
    assert stored.engine.prefetch(PROMPT, 2 * CS + 1, root=root).result(timeout=30) == N
    assert list(stored.engine.storage.l1_contains(stored.keys["A"])) == [False] * 2 + [True] * 4
    assert stored.in_l1()["B"] == stored.in_l1()["plain"] == 0


def test_a_tag_nobody_stored_pulls_nothing(stored: Stored) -> None:
    reads = stored.disk_reads()
    pull = engine_prefetch(lambda: stored.engine)
    assert pull(PROMPT, 0, C).result(timeout=30) == 0
    assert stored.in_l1() == {name: 0 for name in CHAINS}
    assert stored.disk_reads() == reads


def test_the_lookup_services_prefetch_function_keys_by_the_ranks_root(stored: Stored) -> None:
    pull = engine_prefetch(lambda: stored.engine)
    assert pull(PROMPT, 0, B).result(timeout=30) == N
    assert stored.in_l1() == {"plain": 0, "A": 0, "B": 6}
    assert engine_root(stored.engine, None) is None  # plain: the namespace's own chain
    assert engine_root(stored.engine, B) == request_root(stored.engine.db.namespace, B)
    assert engine_prefetch(lambda: None)(PROMPT, 0, B) is None  # no engine yet: refused


def test_the_vllm_workers_prefetch_passes_the_tag_through(stored: Stored) -> None:
    side = WorkerSide(stored.engine.config, "m", 0, 1, 4, True, "/nonexistent.sock")
    assert side.prefetch(PROMPT, 0, A) is None  # before register_kv_caches: no engine
    side.engine = stored.engine  # what register() makes (the layout needs vLLM's caches)
    assert side.prefetch(PROMPT, 0, A).result(timeout=30) == N
    assert stored.in_l1() == {"plain": 0, "A": 6, "B": 0}
    stored.assert_loads_from_l1("A")
    side.engine = None  # the fixture closes the engine


def test_the_reference_connectors_prefetch_passes_the_tag_through(stored: Stored) -> None:
    conn = LMCReferenceConnector(stored.engine.config, model_id="m",
                                 cache_engine=stored.engine)
    assert conn._prefetch(PROMPT, 0, A).result(timeout=30) == N
    assert conn._prefetch(PROMPT, 0, None).result(timeout=30) == N
    assert stored.in_l1() == {"plain": 6, "A": 6, "B": 0}
    stored.assert_loads_from_l1("A")
    stored.assert_loads_from_l1("plain")
    conn.shutdown()  # leaves the given engine open
