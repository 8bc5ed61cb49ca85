"""Segment keys: a reusable segment is addressed by its own tokens, not by what precedes it.

Prefix keys chain from the namespace through every earlier chunk, so a document placed after
a different system prompt or in another order gets new keys. A segment's keys chain instead
from a *segment namespace* (the cache's namespace digest, which already binds model, KV
shape, dtype, sharding, chunk size and tenant, hashed again with a domain tag so a segment
can never collide with a prefix that has the same tokens) through the segment's own chunks.
The KV stored under them is the segment computed alone, at canonical positions
``0..len-1``; placing it elsewhere is :mod:`lmc.blend.rope_shift`'s job.

Callers mark segments as ``(start, end)`` token spans of the prompt (the ``segments=``
argument of ``LLM.generate``), or, for text, with a separator string between pieces
(LMCache's ``blend_special_str`` convention): every piece but the last is a segment, the
last (the question) is new text. Pieces are tokenized one by one, so a document's tokens do
not depend on its neighbours' (BPE merges across a seam would change its key).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import xxhash

from lmc.token_database import (
    KEY_BYTES,
    ChunkedTokenDatabase,
    ChunkKey,
    Tokens,
    request_root,
)

SEGMENT_DOMAIN = b"lmc.blend.segment/1"
DEFAULT_SEPARATOR = " # # "
Span = tuple[int, int]


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


def check_spans(spans: Sequence[Sequence[int]], num_tokens: int) -> list[Span]:
    """Segment spans as sorted, non-overlapping, non-empty ``(start, end)`` pairs inside the
    prompt; anything else is a ``ValueError`` naming the span."""
    out: list[Span] = []
    for i, span in enumerate(spans):
        try:
            start, end = (int(v) for v in span)
        except (TypeError, ValueError):
            raise ValueError(f"segment {i} must be a (start, end) pair of ints, got {span!r}") \
                from None
        if not 0 <= start < end <= num_tokens:
            raise ValueError(f"segment {i} ({start}, {end}) must satisfy 0 <= start < end <= "
                             f"{num_tokens} (the prompt's length)")
        if out and start < out[-1][1]:
            raise ValueError(f"segment {i} ({start}, {end}) overlaps or precedes segment "
                             f"{i - 1} {out[-1]}: segments must be in order, disjoint")
        out.append((start, end))
    return out


def split_text(prompt: str, separator: str = DEFAULT_SEPARATOR) -> list[str]:
    """Pieces of a text prompt between separators (empty pieces dropped)."""
    if not separator:
        raise ValueError("the segment separator must be a non-empty string")
    return [p for p in prompt.split(separator) if p]


def encode_pieces(pieces: Sequence[str], encode: Callable[[str, bool], list[int]]
                  ) -> tuple[list[int], list[Span]]:
    """Token ids of the pieces, concatenated, and the spans of every piece but the last.

    ``encode(text, add_special_tokens)`` tokenizes one piece; only the first piece gets the
    tokenizer's special tokens (BOS). A single piece has no segment."""
    ids: list[int] = []
    spans: list[Span] = []
    for i, piece in enumerate(pieces):
        toks = encode(piece, i == 0)
        if i < len(pieces) - 1 and toks:
            spans.append((len(ids), len(ids) + len(toks)))
        ids.extend(toks)
    return ids, spans


def split_tokens(token_ids: Sequence[int], separator: Sequence[int]) -> tuple[list[int], list[Span]]:
    """The separator convention for token-id prompts: every occurrence of the ``separator``
    run is removed, and the runs between them (but the last) are segments."""
    sep = list(separator)
    if not sep:
        raise ValueError("the segment separator must be at least one token")
    ids: list[int] = []
    spans: list[Span] = []
    start = i = 0
    toks = list(token_ids)
    n, k = len(toks), len(sep)
    while i < n:
        if toks[i: i + k] == sep:
            if len(ids) > start:
                spans.append((start, len(ids)))
            start = len(ids)
            i += k
            continue
        ids.append(toks[i])
        i += 1
    return ids, spans
