"""lmc settings for the vLLM connector, from ``kv_connector_extra_config``.

Keys there that start with ``lmc.`` are lmc's: ``lmc.config_file`` names a YAML file, and
``lmc.<key>`` overrides any cache key of it (``lmc.chunk_size``, ``lmc.local_disk``, ...).
Connector behaviour lives under ``vllm:`` in the YAML (or ``lmc.vllm.<option>`` in the
extra config), so that one file configures both. Precedence, lowest first: defaults, YAML,
``LMC_<KEY>`` environment variables, extra-config keys. Loaded by :mod:`lmc.settings`, so an
unknown key, a bad value or malformed YAML fails at start-up with the same messages as every
lmc config: the key as written here, where it came from, and the closest valid key.

No vLLM import here: this module is tested without vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from lmc.config import CacheConfig, TierEntry, load_connector_settings
from lmc.settings import Settings, parse_bool, parse_duration, parse_opt_str, setting


@dataclasses.dataclass(frozen=True)
class VllmOptions(Settings):
    """How the connector behaves (the cache itself is ``CacheConfig``); read from the YAML's
    ``vllm:`` section and ``lmc.vllm.<option>`` extra-config keys (no environment variables).
    """

    WHAT = "lmc config"

    lookup_timeout: float = setting(
        1.0, lambda v, k: parse_duration(v, k, minimum=0.001),
        "seconds the scheduler waits for all workers to answer a lookup; past it the request "
        "gets 0 hits (never a hang)", unit="duration")
    lookup_dir: str = setting(
        "", lambda v, k: parse_opt_str(v, k) or tempfile.gettempdir(),
        "directory of the workers' lookup sockets (default: the temp directory)")
    layerwise: bool = setting(
        True, parse_bool, "overlap each layer's load with the previous layer's compute")
    save_decode: bool = setting(False, parse_bool, "also save chunks completed by generated tokens")
    model_id: str | None = setting(
        None, parse_opt_str, "identity for the key namespace, used as given: engines with one "
        "name share KV whatever their weights (default: the digest of the checkpoint's bytes, "
        "or lmc.model_revision)")
    recompute_on_load_error: bool = setting(
        True, parse_bool, "switch vLLM's kv_load_failure_policy from 'fail' to 'recompute', so "
        "a lost or corrupt chunk costs a recompute, not a failed request")
    remote_prefill_wait: float = setting(
        30.0, lambda v, k: parse_duration(v, k, minimum=0.001),
        "kv_consumer: seconds a request prefilled by a producer waits for the producer's "
        "chunks to be published before the missing positions are recomputed here",
        unit="duration")
    allow_untested: bool = setting(
        False, parse_bool, "accept a vLLM version or attention backend whose KV geometry lmc can "
        "map but which was never run against lmc (otherwise refused at start-up)")


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    cache: CacheConfig
    vllm: VllmOptions


def load_settings(extra_config: Mapping[str, Any] | None,
                  environ: Mapping[str, str] | None = None) -> ConnectorSettings:
    """Settings from vLLM's ``kv_connector_extra_config`` (see the module docstring)."""
    cache, opts = load_connector_settings(extra_config, "vllm", VllmOptions,
                                          "kv_connector_extra_config", environ)
    return ConnectorSettings(cache, opts)


def per_rank_disks(cache: CacheConfig, rank: int, tp_size: int) -> CacheConfig:
    """``cache`` with every disk tier in a directory of its own per tensor-parallel rank
    (``<path>/tp<rank>of<size>``): each rank's worker holds its own disk tier (index, LRU,
    directory lock), so ranks sharing one directory would refuse to start."""
    if tp_size <= 1:
        return cache
    sub = f"tp{rank}of{tp_size}"
    if cache.local_disk:
        return cache.replace(local_disk=os.path.join(cache.local_disk, sub))
    if cache.tiers is None:
        return cache
    return cache.replace(tiers=tuple(_rank_entry(e, sub) for e in cache.tiers))


def _rank_entry(entry: TierEntry, sub: str) -> TierEntry:
    if entry.inner is not None:  # a wrapper: the disk tier it wraps moves
        return dataclasses.replace(entry, inner=_rank_entry(entry.inner, sub))
    path = entry.options.get("path")
    if entry.backend != "disk" or not isinstance(path, str):
        return entry
    return dataclasses.replace(entry, options={**entry.options, "path": os.path.join(path, sub)})
