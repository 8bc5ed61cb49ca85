"""The engine side of a shared store's events: the block info an ``lmc://`` tier sends with
a PUT (``lmc.events.shared`` for its form and checks).

A tier's ``put`` sees chunk keys and values, not tokens. :func:`bind` gives every tier
that asks for it (a ``block_notes`` attribute, the seam: ``None`` on the class, set here)
one :class:`ChunkNotes`, an observer of the engine's token database
(:class:`lmc.token_database.KeysObserver`): each chunk it keys is remembered by its key
(the previous key, the chunk's tokens as bytes, its offset: a copy, so a growing
conversation's every turn is not kept alive; at most ``max_chunks`` chunks, oldest
forgotten: 64 MiB at 256-token chunks), and the tier asks :meth:`ChunkNotes.items` for the
keys it PUTs.

A tagged request's chunks (LoRA, ``cache_salt``: :class:`~lmc.token_database.RootedKeys`)
are never noted: their chain starts from a root the daemon cannot check, and describing them
would put them in the daemon's events as the base model's. Their PUTs carry no block info.

Notes are taken from the moment they are bound, before any tier has spoken to its daemon:
a tier opens its connection (and so learns from the HELLO whether the daemon publishes)
only at its first call, which may be the very PUT of a chunk keyed earlier -- a chunk
stored before any lookup must still be published. Each tier then tells the notes what its
HELLO said (:meth:`ChunkNotes.told`); once every bound tier has said its daemon does not
publish at this block size, noting stops and what was noted is dropped (observing then
costs one attribute test per call), and starts again if a daemon later says it does.
While active, each keyed prompt costs a dict insert per new chunk, under a lock (the tier
reads from its own threads).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from lmc.token_database import (
    ChunkedTokenDatabase,
    ChunkKey,
    Tokens,
    tokens_to_bytes,
)

log = logging.getLogger(__name__)


class ChunkNotes:
    """Chunk key -> (prompt, index), bounded; what a tier needs to describe a chunk."""

    def __init__(self, namespace: bytes, chunk_size: int, block_size: int,
                 max_chunks: int = 1 << 16, tiers: int = 1) -> None:
        if block_size < 1 or chunk_size % block_size:
            raise ValueError(f"block size {block_size} must divide chunk_size {chunk_size}")
        self.namespace = namespace
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.max_chunks = max_chunks
        self.active = True  # until every tier's daemon has said it does not publish
        self._lock = threading.Lock()
        self._by_key: OrderedDict[bytes, tuple[bytes, bytes, int]] = OrderedDict()
        self._unheard = set(range(tiers))  # tiers whose daemon has not said yet
        self._wanting: set[int] = set()  # tiers whose daemon publishes at our block size
        self._told_on = False

    def told(self, tier: int, publishes: bool) -> None:
        """Tier number ``tier``'s daemon said (in a HELLO) whether it publishes events at
        this block size; notes are kept while any tier's does or has not said yet."""
        with self._lock:
            self._unheard.discard(tier)
            (self._wanting.add if publishes else self._wanting.discard)(tier)
            active = bool(self._unheard or self._wanting)
            if not active:
                self._by_key.clear()
            was, self.active = self.active, active
        if publishes and not self._told_on:
            self._told_on = True
            log.info("KV events: the shared store publishes; its PUTs carry block info "
                     "(block size %d)", self.block_size)
        elif was and not active:
            log.info("KV events: no shared store publishes at block size %d; chunks are "
                     "not noted", self.block_size)

    def activate(self) -> None:
        """Note from now on whatever the tiers said (a test's, or a single tier's, way)."""
        with self._lock:
            self.active = True

    # as a KeysObserver of the engine's token database (lmc.token_database): a prompt it
    # keys, or cuts with keys computed ahead, is noted while active
    def on_keys(self, tokens: Tokens, keys: Sequence[ChunkKey], num_tokens: int) -> None:
        if self.active:
            self.note(tokens, keys, num_tokens)

    def on_chunks(self, tokens: Tokens, keys: Sequence[ChunkKey], num_tokens: int,
                  chunks: list[Any]) -> None:
        if self.active:
            self.note(tokens, keys, num_tokens)

    def note(self, tokens: Tokens, keys: Sequence[ChunkKey], n: int) -> None:
        """``keys`` are the chunk keys of ``tokens[:n]`` from the prompt's start; the chunks
        not noted yet are copied (the prompt is converted once, only if one is new)."""
        if not self.active or not keys:
            return
        d = self._by_key
        new = [i for i, k in enumerate(keys) if k not in d]  # a racy look: the lock below
        if not new:
            return
        cs = self.chunk_size
        data = tokens_to_bytes(tokens[:min(n, len(keys) * cs)])
        with self._lock:
            for i in new:
                k = keys[i]
                if k not in d:
                    d[k] = (bytes(keys[i - 1]) if i else self.namespace,
                            data[i * cs * 4:(i + 1) * cs * 4], i * cs)
            while len(d) > self.max_chunks:
                d.popitem(last=False)

    def items(self, keys: Sequence[bytes]) -> list[list[Any] | None]:
        """Per key: ``[prev, tokens, start]`` (``lmc.events.shared``'s item) or None."""
        with self._lock:
            found = [self._by_key.get(bytes(k)) for k in keys]
        return [None if f is None else list(f) for f in found]

    def __len__(self) -> int:
        return len(self._by_key)


def bind(engine: Any, block_size: int | None = None) -> ChunkNotes | None:
    """Give the tiers of ``engine`` that take block info (``block_notes`` attribute) the
    engine's notes; None when no tier takes them, or the block size (``block_size``, else
    ``kv_events.block_size``, else the engine's) does not divide the chunk size (logged)."""
    tiers = [t for t in engine.storage.tiers if hasattr(t, "block_notes")]
    if not tiers:
        return None
    db: ChunkedTokenDatabase = engine.db
    for o in db.observers:  # bound already (attach() binds too)
        if isinstance(o, ChunkNotes):
            return o
    if block_size is None:
        ev = getattr(engine.config, "kv_events", None) or {}
        block_size = int(ev.get("block_size") or 0) or int(engine.spec.block_size)
    try:
        notes = ChunkNotes(db.namespace, db.chunk_size, block_size, tiers=len(tiers))
    except ValueError as e:
        log.warning("KV events: no block info for the shared store: %s", e)
        return None
    db.add_observer(notes)
    for i, t in enumerate(tiers):
        while "inner" in vars(t):  # a wrapper tier (lmc.storage.wrappers): the tier it wraps
            t = vars(t)["inner"]
        t.block_notes = notes
        t.block_notes_slot = i
    return notes
