"""The two halves share nothing but pickled metadata (and a lookup call), as they must in
vLLM, where the scheduler side and the worker side live in different processes.

``SplitConnector`` keeps them apart inside the reference engine: the scheduler half sees
token ids and counts only, its lookups travel as pickled bytes to the worker's cache, and the
worker half only ever receives an unpickled copy of each step's metadata.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from lmc.cache_engine import CacheEngine
from lmc.config import CacheConfig
from lmc.connectors.core.metadata import ConnectorMetadata
from lmc.connectors.core.model_id import model_identity
from lmc.connectors.core.scheduler import ConnectorConfig, SchedulerConnector
from lmc.connectors.core.worker import WorkerConnector
from lmc.reference import LLM, KVConnector
from lmc.transfer.kv_spec import KVSpec
from tests.connectors.reference.helpers import BLOCK, assert_same, plain_llm, prompt, run


class SplitConnector(KVConnector):
    def __init__(self, model_dir: Path, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.model_id = model_identity(model_dir)
        self.scheduler = SchedulerConnector(ConnectorConfig.from_cache_config(cfg),
                                            self._rpc_lookup)
        self.worker: WorkerConnector | None = None
        self.wire_bytes = 0

    # the "IPC": bytes only
    def _rpc_lookup(self, tokens: Any) -> int:
        request = pickle.dumps(list(tokens))
        self.wire_bytes += len(request)
        return pickle.loads(pickle.dumps(self.worker.engine.lookup(pickle.loads(request))))

    # scheduler process
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.scheduler.get_num_new_matched_tokens(
            request.request_id, list(request.all_token_ids), num_computed_tokens) or 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.scheduler.update_state_after_alloc(request.request_id, list(request.all_token_ids),
                                                request.num_computed_tokens, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> bytes:
        meta = self.scheduler.build_metadata(scheduler_output.scheduled_requests,
                                             scheduler_output.finished_req_ids,
                                             scheduler_output.preempted_req_ids)
        wire = pickle.dumps(meta)
        self.wire_bytes += len(wire)
        return wire

    def request_finished(self, request) -> None:
        self.scheduler.request_finished(request.request_id)

    # worker process
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec = KVSpec.from_tensors(kv_caches, "vllm_flash")
        engine = CacheEngine(self.cfg, spec, self.model_id)
        self.worker = WorkerConnector(engine, list(kv_caches.values()), spec.block_size)

    def start_load_kv(self, meta: bytes) -> None:
        received = pickle.loads(meta)
        assert isinstance(received, ConnectorMetadata)
        self.worker.bind(received)
        self.worker.start_load()

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.worker.wait_for_layer(layer_idx)

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, meta: bytes) -> None:
        self.worker.save_layer(layer_idx)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        self.worker.engine.close()


def test_halves_talk_only_through_pickled_metadata(tiny_dir: Path) -> None:
    cfg = CacheConfig(chunk_size=32, local_cpu_size="32MiB")
    conn = SplitConnector(tiny_dir, cfg)
    kw = {"num_blocks": 128, "block_size": BLOCK, "max_num_batched_tokens": 64}
    llm = LLM(tiny_dir, kv_connector=conn, **kw)
    base = plain_llm(tiny_dir, **kw)
    long, other = prompt(30, 200), prompt(31, 90)
    want = run(base, [long, other])
    assert_same(run(llm, [long, other]), want)
    got = run(llm, [long, other])
    assert [g.num_cached_tokens for g in got] == [199, 89]
    assert_same(got, want)
    assert conn.wire_bytes > 0
    # nothing on the scheduler side refers to tensors or to the cache engine
    state = {k: v for k, v in vars(conn.scheduler).items() if k != "_lookup"}
    assert pickle.loads(pickle.dumps(state))["_hits"] == {}
    llm.close()
