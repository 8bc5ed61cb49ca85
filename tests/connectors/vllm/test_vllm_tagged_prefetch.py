"""A salted (or LoRA) vLLM request that the load policy recomputes by choice is prefetched in
its own chain while it waits, then decided again and loaded from L1, bit-exact (no vLLM
needed): vLLM's scheduler half (:class:`SchedulerSide`, on the fake vLLM requests of
``test_vllm_parts``) asks a real CacheEngine over L1 and a real disk tier through the real
lookup socket (``LMU2``), in this process and from a second one; the prompt is also stored
plain and under another salt, and those chains stay on disk.

The policy's speeds are given (a disk read far slower than computing the prompt), so the
split is the rule's, not a measurement's: everything on disk is recomputed by choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.connectors.core.load_policy import Costs, LoadPolicy
from lmc.connectors.core.lookup_service import (
    LookupClient,
    LookupServer,
    engine_lookup,
    engine_prefetch,
)
from lmc.connectors.core.scheduler import ConnectorConfig
from lmc.connectors.core.worker import WorkerConnector, slot_mapping
from lmc.connectors.vllm.lookup import socket_paths
from lmc.connectors.vllm.scheduler import SchedulerSide
from lmc.storage.speeds import PrefillRate, TierRate
from lmc.token_database import request_root, request_tag
from tests import lookup_sockets
from tests.connectors.core.test_worker_side import step
from tests.connectors.vllm.test_vllm_parts import FakeRequest, NewReq, Output
from tests.kvutil import assert_bits_equal, make_caches, random_tokens, spec_for, token_kv

CS, BS, LAYERS = 8, 4, 3
N = 5 * CS + 3  # 5 chunks and a partial tail
PROMPT = random_tokens(N, seed=12)
SALTS: dict[str, str | None] = {"plain": None, "A": "tenant-a", "B": "tenant-b"}
sock_dir = lookup_sockets.sock_dir  # the fixture
REPO = Path(__file__).resolve().parents[3]


def slow_disk(bytes_per_token: float) -> Costs:
    """L1 fast, the disk far too slow to be worth reading: what it holds is recomputed."""
    return Costs((TierRate("cpu", 8e9), TierRate("disk", 1e3, overlaps=False)),
                 PrefillRate(0.0, 1e-4), bytes_per_token, LAYERS)


def fields(name: str) -> dict[str, Any]:
    salt = SALTS[name]
    return {} if salt is None else {"cache_salt": salt}


def wait_for_redecision(sched: SchedulerSide, req: FakeRequest, timeout: float = 30.0
                        ) -> int:
    """Ask again, as vLLM does each step while the request waits, until the answer moves
    (the prefetch landed and the request was decided afresh)."""
    deadline = time.monotonic() + timeout
    while True:
        hit, is_async = sched.get_num_new_matched_tokens(req, 0)
        assert not is_async
        if hit:
            return int(hit or 0)
        assert time.monotonic() < deadline, "the prefetch never landed"
        time.sleep(0.01)


class Instance:
    """One vLLM engine's two halves over one CacheEngine (L1 and a disk tier), a saving
    worker per chain (caches of its own: each chain's KV differs) and a loading worker."""

    def __init__(self, sock_dir: Path, disk: Path, use_local: bool) -> None:
        self.src = {name: make_caches("vllm_flash", layers=LAYERS, blocks=64, block_size=BS,
                                      seed=i + 3) for i, name in enumerate(SALTS)}
        self.dst = make_caches("vllm_flash", layers=LAYERS, blocks=64, block_size=BS,
                               zeros=True)
        self.spec = spec_for("vllm_flash", self.dst)
        self.engine = CacheEngine(CacheConfig(chunk_size=CS, local_cpu_size="8MiB",
                                              local_disk=str(disk)), self.spec, "m")
        (path,) = socket_paths(sock_dir, "tagged-prefetch", 0, 1)
        self.server = LookupServer(path, engine_lookup(lambda: self.engine),
                                   prefetch=engine_prefetch(lambda: self.engine))
        self.client = LookupClient([path], 5.0, use_local=use_local)
        self.policy = LoadPolicy(lambda: slow_disk(self.engine.bytes_per_token))
        self.sched = SchedulerSide(ConnectorConfig(chunk_size=CS), self.client, self.policy)
        self.savers = {name: WorkerConnector(self.engine, src, BS)
                       for name, src in self.src.items()}
        self.loader = WorkerConnector(self.engine, self.dst, BS)
        self.table = list(range(-(-N // BS)))
        self.n = 0

    def close(self) -> None:
        self.sched.close()
        self.server.close()
        for w in (*self.savers.values(), self.loader):
            w.close()
        self.engine.close()

    def keys(self, name: str) -> list[bytes]:
        db = self.engine.db
        tag = request_tag(None, SALTS[name]) if SALTS[name] is not None else None
        return db.keys(PROMPT, root=request_root(db.namespace, tag))

    def in_l1(self) -> dict[str, int]:
        return {name: sum(self.engine.storage.l1_contains(self.keys(name))) for name in SALTS}

    def run_step(self, req: FakeRequest, hit: int, worker: WorkerConnector) -> set[int]:
        self.sched.update_state_after_alloc(req, hit)
        meta = self.sched.build_meta(Output([NewReq(req.request_id, (self.table,), hit)],
                                            num_scheduled_tokens={req.request_id: N - hit}))
        errors = step(worker, meta)
        self.sched.request_finished(req)
        return errors

    def store_all_on_disk_only(self) -> None:
        for name in SALTS:
            self.n += 1
            req = FakeRequest(f"save{self.n}", list(PROMPT), **fields(name))
            hit, _ = self.sched.get_num_new_matched_tokens(req, 0)
            assert hit == 0
            assert not self.run_step(req, 0, self.savers[name])
        assert self.engine.flush(30)
        for name in SALTS:  # as L1's eviction would leave them
            self.engine.storage.l1.delete(self.keys(name))
        assert self.in_l1() == {"plain": 0, "A": 0, "B": 0}

    def kv(self, caches: Any) -> torch.Tensor:
        slots = torch.from_numpy(slot_mapping(tuple(self.table), BS, N, 0, N))
        return token_kv(self.spec, caches, slots)[:, :, :N - 1]


@pytest.fixture(params=["socket", "in-process"])
def inst(request, sock_dir, tmp_path):
    i = Instance(sock_dir, tmp_path / "disk", use_local=request.param == "in-process")
    yield i
    i.close()


@pytest.mark.parametrize("name", ["A", "B", "plain"])
def test_recomputed_by_choice_then_prefetched_in_its_own_chain_and_loaded(inst, name):
    inst.store_all_on_disk_only()
    req = FakeRequest("waiting", list(PROMPT), **fields(name))
    hit, _ = inst.sched.get_num_new_matched_tokens(req, 0)
    assert hit == 0, "everything is on the slow disk: recomputed by choice"
    assert inst.sched.core.stats.prefetches == 1
    assert wait_for_redecision(inst.sched, req) == N - 1  # all of it, from L1 now
    assert inst.sched.core.stats.redecisions == 1
    assert inst.in_l1() == {n: (6 if n == name else 0) for n in SALTS}, \
        "its own chain's chunks, never the plain chain's or another salt's"
    reads = inst.engine.stats().get("disk.get_hits", 0)
    assert not inst.run_step(req, N - 1, inst.loader)
    assert inst.engine.stats().get("disk.get_hits", 0) == reads, "loaded from L1"
    assert_bits_equal(inst.kv(inst.dst), inst.kv(inst.src[name]), f"chain {name}")
    other = "B" if name != "B" else "A"
    assert not torch.equal(inst.kv(inst.dst), inst.kv(inst.src[other]))


def test_a_salt_nobody_stored_prefetches_nothing(inst):
    inst.store_all_on_disk_only()
    req = FakeRequest("stranger", list(PROMPT), cache_salt="tenant-c")
    hit, _ = inst.sched.get_num_new_matched_tokens(req, 0)
    assert hit == 0 and inst.sched.core.stats.prefetches == 0  # a miss: nothing held
    # a prefetch asked anyway (a scheduler bug, a forged request) pulls nothing
    got = inst.client.prefetch(PROMPT, 0, request_tag(None, "tenant-c"))
    assert got is not None
    deadline = time.monotonic() + 30
    while not got.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert inst.in_l1() == {"plain": 0, "A": 0, "B": 0}


@pytest.mark.parametrize("use_local", [False, True], ids=["socket", "in-process"])
def test_every_rank_pulls_its_own_roots_chain(sock_dir, tmp_path, use_local):
    """Tensor-parallel ranks key by namespaces of their own (the rank is in it), so the same
    tag has a different root on each: a tagged prefetch goes to every rank, and each pulls
    the chain of its own root for the tag."""
    tag = request_tag("adapter-x", None)
    engines, servers = [], []
    for rank in range(2):
        src = make_caches("vllm_flash", layers=LAYERS, blocks=64, block_size=BS, seed=rank)
        eng = CacheEngine(CacheConfig(chunk_size=CS, local_cpu_size="8MiB",
                                      local_disk=str(tmp_path / f"d{rank}")),
                          spec_for("vllm_flash", src), "m", rank, 2)
        engines.append(eng)
        slots = torch.arange(N) + 4
        for t in (None, tag):
            keys = eng.db.keys(PROMPT, root=request_root(eng.db.namespace, t))
            assert eng.store(PROMPT, src, slots, keys=keys) == N
        assert eng.flush(30)
    roots = [request_root(e.db.namespace, tag) for e in engines]
    assert roots[0] != roots[1]
    keys = [(e.db.keys(PROMPT, root=r), e.db.keys(PROMPT)) for e, r in zip(engines, roots)]
    for e, (tagged, plain) in zip(engines, keys):
        e.storage.l1.delete(tagged)
        e.storage.l1.delete(plain)
    paths = socket_paths(sock_dir, "tp2", 0, 2)
    for p, e in zip(paths, engines):
        servers.append(LookupServer(p, engine_lookup(lambda e=e: e),
                                    prefetch=engine_prefetch(lambda e=e: e)))
    client = LookupClient(paths, 5.0, use_local=use_local)
    try:
        got = client.prefetch(PROMPT, 2 * CS, tag)
        assert got is not None and bool(got.futures) == use_local
        deadline = time.monotonic() + 30
        while not got.done():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for e, (tagged, plain) in zip(engines, keys):
            assert e.storage.l1_contains(tagged) == [False] * 2 + [True] * 4
            assert not any(e.storage.l1_contains(plain))
        found = client.lookup(PROMPT, tag)
        assert found.tokens == N and list(found.sources) == [1, 1, 0, 0, 0, 0]
    finally:
        client.close()
        for s in servers:
            s.close()
        for e in engines:
            e.close()


def test_a_rank_in_a_second_process_prefetches_the_tagged_chain(sock_dir, tmp_path):
    """The scheduler here, the rank's CacheEngine in a child process: the waiting salted
    request's prefetch crosses the socket as ``LMU2``, the child pulls salt A's chain only,
    and a load of it there is an L1 hit, bit-exact."""
    from tests.connectors.core import test_tagged_prefetch as rank

    (path,) = socket_paths(sock_dir, "second-process", 0, 1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = subprocess.Popen([sys.executable, "-m", "tests.connectors.vllm.tagged_prefetch_rank",
                              path, str(tmp_path / "disk")], cwd=REPO, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None

    def ask(line: str) -> str:
        child.stdin.write(line + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    client = LookupClient([path], 5.0, use_local=False)
    try:
        assert child.stdout.readline().strip() == "ready"
        costs = slow_disk(2 * LAYERS * 2 * 8 * 4)  # the child's caches: 384 bytes a token
        sched = SchedulerSide(ConnectorConfig(chunk_size=rank.CS), client,
                              LoadPolicy(lambda: costs))
        req = FakeRequest("waiting", list(rank.PROMPT), cache_salt="tenant-a")
        hit, _ = sched.get_num_new_matched_tokens(req, 0)
        assert hit == 0 and sched.core.stats.prefetches == 1
        assert wait_for_redecision(sched, req) == rank.N - 1
        assert json.loads(ask("l1")) == {"plain": 0, "A": 6, "B": 0}
        assert ask("load A") == "exact from L1"
    finally:
        client.close()
        child.stdin.close()
        child.wait(timeout=30)
    assert child.returncode == 0
