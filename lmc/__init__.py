"""lmc: KV-cache middleware for LLM inference engines.

Engines' KV tensors are cut into content-addressed chunks and kept across tiers (pinned CPU
memory, disk, remote stores) so that any instance seeing the same token prefix loads them back
instead of recomputing the prefill.
"""

from lmc.cache_engine import CacheEngine
from lmc.config import CacheConfig, parse_size
from lmc.kv_spec import LAYOUTS, KVSpec
from lmc.layerwise import LayerwiseRetrieve, LayerwiseStore, LoadError
from lmc.memory import Lease, MemoryObj, MemoryPool
from lmc.storage_backend import StorageBackend, register_backend
from lmc.token_database import ChunkedTokenDatabase

__version__ = "0.1.0"

__all__ = [
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
