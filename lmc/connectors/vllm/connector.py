"""lmc for vLLM: ``LMCConnector``, a ``KVConnectorBase_V1`` loaded by module path::

    --kv-transfer-config '{"kv_connector": "LMCConnector",
                           "kv_connector_module_path": "lmc.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"lmc.config_file": "configs/vllm.yaml"}}'

A thin translation: each vLLM hook is one call on the engine-agnostic core
(:mod:`lmc.connectors.core.scheduler`), through two halves that vLLM builds in different processes:

* role SCHEDULER (EngineCore process): :class:`~lmc.connectors.vllm.scheduler.SchedulerSide`
  answers ``get_num_new_matched_tokens`` by asking the workers' lookup servers over Unix
  sockets (minimum over tensor-parallel ranks, bounded by ``vllm.lookup_timeout``; why a
  socket: :mod:`lmc.connectors.core.lookup_service`), tracks admitted requests and turns each
  ``SchedulerOutput`` into the core's picklable metadata.
* role WORKER (each worker process): :class:`~lmc.connectors.vllm.worker.WorkerSide` owns
  the rank's ``CacheEngine`` (L1 pool, disk, remote tiers), loads hits layer by layer
  (``start_load_kv`` / ``wait_for_layer_load``), gathers new chunks layer by layer
  (``save_kv_layer``) and commits them in ``wait_for_save``, and reports failed loads as
  block ids so vLLM recomputes them.

``kv_role``: ``kv_producer`` saves only, ``kv_consumer`` loads only, ``kv_both`` does both.
Prefill/decode disaggregation (``lmc pd-proxy``): a request sent to a producer with
``kv_transfer_params: {"do_remote_decode": true}`` comes back with the parameters a consumer
needs (:func:`~lmc.connectors.vllm.scheduler.producer_params`); a consumer given them
reports the prompt as an *asynchronous* hit (``(n, True)``), its worker pulls the chunks in
the background (over the P2P tier, from the producer's pool) and reports them through
``get_finished``; what does not arrive within ``vllm.remote_prefill_wait`` is reported
through ``get_block_ids_with_load_errors`` and recomputed.
The KV layout is detected from the tensors and the attention backend, and anything lmc
cannot address exactly is refused at start-up (:mod:`lmc.connectors.vllm.layout`).
Loads are synchronous to the step (layer-wise overlapped with compute), so vLLM schedules
a hit request at once; a failed load makes vLLM recompute (lmc switches
``kv_load_failure_policy`` to "recompute": it is a cache, a lost chunk must not fail a
request).

Hybrid models (sliding-window layers beside full attention): the connector declares
``SupportsHMA``, so vLLM keeps its hybrid memory allocator on (a sliding-window layer holds
only its window's blocks); every KV cache group's block ids reach lmc
(``request_finished_all_groups``, the scheduler output's per-group tables) and each group is
stored and loaded as its kind needs (:mod:`lmc.hybrid`, :mod:`lmc.connectors.vllm.groups`).
vLLM refuses block-level load errors with several groups (its scheduler raises), so a hybrid
model's loads are asynchronous: loaded, layer by layer and every group, before the request
is scheduled, and a load that comes up short is reported as a failed receive (vLLM then
recomputes the request).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmc.connectors.core.load_policy import Costs, LoadPolicy, local_costs, register_local
from lmc.connectors.core.lookup_service import LookupClient
from lmc.connectors.core.metadata import ConnectorMetadata
from lmc.connectors.core.model_id import engine_model_id
from lmc.connectors.core.scheduler import ConnectorConfig
from lmc.connectors.vllm.extra_config import load_settings, per_rank_disks
from lmc.connectors.vllm.groups import group_kinds
from lmc.connectors.vllm.layout import (
    UnsupportedLayout,
    check_cache_dtype,
    check_version,
    resolve_cpu,
    resolve_gpu,
)
from lmc.connectors.vllm.lookup import socket_paths
from lmc.connectors.vllm.scheduler import SchedulerSide
from lmc.connectors.vllm.stats import LMCConnectorStats, LMCPromMetrics
from lmc.connectors.vllm.worker import WorkerSide, tensors_by_name
from lmc.storage.chain import chain_media
from lmc.storage.tier import Medium

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _share_vllm_logging() -> None:
    """Show lmc's logs (start-up, refusals, failed loads) in vLLM's log stream: vLLM
    configures handlers for its own logger only."""
    lmc_log, vllm_log = logging.getLogger("lmc"), logging.getLogger("vllm")
    if lmc_log.handlers or not vllm_log.handlers:
        return
    for h in vllm_log.handlers:
        lmc_log.addHandler(h)
    lmc_log.setLevel(logging.INFO)
    lmc_log.propagate = False


_share_vllm_logging()

__all__ = ["LMCConnector", "LMCConnectorMetadata", "LMCConnectorStats"]


class LMCConnectorMetadata(KVConnectorMetadata):
    """The core's per-step plan, wrapped in vLLM's metadata type (it is pickled to the
    workers as is)."""

    def __init__(self, meta: ConnectorMetadata) -> None:
        self.meta = meta


def _model_id(vllm_config: VllmConfig, explicit: str | None, revision: str | None) -> str:
    """The key namespace's model identity (:mod:`lmc.connectors.core.model_id`'s rule): the
    operator's ``lmc.vllm.model_id``, else the checkpoint's bytes (a hub name resolves through
    the local cache; ``lmc.model_revision`` stands in for the bytes), else name@revision."""
    mc = vllm_config.model_config
    return engine_model_id(str(mc.model), explicit=explicit, revision=revision,
                           hub_revision=mc.revision, setting="lmc.vllm.model_id")


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # distributed state not initialised (single process)
        return 0


_HIT_SOURCE: dict[Medium | None, CacheHitSource] = {
    Medium.MEMORY: CacheHitSource.HOST, Medium.LOCAL_STORAGE: CacheHitSource.DISK,
    Medium.PEER: CacheHitSource.P2P, Medium.REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED}
"""vLLM's cache-hit source for each declared tier medium (unknown: external, unspecified)."""


