"""lmc's counters through vLLM's own stats path, so they reach vLLM's log and ``/metrics``.

lmc's Prometheus metrics live in the worker processes, which serve no HTTP; vLLM's
``/metrics`` is served by the API server. So each step the worker hands vLLM the counters
that changed (``get_kv_connector_stats``); vLLM sums them over ranks, logs them every
interval as "KV Transfer metrics", and feeds them to :class:`LMCPromMetrics`, which exports
``lmc:connector_total{stat=...}`` (loaded_tokens, saved_tokens, load_failures,
tokens_from_<tier>, ...) next to ``vllm:external_prefix_cache_hits``. The worker's lmc
metrics travel the same way (keys ``m:...`` of :func:`lmc.metrics.values`, changes only) and
are added to the same metrics in the API server's registry (:func:`lmc.metrics.apply`), so
vLLM's ``/metrics`` carries ``lmc_lookups_total``, ``lmc_hit_tokens_total`` and the per-tier
series the Grafana dashboard reads, under their own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from lmc import metrics

NAME = "lmc:connector"  # exported as lmc:connector_total


def _unregister(name: str) -> None:
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", None) == name:
            REGISTRY.unregister(collector)


@dataclass
class LMCConnectorStats(KVConnectorStats):
    """Counter deltas keyed by name; aggregation is a sum."""

    def reset(self) -> None:
        self.data: dict[str, int | float] = {}

    def aggregate(self, other: KVConnectorStats) -> LMCConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM logs each interval: the connector's counters (lmc's metrics, ``m:``
        keys, go to ``/metrics`` only)."""
        return {k: int(v) if float(v).is_integer() else v for k, v in sorted(self.data.items())
                if not k.startswith(metrics.PREFIX)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class LMCPromMetrics(KVConnectorPromMetrics):
    """``lmc:connector_total{stat=...}``, one counter per engine and stat name."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister(NAME)  # a later engine in the same process re-creates it, as vLLM does
        self._counter = self._counter_cls(
            name=NAME,
            documentation="lmc connector counters summed over workers: loaded_tokens, "
                          "saved_tokens, load_failures, tokens_from_<tier>, ...",
            labelnames=[*labelnames, "stat"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        metrics.apply(transfer_stats_data)  # the m: keys, into lmc's own metrics here
        for stat, value in transfer_stats_data.items():
            if stat.startswith(metrics.PREFIX):
                continue
            if isinstance(value, (int, float)) and value > 0:
                self._counter.labels(*labels, stat).inc(value)
