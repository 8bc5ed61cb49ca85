"""lmc settings for the vLLM connector, from ``kv_connector_extra_config``.

Keys there that start with ``lmc.`` are lmc's: ``lmc.config_file`` names a YAML file, and
``lmc.<key>`` overrides any cache key of it (``lmc.chunk_size``, ``lmc.local_disk``, ...).
Connector behaviour lives under ``vllm:`` in the YAML (or ``lmc.vllm.<option>`` in the
extra config), so that one file configures both. Precedence, lowest first: defaults, YAML,
``LMC_<KEY>`` environment variables, extra-config keys. An unknown key fails at start-up
with its name and where it came from, like every lmc config.

No vLLM import here: this module is tested without vLLM.
"""

from __future__ import annotations

import dataclasses
import difflib
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from lmc.config import CacheConfig, _parse_bool, _parse_float, _parse_opt_str

PREFIX = "lmc."


@dataclasses.dataclass(frozen=True)
class VllmOptions:
    """How the connector behaves (the cache itself is ``CacheConfig``).

    Attributes:
        lookup_timeout: seconds the scheduler waits for all workers to answer a lookup;
            past it the request gets 0 hits (never a hang).
        lookup_dir: directory of the workers' lookup sockets.
        layerwise: overlap each layer's load with the previous layer's compute.
        save_decode: also save chunks completed by generated tokens.
        model_id: identity for the key namespace (default: derived from the checkpoint).
        recompute_on_load_error: switch vLLM's ``kv_load_failure_policy`` from "fail" to
            "recompute", so a lost or corrupt chunk costs a recompute, not a failed request.
        allow_untested: accept a vLLM version or attention backend whose KV geometry lmc
            can map but which was never run against lmc (otherwise refused at start-up).
    """

    lookup_timeout: float = 1.0
    lookup_dir: str = ""
    layerwise: bool = True
    save_decode: bool = False
    model_id: str | None = None
    recompute_on_load_error: bool = True
    allow_untested: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "lookup_timeout",
             _parse_float(self.lookup_timeout, "vllm.lookup_timeout", minimum=0.001))
        set_(self, "lookup_dir", str(self.lookup_dir or tempfile.gettempdir()))
        for name in ("layerwise", "save_decode", "recompute_on_load_error", "allow_untested"):
            set_(self, name, _parse_bool(getattr(self, name), f"vllm.{name}"))
        set_(self, "model_id", _parse_opt_str(self.model_id, "vllm.model_id"))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    cache: CacheConfig
    vllm: VllmOptions


def _check(keys: Any, valid: tuple[str, ...], origin: str, prefix: str = "") -> None:
    for key in keys:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ValueError(f"unknown lmc config key '{prefix}{key}' in {origin}{hint}")


def load_settings(extra_config: Mapping[str, Any] | None,
                  environ: Mapping[str, str] | None = None) -> ConnectorSettings:
    """Settings from vLLM's ``kv_connector_extra_config`` (see the module docstring)."""
    extra = {k[len(PREFIX):]: v for k, v in (extra_config or {}).items()
             if isinstance(k, str) and k.startswith(PREFIX)}
    path = extra.pop("config_file", None)
    cache: dict[str, Any] = {}
    opts: dict[str, Any] = {}
    if path:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping of lmc config keys")
        section = data.pop("vllm", None) or {}
        if not isinstance(section, dict):
            raise ValueError(f"{path}: 'vllm' must be a mapping of connector options")
        _check(data, (*CacheConfig.field_names(), "vllm"), str(path))
        _check(section, VllmOptions.field_names(), str(path), "vllm.")
        cache.update(data)
        opts.update(section)
    cache.update(CacheConfig.from_env(environ))
    for key, value in extra.items():
        if key.startswith("vllm."):
            opts[key[5:]] = value
        else:
            cache[key] = value
    _check([k for k in extra if not k.startswith("vllm.")], CacheConfig.field_names(),
           "kv_connector_extra_config", PREFIX)
    _check(opts, VllmOptions.field_names(), "kv_connector_extra_config", PREFIX + "vllm.")
    return ConnectorSettings(CacheConfig(**cache), VllmOptions(**opts))