class LMCConnector(KVConnectorBase_V1, SupportsHMA):
    """lmc's vLLM connector; see the module docstring."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        settings = load_settings(ktc.kv_connector_extra_config)
        self.settings = settings
        opts = settings.vllm
        try:
            check_version(vllm.__version__, opts.allow_untested)
            pc = vllm_config.parallel_config
            if pc.pipeline_parallel_size > 1:
                raise UnsupportedLayout("pipeline parallelism: lmc keys KV per tensor-parallel "
                                        "rank over all layers; pipeline stages are not "
                                        "supported")
            kinds = group_kinds(kv_cache_config)  # refuses what lmc cannot serve, by name
        except UnsupportedLayout as e:
            raise RuntimeError(f"lmc connector refused to start: {e}") from e
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        block_size = (groups[0].kv_cache_spec.block_size if groups
                      else vllm_config.cache_config.block_size)
        self.hybrid = len(groups) > 1
        if self.hybrid and role == KVConnectorRole.SCHEDULER:
            hma_off = vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
            log.info("lmc: hybrid model, KV cache groups %s; vLLM's hybrid memory allocator "
                     "is %s", ", ".join(k if k == "full" else f"{k}({w})" for k, w, _ in kinds),
                     "off" if hma_off else "on")
        self.connector_config = ConnectorConfig.from_cache_config(
            settings.cache, load=ktc.is_kv_consumer, save=ktc.is_kv_producer,
            save_decode=opts.save_decode, layerwise=opts.layerwise, async_loads=self.hybrid)
        dp_rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        paths = socket_paths(opts.lookup_dir, str(ktc.engine_id), dp_rank, tp_size)
        self._scheduler: SchedulerSide | None = None
        self._media: dict[str, Medium] | None = None  # tier name -> medium, read when needed
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if opts.recompute_on_load_error and ktc.kv_load_failure_policy == "fail":
                ktc.kv_load_failure_policy = "recompute"
                log.info("lmc: kv_load_failure_policy set to 'recompute' (a chunk lost or "
                         "corrupt after the lookup is recomputed, not a failed request)")
            # load or recompute: decided from rank 0's measured speeds, read directly where
            # it lives in this process (vLLM's uni-process executor), else over its socket
            client = LookupClient(paths, opts.lookup_timeout)
            sched = vllm_config.scheduler_config
            policy = LoadPolicy(local_costs(paths, remote=client.costs),
                                enabled=settings.cache.load_policy == "auto",
                                step_tokens=(int(sched.max_num_batched_tokens)
                                             if getattr(sched, "enable_chunked_prefill", True)
                                             else 0))
            self._scheduler = SchedulerSide(self.connector_config, client, policy,
                                            groups=len(groups))
        else:
            rank = _tp_rank()
            cache = per_rank_disks(settings.cache, rank, tp_size)
            model_id = _model_id(vllm_config, opts.model_id, cache.model_revision)
            self._worker = WorkerSide(cache, model_id, rank, tp_size, block_size, opts.layerwise,
                                      paths[rank], remote_wait=opts.remote_prefill_wait,
                                      model_shape=getattr(vllm_config.model_config,
                                                          "hf_text_config", None),
                                      kv_cache_config=kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never lost data

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # layer-wise waits and saves must run between graph pieces

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        w = self._require_worker()
        cfg = self._vllm_config
        tensors = tensors_by_name(kv_caches)
        if not tensors:
            raise RuntimeError("lmc connector refused to start: vLLM registered no KV tensors")
        group_of = {name: i for i, g in enumerate(
            getattr(self._kv_cache_config, "kv_cache_groups", None) or [])
            for name in g.layer_names}
        try:
            check_cache_dtype(str(cfg.cache_config.cache_dtype))
            backend = self._backend_name(list(tensors))
            if backend == "CPU_ATTN":
                from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
                t0 = next(iter(tensors.values()))
                isa = _get_attn_isa(t0.dtype, t0.shape[2], t0.shape[3] // 2,
                                    str(cfg.cache_config.cache_dtype))
                choice = resolve_cpu(tensors, isa, group_of)
            else:
                choice = resolve_gpu(tensors, backend, self.settings.vllm.allow_untested,
                                     kv_cache_layout=cfg.cache_config.kv_cache_layout,
                                     head_size=cfg.model_config.get_head_size(),
                                     group_of=group_of)
        except UnsupportedLayout as e:
            raise RuntimeError(f"lmc connector refused to start: {e}") from e
        w.register(choice)
        register_local(w.socket_path, self._local_costs)

    def _local_costs(self) -> Costs | None:
        """This worker's measured speeds, for a scheduler in the same process."""
        return self._worker.costs() if self._worker is not None else None

    def _backend_name(self, names: list[str]) -> str:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        layers = get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase, names)
        found = {layer.get_attn_backend().get_name() for layer in layers.values()}
        if len(found) != 1:
            raise UnsupportedLayout(f"attention backends {sorted(found) or 'none'} for the "
                                    "KV layers: lmc needs exactly one")
        return found.pop()

    def _require_worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError(f"worker-side call on the {self._role.name} connector")
        return self._worker

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, LMCConnectorMetadata):
            self._worker.bind(connector_metadata.meta)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(None, requests whose asynchronous load ended): saves never outlive their
        step, so nothing is ever reported as sending."""
        if self._worker is None:
            return None, None
        return None, self._worker.get_finished(finished_req_ids) or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished asynchronous loads, and -- a hybrid model's -- the ones that came up
        short as failed receives (vLLM recomputes those requests: block ids cannot name
        a position across several KV cache groups)."""
        out = super().get_transfer_results(finished_req_ids)
        if self.hybrid and self._worker is not None:
            out.failed_recving = self._worker.take_failed_loads()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        errors = self._worker.take_load_errors()
        if self.hybrid:  # reported as failed receives instead (get_transfer_results)
            return set()
        return errors

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Nothing to do: saves finish within their step, so no save of a preempted
        request is still reading its blocks."""

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        delta = self._worker.stats_delta()
        return LMCConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return LMCConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return LMCPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def stats(self) -> dict[str, Any]:
        """lmc's own counters for this half (scheduler, or worker and cache)."""
        if self._scheduler is not None:
            return self._scheduler.stats()
        return self._worker.stats() if self._worker is not None else {}

    def shutdown(self) -> None:
        if self._worker is not None:
            register_local(self._worker.socket_path, None)
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ========================================================= scheduler side
    def _require_scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError(f"scheduler-side call on the {self._role.name} connector")
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._require_scheduler().get_num_new_matched_tokens(request,
                                                                    num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._require_scheduler().update_state_after_alloc(request, num_external_tokens,
                                                           blocks)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        if num_external_tokens <= 0 or self._scheduler is None:
            return {}
        if self._media is None:
            self._media = chain_media(self.settings.cache)
        out: dict[CacheHitSource, int] = {}
        for medium, n in self._scheduler.hit_media(request, num_external_tokens,
                                                   self._media).items():
            src = _HIT_SOURCE.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + n
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return LMCConnectorMetadata(self._require_scheduler().build_meta(scheduler_output))

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return False, self._scheduler.request_finished(
            request, str(self._kv_transfer_config.engine_id))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``'s form of :meth:`request_finished` (every group's blocks): saves
        are committed within their step, so no group's blocks are held past this."""
        return self.request_finished(request, block_ids[0] if block_ids else [])
