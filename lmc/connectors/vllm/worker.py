"""Worker half of the vLLM connector: one tensor-parallel rank's cache, loads, saves and
lookup server.

Created with vLLM's worker; the ``CacheEngine`` is made in ``register_kv_caches``, once the
KV tensors exist and their layout is known (:mod:`lmc.connectors.vllm.layout`). vLLM calls
``wait_for_layer_load`` and ``save_kv_layer`` from the forward, on its compute stream: the
core orders that stream after the layer's load, and each save after that point on it
(:mod:`lmc.connectors.core.worker`), without blocking the host. vLLM names
layers (``model.layers.3.self_attn.attn``); the core counts them, so names map to indices in
layer order. Saves are committed within their step (``wait_for_save``), so no save is ever
pending across steps: ``get_finished`` reports only asynchronous (prefill/decode) loads, and
there is nothing to rescue in ``handle_preemptions``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from lmc import metrics
from lmc.cache_engine import CacheEngine
from lmc.config import CacheConfig
from lmc.connectors.core.compute_floor import compute_floor
from lmc.connectors.core.load_policy import Costs
from lmc.connectors.core.lookup_service import LookupServer, engine_lookup, engine_prefetch
from lmc.connectors.core.metadata import ConnectorMetadata
from lmc.connectors.core.worker import WorkerConnector
from lmc.connectors.vllm.groups import lmc_groups
from lmc.connectors.vllm.layout import LayoutChoice

log = logging.getLogger(__name__)

# WorkerStats fields reported to vLLM as connector stats (deltas per interval)
STAT_FIELDS = ("loads", "load_tokens", "loaded_tokens", "load_failures", "saves",
               "saved_tokens", "saves_dropped", "save_failures", "async_loads",
               "async_load_failures")


class WorkerSide:
    """Owns the rank's ``CacheEngine``, the core's ``WorkerConnector`` and the lookup
    server answering the scheduler."""

    def __init__(self, cache_config: CacheConfig, model_id: str, tp_rank: int, tp_size: int,
                 block_size: int, layerwise: bool, socket_path: str,
                 remote_wait: float = 30.0, model_shape: Any = None,
                 kv_cache_config: Any = None) -> None:
        """``model_shape``: the model's Hugging Face config (its compute floor is measured at
        registration: :mod:`lmc.connectors.core.compute_floor`). ``kv_cache_config``:
        vLLM's, whose KV cache groups (a hybrid model has several) become lmc's."""
        self.cache_config = cache_config
        self.model_id = model_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.block_size = block_size  # vLLM's (manager) block size: what block ids count
        self.layerwise = layerwise
        self.socket_path = socket_path
        self.remote_wait = remote_wait
        self.model_shape = model_shape
        self.kv_cache_config = kv_cache_config
        self.engine: CacheEngine | None = None
        self.worker: WorkerConnector | None = None
        self.server: LookupServer | None = None
        self.layout: LayoutChoice | None = None
        self._layer_index: dict[str, int] = {}
        self._reported: dict[str, float] = {}
        self._closed = False

    def register(self, choice: LayoutChoice) -> None:
        spec = choice.spec()
        groups = lmc_groups(self.kv_cache_config, choice.names)
        if groups:  # a hybrid model: each group stored and loaded as its kind needs
            spec = dataclasses.replace(spec, groups=groups)
        self.close_engine()
        self.layout = choice
        self.engine = CacheEngine(self.cache_config, spec, self.model_id, self.tp_rank,
                                  self.tp_size)
        # vLLM reports "ready" once the caches are registered: that must mean stores run at
        # full speed, so the pool's first-touch work finishes here (this thread helps it)
        self.engine.pool.wait_ready()
        if self.model_shape is not None and choice.tensors:
            self.engine.speeds.prefill.floor = compute_floor(
                self.model_shape, choice.tensors[0].device, spec.dtype)
        self.worker = WorkerConnector(self.engine, list(choice.tensors), self.block_size,
                                      layerwise=self.layerwise, remote_wait=self.remote_wait)
        self._layer_index = {name: i for i, name in enumerate(choice.names)}
        self.server = LookupServer(self.socket_path, engine_lookup(lambda: self.engine),
                                   costs=self.costs, prefetch=self.prefetch)
        atexit.register(self.close)  # flushes the write-behind queue if vLLM never calls
        log.info("lmc: %s, %d layers (%s), block %d, %s; model %s, tp %d/%d; lookups at %s",
                 choice.detail, spec.num_layers, self.engine.describe_groups(),
                 spec.block_size, spec.dtype, self.model_id, self.tp_rank, self.tp_size,
                 self.socket_path)

    def prefetch(self, tokens: Any, start: int, tag: bytes | None = None) -> Any:
        """Pull a waiting request's chunks from position ``start`` on into this rank's L1
        (the scheduler's load policy chose to recompute them for now), from this rank's
        root for the request's key ``tag`` (LoRA, ``cache_salt``; None: the plain chain);
        None: no engine."""
        return engine_prefetch(lambda: self.engine)(tokens, start, tag)

    def costs(self) -> Costs | None:
        """This rank's measured speeds, what the scheduler's load policy decides with
        (directly in this process, over the lookup socket from another)."""
        eng = self.engine
        if eng is None:
            return None
        layers = eng.spec.num_layers if self.layerwise else 1
        return Costs.from_snapshot(eng.speeds.snapshot(), eng.bytes_per_token, layers,
                                   eng.load_bytes)

    # ----------------------------------------------------------------- per step
    def bind(self, meta: ConnectorMetadata) -> None:
        if self.worker is not None:
            self.worker.bind(meta)

    def start_load(self) -> None:
        if self.worker is not None:
            self.worker.start_load()

    def layer_index(self, layer_name: str) -> int | None:
        return self._layer_index.get(layer_name)

    def wait_for_layer(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if self.worker is not None and i is not None:
            self.worker.wait_for_layer(i)

    def save_layer(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if self.worker is not None and i is not None:
            self.worker.save_layer(i)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.wait_for_save()

    def get_finished(self, finished_ids: set[str]) -> set[str]:
        """Requests whose asynchronous (prefill/decode) load ended; call before
        :meth:`take_load_errors` in the same step, which then holds their failed blocks."""
        return set() if self.worker is None else self.worker.get_finished(finished_ids)

    def take_load_errors(self) -> set[int]:
        return set() if self.worker is None else self.worker.take_load_errors()

    def take_failed_loads(self) -> set[str]:
        """Requests whose asynchronous load came up short (a hybrid model's failures)."""
        return set() if self.worker is None else self.worker.take_failed_loads()

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.worker is not None:
            out.update({f"worker.{k}": v for k, v in self.worker.stats.as_dict().items()})
        if self.engine is not None:
            out.update({f"cache.{k}": v for k, v in self.engine.stats().items()})
        if self.server is not None:
            out["lookup_server.requests"] = self.server.requests
            out["lookup_server.errors"] = self.server.errors
        return out

    def stats_delta(self) -> dict[str, float]:
        """Counters since the last call (vLLM sums them over ranks and intervals)."""
        if self.worker is None:
            return {}
        now = {k: float(getattr(self.worker.stats, k)) for k in STAT_FIELDS}
        now.update({f"tokens_from_{t}": float(n)
                    for t, n in self.worker.stats.tokens_by_tier.items()})
        # the engine's Prometheus series, carried to the process that serves vLLM's /metrics
        now.update(metrics.values())
        delta = {k: v - self._reported.get(k, 0.0) for k, v in now.items()}
        self._reported = now
        return {k: v for k, v in delta.items() if v}

    # ---------------------------------------------------------------- lifecycle
    def close_engine(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.worker is not None:
            with contextlib.suppress(Exception):
                self.worker.close()
            self.worker = None
        if self.engine is not None:
            self.engine.close()  # drains the write-behind queue to the lower tiers
            self.engine = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.close_engine()
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)


def tensors_by_name(kv_caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM may register non-tensor entries for layers without KV; keep the tensors."""
    return {k: v for k, v in kv_caches.items() if isinstance(v, torch.Tensor)}
