"""lmc for the built-in reference engine: ``LLM(model_dir, lmc_config=...)``.

A thin adapter, and the worked example for wiring lmc into a runtime of your own: each
``KVConnector`` hook becomes one call on the connector core. The reference engine runs its
scheduler and its model in one process, so this one object holds both halves
(:class:`SchedulerConnector` and :class:`WorkerConnector`); they still talk only through the
picklable metadata, exactly as they would across vLLM's process boundary.

The ``CacheEngine`` is created when the engine registers its KV tensors (the ``KVSpec`` is
read off them); the model identity in the key namespace comes from the checkpoint
directory (:func:`lmc.connectors.core.model_id.model_identity`: every byte of the weights,
or the ``model_revision`` setting).

``kv_role`` as in vLLM: ``kv_producer`` saves only and answers a request sent with
``kv_transfer_params={"do_remote_decode": True}`` with the parameters a consumer needs
(:mod:`lmc.connectors.core.pd_params`); ``kv_consumer`` loads only, and a request carrying a
producer's parameters is an asynchronous load (the engine holds it while the worker pulls
the prompt from the producer's pool in the background).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lmc.cache_engine import CacheEngine
from lmc.config import CacheConfig
from lmc.connectors.core.compute_floor import compute_floor
from lmc.connectors.core.hints import parse_hints
from lmc.connectors.core.load_policy import Costs, LoadPolicy
from lmc.connectors.core.lookup_service import engine_root
from lmc.connectors.core.metadata import ConnectorMetadata
from lmc.connectors.core.model_id import model_identity
from lmc.connectors.core.pd_params import (
    producer_params,
    remote_prefill_tokens,
    wants_remote_decode,
)
from lmc.connectors.core.scheduler import ConnectorConfig, SchedulerConnector
from lmc.connectors.core.worker import WorkerConnector
from lmc.reference.connector_api import ConnectorRequest, KVConnector
from lmc.reference.scheduler_output import SchedulerOutput
from lmc.storage.chain import TierSpec
from lmc.storage.lookup import LookupResult
from lmc.storage.speeds import PrefillRate
from lmc.transfer.factory import TransferFactory
from lmc.transfer.kv_groups import FULL, SLIDING, KVGroup
from lmc.transfer.kv_spec import KVSpec

ConfigLike = CacheConfig | str | os.PathLike | Mapping[str, Any] | None
KV_ROLES = {"kv_both": (True, True), "kv_producer": (False, True), "kv_consumer": (True, False)}


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
        model_dir: the checkpoint directory, for the model identity (its weights' bytes,
            or ``model_revision`` of the config).
        model_id: an explicit identity instead (engines sharing KV must agree on it; the
            caller answers for the weights behind it).
        layerwise: overlap each layer's load with the previous layer's compute.
        save_decode: also save chunks completed by generated tokens.
        tiers: extra storage tiers below L1, passed to the ``CacheEngine``.
        cache_engine: use this engine instead of creating one (its spec must match the
            engine's KV cache); it is then not closed by ``shutdown``.
        transfer: the ``CacheEngine``'s transfer choice ("auto", "torch", "cuda", or a
            factory ``(spec, kv_caches) -> KVTransfer``, e.g. a test backend).
        kv_role: "kv_both" (default), "kv_producer" or "kv_consumer" (see the module).
        remote_prefill_wait: seconds a consumer's asynchronous load waits for the
            producer's chunks to be published before the rest is recomputed here.
        engine_id: this instance's name in a producer's answers.
    """

    def __init__(self, config: ConfigLike = None, *, model_dir: str | os.PathLike | None = None,
                 model_id: str | None = None, layerwise: bool = True, save_decode: bool = False,
                 tiers: Sequence[TierSpec] | None = None,
                 cache_engine: CacheEngine | None = None,
                 transfer: str | TransferFactory = "auto", kv_role: str = "kv_both",
                 remote_prefill_wait: float = 30.0, engine_id: str = "") -> None:
        if kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {sorted(KV_ROLES)}, got {kv_role!r}")
        self.kv_role = kv_role
        self.remote_prefill_wait = remote_prefill_wait
        self.engine_id = engine_id or f"lmc-reference-{os.getpid()}"
        self._finished_ids: set[str] = set()
        load, save = KV_ROLES[kv_role]
        self.cache_config = load_cache_config(config)
        if model_id is None:
            if model_dir is not None:
                model_id = model_identity(model_dir, revision=self.cache_config.model_revision)
            elif cache_engine is not None:
                model_id = cache_engine.model_id
            else:
                raise ValueError("LMCReferenceConnector needs model_dir or model_id")
        self.model_id = model_id
        self._model_dir = model_dir
        self.connector_config = ConnectorConfig.from_cache_config(
            self.cache_config, save_decode=save_decode, layerwise=layerwise, load=load,
            save=save)
        self.policy = LoadPolicy(self._costs,
                                 enabled=self.cache_config.load_policy == "auto")
        self.scheduler = SchedulerConnector(self.connector_config, self._lookup, self.policy,
                                            prefetch=self._prefetch)
        self.scheduler.namespace = self.cache_config.tenant or "default"
        self.engine = cache_engine
        self._owns_engine = cache_engine is None
        self._tiers = tiers
        self._transfer = transfer
        self._windows: dict[str, int | None] = {}  # a hybrid model's sliding windows
        self.worker: WorkerConnector | None = None

    def _lookup(self, token_ids: Sequence[int]) -> LookupResult:
        """The one typed lookup every adapter uses: the engine's ``lookup_result``, which says
        which tier holds each hit chunk from the same single pass over the tiers, so the
        scheduler core keeps it with the request and :meth:`load_sources` needs no second
        hash or tier walk. In-process, the worker's ``CacheEngine`` answers directly; an
        engine whose scheduler lives in another process asks the same function over
        :mod:`lmc.connectors.core.lookup_service` (as vLLM's does)."""
        if self.engine is None:  # KV tensors not registered yet: nothing can be cached
            return LookupResult.miss(self.connector_config.chunk_size)
        return self.engine.lookup_result(token_ids)

    def set_step_budget(self, max_num_batched_tokens: int) -> None:
        """The engine chunks prefills longer than this: the load policy's rule knows that
        only the first step's compute hides a load."""
        self.policy.step_tokens = max(0, int(max_num_batched_tokens))

    def _prefetch(self, token_ids: Sequence[int], start: int, key_tag: bytes | None = None
                  ) -> Any:
        """What the load policy recomputes by choice, pulled into L1 while the request waits
        (the worker's engine is in this process), from the root of the request's key tag
        (``None``: the plain chain)."""
        if self.engine is None:
            return None
        return self.engine.prefetch(token_ids, start, root=engine_root(self.engine, key_tag))

    def _costs(self) -> Costs | None:
        """The load policy's view of the speeds: the worker's cache engine's estimates (in
        this process), ``None`` before the engine registered its caches."""
        engine = self.engine
        if engine is None:
            return None
        layers = engine.spec.num_layers if self.connector_config.layerwise else 1
        return Costs.from_snapshot(engine.speeds.snapshot(), engine.bytes_per_token, layers,
                                   engine.load_bytes)

    def load_sources(self, request: ConnectorRequest) -> dict[str, int]:
        """The admitted load's tokens by the tier holding them (L1 first), from the request's
        own lookup; ``{}`` when nothing is loaded (see ``SchedulerConnector.load_sources``)."""
        return self.scheduler.load_sources(request.request_id)

    @property
    def cache(self) -> CacheEngine:
        """The cache engine, for tools that read its tiers; an error before the engine has
        registered its KV caches (``LLM`` does so when it starts)."""
        if self.engine is None:
            raise RuntimeError("lmc has no cache engine yet: the engine has not registered "
                               "its KV caches")
        return self.engine

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int
                                   ) -> int | tuple[int, bool]:
        self.scheduler.set_hints(request.request_id,
                                 parse_hints(getattr(request, "kv_transfer_params", None)))
        remote = remote_prefill_tokens(request)
        if remote is not None and self.connector_config.load:
            n = self.scheduler.match_remote(request.request_id, request.all_token_ids,
                                            num_computed_tokens, remote)
            if n:
                return n, True
        hit = self.scheduler.get_num_new_matched_tokens(
            request.request_id, request.all_token_ids, num_computed_tokens)
        return hit or 0

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = getattr(request, "kv_transfer_params", None)
        if (num_external_tokens > 0 and params is not None
                and remote_prefill_tokens(request) is not None):
            params["do_remote_prefill"] = False  # one transfer per request
        self.scheduler.update_state_after_alloc(request.request_id, request.all_token_ids,
                                                request.num_computed_tokens, num_external_tokens,
                                                block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        return self.scheduler.build_metadata(scheduler_output.scheduled_requests,
                                             scheduler_output.finished_req_ids,
                                             scheduler_output.preempted_req_ids)

    def request_finished(self, request: ConnectorRequest) -> dict | None:
        self.scheduler.request_finished(request.request_id)
        self._finished_ids.add(request.request_id)
        if self.connector_config.save and wants_remote_decode(
                getattr(request, "kv_transfer_params", None)):
            return producer_params(len(request.prompt_token_ids), self.engine_id)
        return None

    # --------------------------------------------------------------- worker side
    def register_kv_windows(self, windows: dict[str, int | None]) -> None:
        """A hybrid sliding-window/full model: each layer's window (``None``: full), made
        into lmc's KV groups when the caches are registered (:mod:`lmc.hybrid`)."""
        self._windows = dict(windows)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec = KVSpec.from_tensors(kv_caches, "vllm_flash")
        if self._windows:
            spec = dataclasses.replace(spec, groups=window_groups(
                [self._windows.get(name) for name in kv_caches]))
        if self.engine is None:
            self.engine = CacheEngine(self.cache_config, spec, self.model_id, tiers=self._tiers,
                                      transfer=self._transfer, model_dir=self._model_dir)
        elif self.engine.spec.namespace_fields() != spec.namespace_fields():
            raise ValueError(f"the given CacheEngine's KV spec {self.engine.spec} does not "
                             f"match the engine's KV cache {spec}")
        # first-use costs at registration, never the first request's (as vLLM's worker):
        # the pool's first touch ends here, the compute floor is measured here
        self.engine.pool.wait_ready()
        if self.engine.speeds.prefill.floor is None and self._model_dir is not None:
            self.engine.speeds.prefill.floor = _compute_floor(
                self._model_dir, next(iter(kv_caches.values())).device, spec.dtype)
        if self.worker is not None:
            self.worker.close()
        self.worker = WorkerConnector(self.engine, list(kv_caches.values()), spec.block_size,
                                      layerwise=self.connector_config.layerwise,
                                      remote_wait=self.remote_prefill_wait)

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

    def get_finished(self) -> set[str]:
        if self.worker is None:
            return set()
        finished, self._finished_ids = self._finished_ids, set()
        return self.worker.get_finished(finished)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.worker is None else self.worker.take_load_errors()

    # ------------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        """Scheduler, worker and cache counters in one flat dict."""
        out: dict[str, Any] = {f"scheduler.{k}": v for k, v in vars(self.scheduler.stats).items()
                               if k != "extra"}
        out.update(self.scheduler.policy_stats())
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


def window_groups(windows: Sequence[int | None]) -> tuple[KVGroup, ...]:
    """lmc's KV groups for layers with these windows (``None``: full attention): the full
    layers first, then one group per window (its layers in order)."""
    full = tuple(i for i, w in enumerate(windows) if w is None)
    out = [KVGroup(FULL, full)] if full else []
    for w in sorted({w for w in windows if w is not None}):
        out.append(KVGroup(SLIDING, tuple(i for i, x in enumerate(windows) if x == w),
                           window=w))
    return tuple(out)


def _compute_floor(model_dir: str | os.PathLike, device: torch.device, dtype: torch.dtype
                   ) -> PrefillRate | None:
    """The checkpoint's compute floor (:mod:`lmc.connectors.core.compute_floor`), from its
    ``config.json``; ``None`` without one."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return compute_floor(cfg, device, dtype)
