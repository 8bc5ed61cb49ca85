"""Segment keys: a reusable segment is addressed by its own tokens, not by what precedes it.

Prefix keys chain from the namespace through every earlier chunk, so a document placed after
a different system prompt or in another order gets new keys. A segment's keys chain instead
from a *segment namespace* (the cache's namespace digest, which already binds model, KV
shape, dtype, sharding, chunk size and tenant, hashed again with a domain tag so a segment
can never collide with a prefix that has the same tokens) through the segment's own chunks.
The KV stored under them is the segment computed alone, at canonical positions
``0..len-1``; placing it elsewhere is :mod:`lmc.blend.rope_shift`'s job.

How a prompt marks its segments is the engine's (:mod:`lmc.reference.segments`).
"""

from __future__ import annotations

import xxhash

from lmc.token_database import (
    KEY_BYTES,
    ChunkedTokenDatabase,
    ChunkKey,
    Tokens,
    request_root,
)

SEGMENT_DOMAIN = b"lmc.blend.segment/1"


def segment_namespace(namespace: bytes) -> bytes:
    """The seed of segment chains for a cache namespace (disjoint from its prefix chains)."""
    if len(namespace) != KEY_BYTES:
        raise ValueError(f"namespace must be {KEY_BYTES} bytes, got {len(namespace)}")
    return xxhash.xxh3_128_digest(SEGMENT_DOMAIN + namespace)


class SegmentKeys:
    """Chunk keys of a segment, independent of its position in any prompt.

    ``namespace`` is the cache's namespace digest (``CacheEngine.db.namespace``); chunks are
    ``chunk_size`` tokens like prefix chunks, the partial tail included (a segment rarely
    ends on a chunk boundary and its tail is as reusable as its head).

    A request's key tag (its LoRA adapter and ``cache_salt``:
    :func:`lmc.token_database.request_tag`) roots its segments' chains as it roots its prefix
    chains (:func:`lmc.token_database.request_root` of the segment namespace): an adapter's
    KV differs from the base model's, and a salt asks to share only with the same salt, so
    segments are shared exactly where prefixes are.
    """

    def __init__(self, namespace: bytes, chunk_size: int) -> None:
        self.namespace = segment_namespace(namespace)
        self.db = ChunkedTokenDatabase(chunk_size, save_unfull_chunk=True,
                                       namespace=self.namespace)

    @property
    def chunk_size(self) -> int:
        return self.db.chunk_size

    def keys(self, tokens: Tokens, key_tag: bytes | None = None) -> list[ChunkKey]:
        """The segment's keys; ``key_tag``: the request's (None: an untagged request)."""
        return self.db.keys(tokens, root=request_root(self.namespace, key_tag))
