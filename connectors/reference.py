"""lmc for the built-in reference engine: ``LLM(model_dir, lmc_config=...)``.

A thin adapter, and the worked example for wiring lmc into a runtime of your own: each
``KVConnector`` hook becomes one call on the connector core. The reference engine runs its
scheduler and its model in one process, so this one object holds both halves
(:class:`SchedulerConnector` and :class:`WorkerConnector`); they still talk only through the
picklable metadata, exactly as they would across vLLM's process boundary.

The ``CacheEngine`` is created when the engine registers its KV tensors (the ``KVSpec`` is
read off them); the model identity in the key namespace comes from the checkpoint
directory (:func:`lmc.connectors.model_id.model_identity`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lmc.connectors.core import ConnectorConfig, SchedulerConnector
from lmc.connectors.metadata import ConnectorMetadata
from lmc.connectors.model_id import model_identity
from lmc.connectors.worker import WorkerConnector

from lmc.cache_engine import CacheEngine
from lmc.config import CacheConfig
from lmc.kv_spec import KVSpec
from lmc.reference.connector_api import ConnectorRequest, KVConnector
from lmc.reference.scheduler_output import SchedulerOutput
from lmc.storage_backend import StorageBackend
from lmc.transfer import TransferFactory

ConfigLike = CacheConfig | str | os.PathLike | Mapping[str, Any] | None


def load_cache_config(config: ConfigLike) -> CacheConfig:
    """A ``CacheConfig`` from itself, a YAML path, or a dict of keys (``LMC_*`` environment
    variables apply to the last two and to ``None``)."""
    if isinstance(config, CacheConfig):
        return config
    if config is None:
        return CacheConfig.load()
    if isinstance(config, Mapping):
        return CacheConfig.load(overrides=dict(config))
    if isinstance(config, (str, os.PathLike)):
        return CacheConfig.load(config)
    raise TypeError(f"lmc config must be a CacheConfig, a YAML path or a dict, "
                    f"got {type(config).__name__}")


class LMCReferenceConnector(KVConnector):
    """The reference engine's lmc connector.

    Args:
        config: the cache configuration (see :func:`load_cache_config`).
        model_dir: the checkpoint directory, for the model identity.
        model_id: an explicit identity instead (engines sharing KV must agree on it).
        layerwise: overlap each layer's load with the previous layer's compute.
        save_decode: also save chunks completed by generated tokens.
        tiers: extra storage tiers below L1, passed to the ``CacheEngine``.
        cache_engine: use this engine instead of creating one (its spec must match the
            engine's KV cache); it is then not closed by ``shutdown``.
        transfer: the ``CacheEngine``'s transfer choice ("auto", "torch", "cuda", or a
            factory ``(spec, kv_caches) -> KVTransfer``, e.g. a test backend).
    """

    def __init__(self, config: ConfigLike = None, *, model_dir: str | os.PathLike | None = None,
                 model_id: str | None = None, layerwise: bool = True, save_decode: bool = False,
                 tiers: Sequence[StorageBackend] | None = None,
                 cache_engine: CacheEngine | None = None,
                 transfer: str | TransferFactory = "auto") -> None:
        self.cache_config = load_cache_config(config)
        if model_id is None:
            if model_dir is None and cache_engine is None:
                raise ValueError("LMCReferenceConnector needs model_dir or model_id")
            model_id = cache_engine.model_id if model_dir is None else model_identity(model_dir)
        self.model_id = model_id
        self.connector_config = ConnectorConfig.from_cache_config(
            self.cache_config, save_decode=save_decode, layerwise=layerwise)
        self.scheduler = SchedulerConnector(self.connector_config, self._lookup)
        self.engine = cache_engine
        self._owns_engine = cache_engine is None
        self._tiers = tiers
        self._transfer = transfer
        self.worker: WorkerConnector | None = None

    def _lookup(self, token_ids: Sequence[int]) -> int:
        # In-process: the worker's CacheEngine answers directly (vLLM's scheduler process
        # would reach it over IPC instead).
        return 0 if self.engine is None else self.engine.lookup(token_ids)

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int
                                   ) -> int:
        n = self.scheduler.get_num_new_matched_tokens(
            request.request_id, request.all_token_ids, num_computed_tokens)
        return n or 0

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request.request_id, request.all_token_ids,
                                                request.num_computed_tokens, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        return self.scheduler.build_metadata(scheduler_output.scheduled_requests,
                                             scheduler_output.finished_req_ids,
                                             scheduler_output.preempted_req_ids)

    def request_finished(self, request: ConnectorRequest) -> None:
        self.scheduler.request_finished(request.request_id)

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec = KVSpec.from_tensors(kv_caches, "vllm_flash")
        if self.engine is None:
            self.engine = CacheEngine(self.cache_config, spec, self.model_id, tiers=self._tiers,
                                      transfer=self._transfer)
        elif self.engine.spec.namespace_fields() != spec.namespace_fields():
            raise ValueError(f"the given CacheEngine's KV spec {self.engine.spec} does not "
                             f"match the engine's KV cache {spec}")
        if self.worker is not None:
            self.worker.close()
        self.worker = WorkerConnector(self.engine, list(kv_caches.values()), spec.block_size,
                                      layerwise=self.connector_config.layerwise)

    def _require_worker(self) -> WorkerConnector:
        if self.worker is None:
            raise RuntimeError("register_kv_caches() was not called")
        return self.worker

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        worker = self._require_worker()
        worker.bind(meta)
        worker.start_load()

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self._require_worker().wait_for_layer(layer_idx)

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, meta: ConnectorMetadata
                      ) -> None:
        self._require_worker().save_layer(layer_idx)

    def wait_for_save(self) -> None:
        self._require_worker().wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.worker is None else self.worker.take_load_errors()

    # ------------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        """Scheduler, worker and cache counters in one flat dict."""
        out: dict[str, Any] = {f"scheduler.{k}": v for k, v in vars(self.scheduler.stats).items()
                               if k != "extra"}
        if self.worker is not None:
            out.update({f"worker.{k}": v for k, v in self.worker.stats.as_dict().items()})
        if self.engine is not None:
            out.update({f"cache.{k}": v for k, v in self.engine.stats().items()})
        return out

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.engine is not None and self._owns_engine:
            self.engine.close()
