"""``CacheEngine.chunks``: the engine's tiers by key, for an adapter whose engine names its
own pages.

Why: SGLang's HiCache hands lmc pages already keyed (its own hashes) and copies them itself,
so its adapter (``lmc/connectors/sglang/pages.py``) needs the tiers by key, not by token
prefix. It used to call the engine's ``StorageManager`` directly, which made every part of
the manager an adapter's API. These are the calls such an adapter may make, each one the
manager's own (same promotion, write-behind, listeners and counts), and nothing else of it:
an adapter that keys its own chunks uses these, the token-prefix calls (``store``,
``lookup``, ``retrieve``) are for everything else.

Keys are lmc :data:`~lmc.storage.tier.Key` bytes the caller derives (namespaced by the
caller: ``page_keys`` in the SGLang adapter); a chunk's objects come from :meth:`allocate`
and are handed over by :meth:`put`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmc.storage.integrity import Geometry, expect_geometry

if TYPE_CHECKING:
    import torch

    from lmc.memory.pool import MemoryObj
    from lmc.storage.manager import StorageManager
    from lmc.storage.tier import Key


class KeyedChunks:
    """The engine's tiers by key (module docstring): L1 first, then the lower tiers."""

    def __init__(self, storage: StorageManager) -> None:
        self._storage = storage

    def expect_geometry(self, geometry: Geometry | None) -> int:
        """Declare the shape and dtype every value read from a shared lower tier has (a page
        of the adapter's pool): a value of another geometry is refused before anything is
        allocated for it (counted, deleted, a miss). Replaces the engine's own declaration;
        ``None`` turns the check off. Returns how many tiers check it."""
        return expect_geometry(self._storage.lower, geometry)

    def sources(self, keys: Sequence[Key]) -> list[int]:
        """For each leading key present in some tier, the index (in ``tier_names``) of the
        fastest tier holding it: the longest present prefix, from one batched pass."""
        return self._storage.prefix_sources(keys)

    def touch(self, keys: Sequence[Key]) -> list[bool]:
        """Per key, whether L1 holds it; present keys become the most recently used."""
        return self._storage.l1_touch(keys)

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, count: int,
                 num_tokens: int) -> list[MemoryObj]:
        """Up to ``count`` L1 objects of ``shape``/``dtype`` (fewer when L1 is full of
        referenced chunks), evicting unreferenced ones to make room; each is the caller's
        until handed to :meth:`put` or released."""
        return self._storage.allocate_many(shape, dtype, count, num_tokens)

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        """Store fully written objects under ``keys`` in L1, and by the write policy in the
        lower tiers (never waits for them); the caller still releases its own references.
        Returns how many L1 took."""
        return self._storage.put(keys, objs)

    def get_prefix(self, keys: Sequence[Key]) -> list[MemoryObj]:
        """Objects for the longest present prefix of ``keys``, each acquired for the caller
        (release them); lower-tier hits are promoted into L1 on the way."""
        return self._storage.get_prefix(keys)

    def delete(self, keys: Sequence[Key]) -> int:
        """Remove ``keys`` from every tier (a value found bad); returns how many were held."""
        return self._storage.delete(keys)
