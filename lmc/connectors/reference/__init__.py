"""lmc for the built-in reference engine, and the example to copy for an adapter of your own.

The engine knows lmc only by name: ``LLM(model_dir, lmc_config=...)`` and ``python -m
lmc.reference.serve --lmc-config`` ask the engine's connector registry
(``lmc.reference.connector_api.CONNECTOR_MODULES``) for ``"lmc"``, which imports this
package and calls :func:`build_connector` (and :func:`check_config` before the model loads).
``connector`` is the adapter (each engine hook one call on the connector core), ``blend``
the same adapter with segment blending wired in (``lmc.blend``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lmc.config import CacheConfig
from lmc.connectors.reference.blend import BlendConnector, BlendSettings
from lmc.connectors.reference.connector import (
    KV_ROLES,
    ConfigLike,
    LMCReferenceConnector,
    load_cache_config,
)
from lmc.memory.pool import check_fits
from lmc.storage.chain import check_chain

__all__ = [
    "KV_ROLES",
    "BlendConnector",
    "BlendSettings",
    "ConfigLike",
    "LMCReferenceConnector",
    "build_connector",
    "check_config",
    "load_cache_config",
]


def build_connector(config: ConfigLike, *, model_dir: str | os.PathLike,
                    blend: bool | Mapping[str, Any] | BlendSettings | None = None,
                    **options: Any) -> LMCReferenceConnector:
    """The engine's lmc connector: blending when ``blend`` is true or a mapping of
    :class:`BlendSettings` fields, the plain adapter otherwise; ``options`` are the
    adapter's keyword arguments (``kv_role``, ``engine_id``, ...)."""
    if blend:
        settings = blend if isinstance(blend, (Mapping, BlendSettings)) else {}
        return BlendConnector(config, model_dir=model_dir, blend=settings, **options)
    return LMCReferenceConnector(config, model_dir=model_dir, **options)


def check_config(config: ConfigLike) -> CacheConfig:
    """The lmc config, checked as far as it can be before the slow work (keys, every
    tier's options and URL, the disk tier's directory, the pool against the host's
    memory). Raises ``ValueError``/``OSError`` naming the mistake."""
    cfg = load_cache_config(config)
    check_chain(cfg)
    check_fits(cfg.local_cpu_size, cfg.local_cpu_prefault != "off")
    return cfg
