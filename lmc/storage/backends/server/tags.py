"""Integrity tags on the ``lmc://`` tier, each stored as a small value of its own.

Why a companion value rather than bytes in the value's header: the daemon keeps a value as
pool memory plus its header fields, re-encodes the header on every GET, and moves values
through its own lower tiers (disk, Redis), which keep no extra bytes either. A tag stored as
an ordinary 32-byte value under a derived key travels through all of that unchanged, so the
daemon needs no change. The tag is ``lmc.storage.integrity``'s, over the reader's key, the
version-2 header recomputed from what the daemon returned, and the payload.

Pairing. Each chunk's tag is sent just before the chunk in the same PUT, so a reader that
sees the chunk sees its tag (the daemon commits a request's values in order). A chunk whose
tag is missing (evicted, or written by an engine without the secret) or does not verify
(forged, altered, copied from another key, another secret) is a miss; the chunk and its tag
are deleted, as a bad value is on every tier. Costs: one 4 KiB-aligned block of daemon
memory per tag, and a daemon lookup counts chunks whose tag may since have been evicted (a
later miss, never wrong KV).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lmc.lazy_import import LazyModule
from lmc.memory.pool import MemoryObj
from lmc.storage.framing import ValueFraming
from lmc.storage.serde import HEADER_SIZE, TAG_SIZE

if TYPE_CHECKING:
    import torch
else:  # imported at the first tag: `lmc config` reads this backend's options without it
    torch = LazyModule("torch", globals())

TAG_SHAPE = (1, 1, 1, TAG_SIZE)
Allocate = Callable[[Sequence[int], "torch.dtype", int], "MemoryObj | None"]


def tag_dtype() -> torch.dtype:
    """A tag's dtype: bytes."""
    return torch.uint8


def tag_key(key: bytes) -> bytes:
    """Where a chunk's tag lives: derived from its key, in the same namespace."""
    return hashlib.blake2b(bytes(key), digest_size=16, person=b"lmc-tag-key").digest()


def interleave(keys: Sequence[bytes]) -> list[bytes]:
    """``[tag(k0), k0, tag(k1), k1, ...]``: each tag goes (and is committed) first."""
    out: list[bytes] = []
    for k in keys:
        out += (tag_key(k), k)
    return out


class Tags:
    """Seals chunks into (tag, chunk) pairs for a PUT (the framing makes each tag); a GET's
    pairs are checked by the framing too (``ValueFraming.admit``)."""

    def __init__(self, framing: ValueFraming, allocate: Allocate) -> None:
        if not framing.tagged:
            raise ValueError("companion tags need a framing with an integrity secret")
        self.framing = framing
        self.allocate = allocate

    def seal(self, keys: Sequence[bytes], objs: Sequence[MemoryObj]
             ) -> tuple[list[bytes], list[MemoryObj], list[MemoryObj]]:
        """(keys, objects) to PUT, pairs interleaved, and the tag objects to release after.
        A chunk whose tag cannot be allocated is left out (not stored, never untagged)."""
        out_keys: list[bytes] = []
        out_objs: list[MemoryObj] = []
        tags: list[MemoryObj] = []
        for k, o in zip(keys, objs):
            t = self.allocate(TAG_SHAPE, tag_dtype(), 1)
            if t is None:
                continue
            tags.append(t)
            t.byte_view()[:] = self.framing.encode(k, o, o.byte_view())[HEADER_SIZE:]
            out_keys += (tag_key(k), k)
            out_objs += (t, o)
        return out_keys, out_objs, tags
