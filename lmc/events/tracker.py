"""What each tier holds, in the terms a router needs: engine blocks, their tokens, their media.

Tiers report chunk keys (:class:`lmc.storage.tier.TierListener`); a router needs one hash per
*engine block*, the block's tokens and its parent's hash. The tracker joins the two: the
engine's prompts are noted (tokens and the chunks they were cut into), each noted chunk gets
its block hashes, and tier events on its key become ``BlockStored`` / ``BlockRemoved`` for the
chunk's blocks in the tier's medium.

Rules (from ``../shared/KV_EVENTS.md``):

* a chunk's blocks are published in one ``BlockStored`` with ``parent_block_hash`` = the last
  block of the chunk before it (None at the prompt's start), only full blocks;
* ``BlockRemoved`` only when no tier of that medium holds the block any longer: blocks are
  reference-counted per medium (two chunks share blocks: a partial tail and the full chunk
  that later replaced it; two tiers share a medium: disk and a shared store);
* a tier's clear is ``BlockRemoved`` of what it held, unless nothing is left anywhere: then
  ``AllBlocksCleared`` (which clears every tier of the worker in Dynamo);
* a chunk whose tokens were never noted (a disk tier's contents from before a restart, found
  by key) is not published (counted ``unknown``): a router can only use a block with tokens.

Block hashes: lmc's own stable u64s -- the low 64 bits of each block's chained key, computed
as lmc keys chunks (native XXH3-128 over the previous key and the block's tokens, from the
engine's key namespace: model, layout, parallelism, tenant), so two engines agree exactly
when they would share KV. Everything here runs on the publisher's one thread: no locks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from lmc.events import wire
from lmc.storage.tier import Medium
from lmc.token_database import ChunkedTokenDatabase

log = logging.getLogger(__name__)
MEDIUM_OF = {Medium.MEMORY: wire.CPU, Medium.LOCAL_STORAGE: wire.STORAGE,
             Medium.REMOTE: wire.STORAGE}
"""lmc's declared media as vLLM spells them; a peer's memory is that peer's to publish."""
EVENTS_PER_BATCH = 1024


def u32_tokens(tokens: Any) -> np.ndarray:
    """The prompt as a uint32 array (a list, numpy array or torch tensor)."""
    if hasattr(tokens, "detach"):
        tokens = tokens.detach().cpu().numpy()
    return np.asarray(tokens).astype(np.uint32, copy=False).reshape(-1)


class ChunkInfo:
    __slots__ = ("hashes", "parent", "tokens", "start", "where", "lora", "salt")

    def __init__(self, hashes: tuple[int, ...], parent: int | None, tokens: np.ndarray,
                 start: int, lora: str | None = None, salt: str | None = None) -> None:
        self.hashes = hashes
        self.parent = parent
        self.lora = lora      # LoRA name, when the chunk's writer gave one
        self.salt = salt      # cache_salt: the daemon's namespace of the chunk
        self.tokens = tokens  # the full blocks' tokens, uint32
        self.start = start    # token offset in its prompt (parents come first)
        self.where = 0        # bit per tier level holding it


def _stored(info: ChunkInfo, block_size: int, medium: str) -> dict[str, Any]:
    return wire.block_stored(info.hashes, info.parent, info.tokens.tolist(), block_size,
                             medium, lora_name=info.lora, cache_salt=info.salt)


