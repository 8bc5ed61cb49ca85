"""The engine side of a shared store's events: the block info an ``lmc://`` tier sends with
a PUT (``lmc.events.shared`` for its form and checks).

A tier's ``put`` sees chunk keys and values, not tokens. :func:`bind` gives every tier
that asks for it (a ``block_notes`` attribute, the seam: ``None`` on the class, set here)
one :class:`ChunkNotes`: the engine's token database is wrapped so each prompt it keys is
remembered by chunk key (a reference to the prompt, not a copy; bounded to ``max_chunks``
keys, oldest forgotten), and the tier asks :meth:`ChunkNotes.items` for the keys it PUTs.

Nothing is noted until a tier calls :meth:`ChunkNotes.activate` (the ``lmc://`` tier does
once the daemon's HELLO says it publishes events): before that the wrapper costs one
attribute test per call. Then each keyed prompt costs a dict insert per new chunk, under a
lock (the tier reads from its own threads).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from lmc.token_database import Chunk, ChunkedTokenDatabase, ChunkKey, Tokens, tokens_to_bytes

log = logging.getLogger(__name__)


class _Prompt:
    __slots__ = ("tokens", "keys", "n")

    def __init__(self, tokens: Tokens, keys: Sequence[ChunkKey], n: int) -> None:
        self.tokens, self.keys, self.n = tokens, keys, n


class ChunkNotes:
    """Chunk key -> (prompt, index), bounded; what a tier needs to describe a chunk."""

    def __init__(self, namespace: bytes, chunk_size: int, block_size: int,
                 max_chunks: int = 1 << 16) -> None:
        if block_size < 1 or chunk_size % block_size:
            raise ValueError(f"block size {block_size} must divide chunk_size {chunk_size}")
        self.namespace = namespace
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.max_chunks = max_chunks
        self.active = False
        self._lock = threading.Lock()
        self._by_key: OrderedDict[bytes, tuple[_Prompt, int]] = OrderedDict()

    def activate(self) -> None:
        if not self.active:
            self.active = True
            log.info("KV events: the shared store publishes; its PUTs carry block info "
                     "(block size %d)", self.block_size)

    def note(self, tokens: Tokens, keys: Sequence[ChunkKey], n: int) -> None:
        """``keys`` are the chunk keys of ``tokens[:n]`` from the prompt's start."""
        if not self.active or not keys:
            return
        p = _Prompt(tokens, keys, n)
        with self._lock:
            d = self._by_key
            for i, k in enumerate(keys):
                if k not in d:
                    d[k] = (p, i)
            while len(d) > self.max_chunks:
                d.popitem(last=False)

    def items(self, keys: Sequence[bytes]) -> list[list[Any] | None]:
        """Per key: ``[prev, tokens, start]`` (``lmc.events.shared``'s item) or None."""
        with self._lock:
            found = [self._by_key.get(bytes(k)) for k in keys]
        out: list[list[Any] | None] = []
        cs = self.chunk_size
        for f in found:
            if f is None:
                out.append(None)
                continue
            p, i = f
            start, end = i * cs, min(i * cs + cs, p.n)
            prev = p.keys[i - 1] if i else self.namespace
            out.append([bytes(prev), tokens_to_bytes(p.tokens[start:end]), start])
        return out

    def __len__(self) -> int:
        return len(self._by_key)


class NotesDatabase(ChunkedTokenDatabase):
    """The engine's token database, delegated to unchanged, that also tells ``notes`` of
    each prompt it keys."""

    def __init__(self, inner: ChunkedTokenDatabase, notes: ChunkNotes) -> None:
        super().__init__(inner.chunk_size, inner.save_unfull_chunk, inner.namespace)
        self.inner = inner
        self.notes = notes

    def keys(self, tokens: Tokens, limit: int | None = None) -> list[ChunkKey]:
        out = self.inner.keys(tokens, limit)
        if self.notes.active and out:
            n = self.num_tokens(tokens)
            self.notes.note(tokens, out, n if limit is None else min(limit, n))
        return out

    def process_tokens(self, tokens: Tokens, mask: Any = None,
                       keys: Sequence[ChunkKey] | None = None) -> list[Chunk]:
        if keys is not None and self.notes.active:
            self.notes.note(tokens, keys, self.num_tokens(tokens))
        elif keys is None and self.notes.active:
            keys = self.keys(tokens)
        return self.inner.process_tokens(tokens, mask, keys)


def bind(engine: Any, block_size: int | None = None) -> ChunkNotes | None:
    """Give the tiers of ``engine`` that take block info (``block_notes`` attribute) the
    engine's notes; None when no tier takes them, or the block size (``block_size``, else
    ``kv_events.block_size``, else the engine's) does not divide the chunk size (logged)."""
    tiers = [t for t in engine.storage.tiers if hasattr(t, "block_notes")]
    if not tiers:
        return None
    if isinstance(engine.db, NotesDatabase):  # bound already (attach() binds too)
        return engine.db.notes
    if block_size is None:
        ev = getattr(engine.config, "kv_events", None) or {}
        block_size = int(ev.get("block_size") or 0) or int(engine.spec.block_size)
    db: ChunkedTokenDatabase = engine.db
    try:
        notes = ChunkNotes(db.namespace, db.chunk_size, block_size)
    except ValueError as e:
        log.warning("KV events: no block info for the shared store: %s", e)
        return None
    engine.db = NotesDatabase(db, notes)
    for t in tiers:
        t.block_notes = notes
    return notes
