"""One instance's cached blocks as its events describe them, and a prompt's cached prefix.

Events name blocks by the engine's hashes, which a router cannot compute (they are the
engine's, salted as it likes). What a router can compute is a key of the *tokens*: here a
block's key chains over every token up to and including it (XXH3-64 of the parent's key and
the block's tokens as little-endian uint32), so equal keys mean equal prefixes, and a prompt
is scored by walking its own block keys until one is missing. A stored block's key comes
from its parent's (the event's ``parent_block_hash``, or the root for None), so a block whose
parent was never seen cannot be placed and is counted ``orphans`` (Dynamo drops those too).

Media: GPU (the engine's own cache), CPU (lmc's memory tier), STORAGE (disk, shared
stores). One ``BlockRemoved`` removes a block from that medium, as Dynamo does; the publisher
reference-counts. Bounded: at most ``max_blocks`` blocks per instance (past it new blocks are
ignored and counted ``overflow``, so a lying publisher cannot grow the router).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from lmc.events import wire

BITS = {wire.GPU: 1, wire.CPU: 2, wire.STORAGE: 4}


def root_key(lora_name: str | None, cache_salt: str | None) -> int:
    """The key before a prompt's first block: LoRA and salt separate otherwise equal prompts."""
    if lora_name is None and cache_salt is None:
        return 0
    return xxhash.xxh3_64_intdigest(f"{lora_name or ''}\0{cache_salt or ''}".encode())


def block_keys(tokens: Sequence[int], block_size: int, root: int = 0) -> list[int]:
    """The chained key of each full block of ``tokens``."""
    out = []
    h = root
    pack = struct.Struct(f"<{block_size}I").pack
    digest = xxhash.xxh3_64_intdigest
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = digest(h.to_bytes(8, "little") + pack(*tokens[i:i + block_size]))
        out.append(h)
    return out


@dataclass
class Match:
    """A prompt's cached prefix on one instance, in blocks, per tier union (as Dynamo's
    indexer reports them): in GPU; in GPU or CPU; anywhere."""

    gpu: int = 0
    cpu: int = 0
    storage: int = 0
    block_size: int = 0

    def tokens(self) -> int:
        return self.storage * self.block_size


class PrefixIndex:
    """See the module docstring. Called from one thread (the feed's) while the router's
    request threads call :meth:`match`: every update is a single dict operation, so a
    match sees each block either before or after it, never half-applied."""

    def __init__(self, max_blocks: int = 1 << 21) -> None:
        self.max_blocks = max_blocks
        self.block_size = 0
        self.key_of: OrderedDict[int, int] = OrderedDict()  # engine hash -> block key
        self.media: dict[int, int] = {}  # block key -> bits of the media holding it
        self.counts = {"orphans": 0, "overflow": 0, "other_block_size": 0}

    def clear(self) -> None:
        """Everything gone (``AllBlocksCleared``: a publisher's start or reset), its block
        size too: a publisher restarted with another one is indexed at the new one."""
        self.key_of.clear()
        self.media.clear()
        self.block_size = 0

    def stored(self, ev: wire.Stored) -> None:
        bs = ev.block_size
        if not ev.hashes or not bs:
            return
        if self.block_size and bs != self.block_size:
            self.counts["other_block_size"] += 1
            return
        self.block_size = bs
        if ev.parent is None:
            key = root_key(ev.lora_name, ev.cache_salt)
        else:
            parent = self.key_of.get(ev.parent)
            if parent is None:
                self.counts["orphans"] += 1
                return
            key = parent
        bit = BITS[ev.medium]
        keys = block_keys(ev.token_ids, bs, key)
        for h, k in zip(ev.hashes, keys):
            if (h not in self.key_of and len(self.key_of) >= self.max_blocks
                    and not self._forget_one()):
                self.counts["overflow"] += 1
                return
            self.key_of[h] = k
            self.key_of.move_to_end(h)
            self.media[k] = self.media.get(k, 0) | bit

    def _forget_one(self) -> bool:
        """Make room: drop the oldest hash no medium holds any longer (among the 64
        oldest: a bounded look, so a full index costs each store the same)."""
        for n, (h, k) in enumerate(self.key_of.items()):
            if n >= 64:
                break
            if k not in self.media:
                del self.key_of[h]
                return True
        return False

    def removed(self, ev: wire.Removed) -> None:
        bit = BITS[ev.medium]
        for h in ev.hashes:
            k = self.key_of.get(h)
            if k is None:
                continue
            m = self.media.get(k, 0) & ~bit
            if m:
                self.media[k] = m
            else:
                self.media.pop(k, None)

    def apply(self, events: Sequence[wire.Event]) -> None:
        for ev in events:
            if isinstance(ev, wire.Stored):
                self.stored(ev)
            elif isinstance(ev, wire.Removed):
                self.removed(ev)
            else:
                self.clear()

    def match(self, keys: Sequence[int]) -> Match:
        """``keys``: the prompt's :func:`block_keys` at this index's block size."""
        return match_union([(self, keys)])

    @property
    def blocks(self) -> int:
        return len(self.media)


def match_union(parts: Sequence[tuple[PrefixIndex, Sequence[int]]]) -> Match:
    """A prompt's cached prefix where each block may be held by any of several indexes (an
    instance's own events and a shared store it reads from), each with the prompt's keys
    as that index roots them (a shared store's blocks carry its namespace as salt). All
    indexes must have one block size (the caller groups them)."""
    m = Match(block_size=parts[0][0].block_size if parts else 0)
    gpu_run = cpu_run = True
    n = min((len(keys) for _, keys in parts), default=0)
    for i in range(n):
        bits = 0
        for index, keys in parts:
            bits |= index.media.get(keys[i], 0)
        if not bits:
            break
        if gpu_run and bits & 1:
            m.gpu = i + 1
        else:
            gpu_run = False
        if cpu_run and bits & 3:
            m.cpu = i + 1
        else:
            cpu_run = False
        m.storage = i + 1
    return m