class Tracker:
    """Turns notes and tier events into wire events (see the module docstring)."""

    def __init__(self, block_size: int, namespace: bytes, media: Sequence[str | None],
                 max_chunks: int, count: Callable[[str, int], None]) -> None:
        if block_size < 1:
            raise ValueError(f"kv_events.block_size must be >= 1, got {block_size}")
        self.bs = block_size
        # a block's hash: the low 64 bits of its chained key, as lmc keys chunks
        self.blocks = ChunkedTokenDatabase(block_size, False, namespace)
        self.media = list(media)  # per tier level: wire medium or None (not published)
        self.max_chunks = max_chunks
        self.count = count
        self.held: dict[bytes, ChunkInfo] = {}
        self.seen: OrderedDict[bytes, ChunkInfo] = OrderedDict()
        self.refs: dict[tuple[int, str], int] = {}

    # ------------------------------------------------------------------ notes
    def _info(self, key: bytes) -> ChunkInfo | None:
        info = self.held.get(key)
        if info is None:
            info = self.seen.get(key)
            if info is not None:
                self.seen.move_to_end(key)
        return info

    def add(self, key: bytes, info: ChunkInfo) -> None:
        """Remember one chunk whose blocks were worked out elsewhere (the daemon's: from a
        client's verified block info); the first word on a key stands (keys are content
        addresses: a later one describes the same tokens)."""
        if self._info(key) is None:
            self.seen[key] = info
            while len(self.seen) > self.max_chunks:
                self.seen.popitem(last=False)

    def note(self, tokens: Any, chunks: Sequence[tuple[int, int, bytes]]) -> None:
        """Remember the blocks of ``chunks`` (``(start, end, key)`` of ``tokens``)."""
        todo = [c for c in chunks if self._info(c[2]) is None]
        if not todo:
            return
        bs = self.bs
        last = max(e for _, e, _ in todo) // bs * bs
        toks = np.array(u32_tokens(tokens)[:last], dtype=np.uint32)  # our own copy
        # every full block's chained key up to the last new chunk, in one native pass; a
        # block's hash is its key's first 8 bytes read little-endian
        digests = self.blocks.keys(toks)
        hashes = np.frombuffer(b"".join(digests), dtype="<u8")[0::2].tolist()
        for start, end, key in todo:
            lo, hi = start // bs, min(end, last) // bs
            self.seen[key] = ChunkInfo(tuple(hashes[lo:hi]), hashes[lo - 1] if lo else None,
                                       toks[lo * bs:hi * bs], start)
        while len(self.seen) > self.max_chunks:
            self.seen.popitem(last=False)

    # ------------------------------------------------------------------ tier events
    def _in_medium(self, info: ChunkInfo, medium: str) -> bool:
        w, level = info.where, 0
        while w:
            if w & 1 and self.media[level] == medium:
                return True
            w >>= 1
            level += 1
        return False

    def stored(self, keys: Iterable[bytes], level: int) -> list[dict[str, Any]]:
        medium = self.media[level] if level < len(self.media) else None
        bit = 1 << level
        out = []
        for key in keys:
            info = self.held.get(key)
            if info is None:
                info = self.seen.pop(key, None)
                if info is None:
                    self.count("unknown", 1)
                    continue
                if len(self.held) >= self.max_chunks:
                    self.seen[key] = info
                    self.count("untracked", 1)
                    continue
                self.held[key] = info
            if info.where & bit:
                continue
            fresh = medium is not None and not self._in_medium(info, medium)
            info.where |= bit
            if fresh and info.hashes:
                assert medium is not None
                for h in info.hashes:
                    self.refs[(h, medium)] = self.refs.get((h, medium), 0) + 1
                out.append(_stored(info, self.bs, medium))
        return out

    def removed(self, keys: Iterable[bytes], level: int) -> list[dict[str, Any]]:
        medium = self.media[level] if level < len(self.media) else None
        bit = 1 << level
        gone: list[int] = []
        for key in keys:
            info = self.held.get(key)
            if info is None or not info.where & bit:
                continue
            info.where &= ~bit
            if medium is not None and not self._in_medium(info, medium):
                for h in info.hashes:
                    n = self.refs.get((h, medium), 0) - 1
                    if n > 0:
                        self.refs[(h, medium)] = n
                    else:
                        self.refs.pop((h, medium), None)
                        gone.append(h)
            if not info.where:
                del self.held[key]
                self.seen[key] = info
        while len(self.seen) > self.max_chunks:
            self.seen.popitem(last=False)
        return [wire.block_removed(gone, medium)] if gone and medium else []

    def cleared(self, level: int) -> list[dict[str, Any]]:
        bit = 1 << level
        keys = [k for k, i in self.held.items() if i.where & bit]
        out = self.removed(keys, level)
        if not self.refs:
            return [wire.all_blocks_cleared()]
        return out

    def held_keys(self, level: int) -> list[bytes]:
        bit = 1 << level
        return [k for k, i in self.held.items() if i.where & bit]

    def snapshot(self) -> list[list[dict[str, Any]]]:
        """A full replay of what every tier holds now, in batches: ``AllBlocksCleared``
        first, then each medium's chunks parent-first."""
        batches: list[list[dict[str, Any]]] = [[wire.all_blocks_cleared()]]
        chunks = sorted(self.held.values(), key=lambda i: i.start)
        for medium in wire.MEDIA:
            for info in chunks:
                if info.hashes and self._in_medium(info, medium):
                    if len(batches[-1]) >= EVENTS_PER_BATCH:
                        batches.append([])
                    batches[-1].append(_stored(info, self.bs, medium))
        return batches
