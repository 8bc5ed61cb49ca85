"""Block info for a shared store's events: what an ``lmc://`` client sends with a PUT, how
the daemon checks it, and the blocks the daemon works out from it and publishes.

A daemon stores a chunk under its key and a value; a router needs the chunk's engine blocks
(their tokens, a hash each, the parent). The client knows the tokens; the daemon must not
believe anything it cannot check, because its events speak for every tenant it serves. So a
client sends, per value, only what the daemon can verify, and the daemon derives the rest:

* wire: the PUT's metadata key ``blocks`` (absent: no info; the value is stored and not
  published, counted ``no_info``)::

    {"bs": engine block size, "cs": chunk size, "lora": str | None,
     "items": [None | [prev, tokens, start], ...]}   # one per value, in order

  ``prev`` the 16-byte key of the chunk before (the engine's key namespace for a prompt's
  first chunk), ``tokens`` the chunk's token ids as little-endian uint32 bytes, ``start``
  its token offset in the prompt (0 = the prompt's first chunk: no parent);
* checks (:class:`BlockInfoError` names the item and what was wrong): shapes and types;
  ``bs`` in [1, 65536], ``cs`` a multiple of ``bs`` of at most 2**20 tokens; ``start`` a
  multiple of ``bs``; ``len(tokens)`` equal to the value header's token count and at most
  ``cs``; and ``xxh3_128(prev || tokens)`` equal to the chunk's key (lmc's key chain), so
  the tokens published are the tokens the key names;
* hashes (:func:`derive`), never the client's: lmc's own key chain over the chunk's
  blocks, seeded per namespace, LoRA and ``prev`` by keyed BLAKE2b under a secret of this
  daemon run; a full chunk's last block is keyed BLAKE2b of the chunk's own key, so the
  next chunk's parent (``prev``) is known without its tokens. Equal blocks in one
  namespace get equal hashes (a partial tail and the full chunk that replaces it share
  them: the tracker reference-counts); no tenant can compute another namespace's hashes
  (it knows no seed), nor make the daemon publish under another namespace's
  ``cache_salt`` (the daemon stamps the request's granted namespace).

Block info lies a tenant can still tell are about its own namespace only (a ``start`` of 0
for a middle chunk publishes a prefix that exists nowhere: routers send that tenant's
requests to the daemon's users and miss). See docs/threats/daemon.md.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from lmc.events.tracker import ChunkInfo
from lmc.token_database import ChunkedTokenDatabase

KEY = 16
MAX_BLOCK = 1 << 16
MAX_CHUNK = 1 << 20
MAX_START = 1 << 40
MAX_LORA = 256
_PERSON = b"lmc-kv-blocks"


class BlockInfoError(ValueError):
    """Block info that is malformed or does not describe its chunk; names what was wrong."""


@dataclass(frozen=True)
class BlockInfo:
    """One value's checked block info (what :func:`derive` needs)."""

    prev: bytes
    tokens: bytes
    start: int
    block_size: int
    chunk_size: int
    lora: str | None


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BlockInfoError(f"{what}: expected a whole number in [{lo}, {hi}], got "
                             f"{str(v)[:40]!r}")
    return v


