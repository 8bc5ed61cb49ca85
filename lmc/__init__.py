"""lmc: KV-cache middleware for LLM inference engines.

Engines' KV tensors are cut into content-addressed chunks and kept across tiers (pinned CPU
memory, disk, remote stores) so that any instance seeing the same token prefix loads them back
instead of recomputing the prefill.

The public names below are imported on first use (PEP 562): most of them need torch, which
takes seconds to import, and ``lmc --help`` or ``lmc stats`` should not wait for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "CacheEngine": "lmc.cache_engine",
    "CacheConfig": "lmc.config",
    "parse_size": "lmc.config",
    "LAYOUTS": "lmc.transfer.kv_spec",
    "KVSpec": "lmc.transfer.kv_spec",
    "LayerwiseRetrieve": "lmc.layerwise",
    "LayerwiseStore": "lmc.layerwise",
    "LoadError": "lmc.layerwise",
    "Lease": "lmc.memory.pool",
    "MemoryObj": "lmc.memory.pool",
    "MemoryPool": "lmc.memory.pool",
    "StorageBackend": "lmc.storage.tier",
    "register_backend": "lmc.storage.tier",
    "ChunkedTokenDatabase": "lmc.token_database",
}

__all__ = [  # exactly the names of _LAZY (a test checks)
    "LAYOUTS",
    "CacheConfig",
    "CacheEngine",
    "ChunkedTokenDatabase",
    "KVSpec",
    "LayerwiseRetrieve",
    "LayerwiseStore",
    "Lease",
    "LoadError",
    "MemoryObj",
    "MemoryPool",
    "StorageBackend",
    "parse_size",
    "register_backend",
]

if TYPE_CHECKING:  # for type checkers and IDEs: the eager imports the names stand for
    from lmc.cache_engine import CacheEngine
    from lmc.config import CacheConfig, parse_size
    from lmc.layerwise import LayerwiseRetrieve, LayerwiseStore, LoadError
    from lmc.memory.pool import Lease, MemoryObj, MemoryPool
    from lmc.storage.tier import StorageBackend, register_backend
    from lmc.token_database import ChunkedTokenDatabase
    from lmc.transfer.kv_spec import LAYOUTS, KVSpec


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:  # AttributeError lets ``from lmc import <submodule>`` import it
        raise AttributeError(f"module 'lmc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
