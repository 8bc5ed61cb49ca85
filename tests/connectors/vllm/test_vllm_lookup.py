"""vLLM's use of the lookup service (no vLLM needed): one socket per rank, and the scheduler
half's cache-hit sources coming from the workers' own lookup answers over real sockets."""

from __future__ import annotations

import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.connectors.core.lookup_service import LookupClient, LookupServer, engine_lookup
from lmc.connectors.core.scheduler import ConnectorConfig
from lmc.connectors.vllm.lookup import socket_paths
from lmc.connectors.vllm.scheduler import SchedulerSide
from tests import lookup_sockets
from tests.kvutil import make_caches, spec_for

CS = 16
sock_dir = lookup_sockets.sock_dir  # the fixture


def test_socket_paths_are_short_and_per_rank():
    eid = "8dcf2909-6202-40f1-8cce-9a378f64636a"
    a = socket_paths("/tmp", eid, 0, 2)
    b = socket_paths("/tmp", eid, 1, 2)
    assert len({*a, *b}) == 4 and all(len(p) < 100 for p in a + b)
    assert socket_paths("/tmp", eid, 0, 2) == a, "the scheduler and the workers must agree"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        socket_paths("/tmp", eid, 0, 0)


class Request:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id = rid
        self.all_token_ids = tokens
        self.prompt_token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.sampling_params = None
        self.kv_transfer_params = None


def test_hit_sources_come_from_the_workers_answer(sock_dir, tmp_path):
    """Two ranks' engines served over sockets: the scheduler's HOST/lower split is the
    minimum of their attributed answers (a chunk is in host memory only if every rank has
    it there), with no second lookup."""
    src = make_caches("vllm_flash", blocks=64, block_size=4, seed=5)
    spec = spec_for("vllm_flash", src)
    toks = torch.randint(0, 30000, (5 * CS,), generator=torch.Generator().manual_seed(1))
    toks = toks.tolist()
    slots = torch.arange(5 * CS)
    engines = []
    for rank in range(2):
        cfg = CacheConfig(chunk_size=CS, local_cpu_size="2MiB",
                          local_disk=str(tmp_path / f"r{rank}"))
        eng = CacheEngine(cfg, spec, "m", rank, 2)
        eng.store(toks, src, slots)
        assert eng.flush(10)
        eng.storage.l1.delete(eng.db.keys(toks)[1 + rank:])  # rank 0: 1 chunk in L1, rank 1: 2
        engines.append(eng)
    paths = socket_paths(sock_dir, "engine", 0, 2)
    servers = [LookupServer(p, engine_lookup(lambda e=e: e)) for p, e in zip(paths, engines)]
    side = SchedulerSide(ConnectorConfig(chunk_size=CS), LookupClient(paths, 2, use_local=False))
    try:
        req = Request("r", toks)
        assert side.get_num_new_matched_tokens(req, 0) == (5 * CS - 1, False)
        side.update_state_after_alloc(req, 5 * CS - 1)
        assert side.hit_sources(req, 5 * CS - 1) == (CS, 4 * CS - 1)
        assert sum(s.requests for s in servers) == 2, "one lookup per rank, nothing more"
        stats = side.stats()
        assert stats["lookup.lookups"] == 1 and stats["lookup.rank_failures"] == 0
    finally:
        side.close()
        for s in servers:
            s.close()
        for e in engines:
            e.close()
