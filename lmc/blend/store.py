"""Segments in lmc's tiers: stored and loaded through a ``CacheEngine`` under segment keys.

A segment's chunks go through the same store/retrieve paths as prefix chunks (so every tier,
its integrity checks and its eviction apply), only their keys differ
(:class:`~lmc.blend.keys.SegmentKeys`). A segment counts as cached only when all of its
chunks load: a segment with its head cached and its tail evicted is computed again (its
tail's KV depends on its head, at canonical positions), and storing it again skips the
chunks still present.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmc.blend.keys import SegmentKeys
from lmc.cache_engine import CacheEngine


class SegmentStore:
    """Loads and saves whole segments' canonical KV between a paged cache and lmc."""

    def __init__(self, engine: CacheEngine) -> None:
        if not engine.db.save_unfull_chunk:
            raise ValueError("blending needs save_unfull_chunk: true (a segment's partial last "
                             "chunk is part of it)")
        self.engine = engine
        self.keys = SegmentKeys(engine.db.namespace, engine.db.chunk_size)

    def load(self, tokens: Sequence[int], kv_caches: list[torch.Tensor], slots: torch.Tensor,
             key_tag: bytes | None = None) -> bool:
        """Write the segment's stored KV into ``slots``; whether all of it was there.
        ``key_tag``: the request's (LoRA, ``cache_salt``), as in :class:`SegmentKeys`."""
        keys = self.keys.keys(list(tokens), key_tag)
        return self.engine.retrieve(list(tokens), kv_caches, slots, keys=keys) == len(tokens)

    def save(self, tokens: Sequence[int], kv_caches: list[torch.Tensor], slots: torch.Tensor,
             key_tag: bytes | None = None) -> int:
        """Store the segment's canonical KV found at ``slots``; returns tokens newly stored."""
        keys = self.keys.keys(list(tokens), key_tag)
        return self.engine.store(list(tokens), kv_caches, slots, keys=keys)

    def contains(self, tokens: Sequence[int], key_tag: bytes | None = None) -> bool:
        """Whether every chunk of the segment is stored now (no pin: a hint)."""
        keys = self.keys.keys(list(tokens), key_tag)
        return self.engine.lookup(list(tokens), keys=keys) == len(tokens)