def parse(raw: Any, keys: Sequence[bytes], num_tokens: Sequence[int]
          ) -> list[BlockInfo | None]:
    """The ``blocks`` field of a PUT whose values have these ``keys`` and token counts, each
    item checked (see the module docstring); :class:`BlockInfoError` for anything else."""
    if not isinstance(raw, dict):
        raise BlockInfoError(f"blocks: expected a map, got {type(raw).__name__}")
    unknown = set(raw) - {"bs", "cs", "lora", "items"}
    if unknown:
        raise BlockInfoError(f"blocks: unknown field {sorted(map(str, unknown))[0][:40]!r}")
    bs = _int(raw.get("bs"), "blocks.bs", 1, MAX_BLOCK)
    cs = _int(raw.get("cs"), "blocks.cs", bs, MAX_CHUNK)
    if cs % bs:
        raise BlockInfoError(f"blocks.cs: chunk size {cs} is not a multiple of the block "
                             f"size {bs}")
    lora = raw.get("lora")
    if lora is not None and (not isinstance(lora, str) or len(lora) > MAX_LORA):
        raise BlockInfoError(f"blocks.lora: expected a string of at most {MAX_LORA} "
                             f"characters or null")
    items = raw.get("items")
    if not isinstance(items, list) or len(items) != len(keys):
        raise BlockInfoError(f"blocks.items: expected a list of {len(keys)} entries (one per "
                             f"value), got "
                             f"{len(items) if isinstance(items, list) else type(items).__name__}")
    out: list[BlockInfo | None] = []
    for i, (it, key, n) in enumerate(zip(items, keys, num_tokens)):
        if it is None:
            out.append(None)
            continue
        where = f"blocks.items[{i}]"
        if not isinstance(it, list) or len(it) != 3:
            raise BlockInfoError(f"{where}: expected [prev, tokens, start] or null")
        prev, toks, start = it
        if not isinstance(prev, bytes) or len(prev) != KEY:
            raise BlockInfoError(f"{where}.prev: expected {KEY} bytes")
        if not isinstance(toks, bytes) or len(toks) % 4:
            raise BlockInfoError(f"{where}.tokens: expected uint32 little-endian bytes")
        if len(toks) // 4 != n:
            raise BlockInfoError(f"{where}.tokens: {len(toks) // 4} tokens, the value holds "
                                 f"{n}")
        if n > cs:
            raise BlockInfoError(f"{where}.tokens: {n} tokens exceed the chunk size {cs}")
        start = _int(start, f"{where}.start", 0, MAX_START)
        if start % bs:
            raise BlockInfoError(f"{where}.start: {start} is not a multiple of the block "
                                 f"size {bs}")
        if xxhash.xxh3_128_digest(prev + toks) != key:
            raise BlockInfoError(f"{where}: prev and tokens do not hash to the chunk's key "
                                 f"(block info of another chunk)")
        out.append(BlockInfo(prev, toks, start, bs, cs, lora))
    return out


def new_secret() -> bytes:
    """The key of one publisher's block hashes (random per daemon run: a restart clears
    what routers know of it anyway)."""
    return os.urandom(32)


def _tag(ns: str, lora: str | None) -> bytes:
    nb, lb = ns.encode(), (lora or "").encode()
    return len(nb).to_bytes(1, "little") + nb + lb


def _chunk_hash(secret: bytes, tag: bytes, key: bytes) -> int:
    d = hashlib.blake2b(b"\x01" + tag + b"\0" + key, digest_size=8, key=secret,
                        person=_PERSON).digest()
    return int.from_bytes(d, "little")


def derive(secret: bytes, ns: str, key: bytes, info: BlockInfo) -> ChunkInfo:
    """The chunk's published blocks (full blocks only), in namespace ``ns``: hashes, parent,
    tokens, and ``ns`` as the ``cache_salt``. Block ``j``'s hash is the low 64 bits of lmc's
    key chain (XXH3-128, native) over the chunk's blocks, seeded with keyed BLAKE2b of the
    namespace, LoRA name and ``prev`` under this run's ``secret``; a full chunk's last block
    is keyed BLAKE2b of the chunk's own key, so the next chunk's parent is known from its
    ``prev`` alone. A tenant knows neither seed nor key, so it can aim no block of its own
    at another namespace's hashes."""
    tag = _tag(ns, info.lora)
    seed = hashlib.blake2b(b"\x00" + tag + b"\0" + info.prev, digest_size=16, key=secret,
                           person=_PERSON).digest()
    bs, n = info.block_size, len(info.tokens) // 4
    full = n // bs
    keys: list[bytes] = []
    if full:
        keys = ChunkedTokenDatabase(bs, False, seed).chain_keys(seed, info.tokens,
                                                                 full * bs * 4)
    hashes: list[int] = np.frombuffer(b"".join(keys), dtype="<u8")[0::2].tolist()
    if full and n == info.chunk_size:  # the next chunk names this block by our key
        hashes[-1] = _chunk_hash(secret, tag, key)
    parent = None if info.start == 0 else _chunk_hash(secret, tag, info.prev)
    toks = np.frombuffer(info.tokens, dtype="<u4")[:full * bs].astype(np.uint32)
    return ChunkInfo(tuple(hashes), parent, toks, info.start, info.lora, ns)


def encode(prev: bytes, tokens: bytes, start: int) -> list[Any]:
    """One value's item, as the client sends it."""
    return [prev, tokens, start]
