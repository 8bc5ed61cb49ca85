"""The location record an owner advertises for one chunk, and the checks on it.

A record says where a chunk lies in its owner's pool and how to prove, after reading it, that
the memory still held that chunk: ``slot`` indexes the owner's version table (registered with
NIXL beside the pool) and ``version`` is the value the slot holds while the chunk is exported.
The owner clears the slot before it releases the chunk's memory, so a reader that finds the
slot unchanged *after* its payload READ completed read the chunk, not whatever reused the
memory. ``checksum`` (the payload's xxh3, :func:`lmc.storage.serde.payload_checksum`) and, when the
owner has ``integrity_secret``, ``tag`` (:mod:`lmc.storage.integrity`'s tag over the key, the
version-2 ``lmc.storage.serde`` header these fields make, and the payload) let the reader verify the
bytes it READ exactly as a Redis or ``lmc://`` reader does, so a lying peer's record is a
miss. ``offset`` is relative to the owner's *export window* (:mod:`lmc.storage.backends.p2p.agent`), never to
its pool. Fixed size, little-endian, so the daemon can bound and check it without knowing
tensors::

    key 16B | offset u64 | nbytes u64 | version u64 | slot u32 | dtype u8 | flags u8 | pad 2B
    | shape 4 x u32 | num_tokens u32 | checksum u64 | tag 32B

``flags`` bit 0: the record carries a tag (the owner has a secret); other bits must be 0.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING

from lmc.storage import serde
from lmc.storage.serde import TAG_SIZE

if TYPE_CHECKING:  # the dtype maps are serde's, made (with torch) at their first use
    import torch

_RECORD = struct.Struct(f"<16sQQQIBB2x4IIQ{TAG_SIZE}s")
RECORD_SIZE = _RECORD.size  # 108
TAGGED = 1  # flags bit: ``tag`` holds an integrity tag
NO_TAG = bytes(TAG_SIZE)
MAX_AGENT_NAME = 128
MAX_METADATA = 4096  # bytes of NIXL agent metadata (UCX's is ~0.5 KiB on loopback)


class BadRecord(ValueError):
    """A record that cannot describe a chunk (wrong size, dtype, shape or bounds)."""


@dataclasses.dataclass(frozen=True)
class Record:
    key: bytes
    offset: int
    nbytes: int
    version: int
    slot: int
    dtype: torch.dtype
    shape: tuple[int, int, int, int]
    num_tokens: int
    checksum: int = 0
    tag: bytes | None = None  # None: the owner has no integrity secret

    def pack(self) -> bytes:
        return _RECORD.pack(self.key, self.offset, self.nbytes, self.version, self.slot,
                            serde.DTYPE_CODES[self.dtype], TAGGED if self.tag is not None else 0,
                            *self.shape, self.num_tokens, self.checksum, self.tag or NO_TAG)


def unpack_record(raw: bytes) -> Record:
    """Parse and check a record: its size, dtype, and that shape, dtype and length agree."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != RECORD_SIZE:
        raise BadRecord(f"a location record is {RECORD_SIZE} bytes of bin")
    key, off, n, ver, slot, code, flags, s0, s1, s2, s3, ntok, csum, tag = _RECORD.unpack(raw)
    if flags & ~TAGGED:
        raise BadRecord(f"unknown record flags {flags:#x}")
    dtype = serde.CODE_DTYPES.get(code)
    if dtype is None:
        raise BadRecord(f"unknown dtype code {code}")
    shape = (s0, s1, s2, s3)
    if n <= 0 or s0 * s1 * s2 * s3 * dtype.itemsize != n:
        raise BadRecord(f"shape {shape} of {dtype} does not match length {n}")
    if s2 != ntok:
        raise BadRecord(f"token count {ntok} does not match shape {shape}")
    if ver == 0:
        raise BadRecord("version 0 marks a free slot; an advertised chunk has version >= 1")
    return Record(key, off, n, ver, slot, dtype, shape, ntok, csum,
                  tag if flags & TAGGED else None)


@dataclasses.dataclass(frozen=True)
class PeerInfo:
    """What a reader needs to address an owner: its NIXL metadata (covering its export window
    and version table only) and where those lie in its address space. ``pool_base`` and
    ``pool_size`` are the *window*'s (the names are the wire's)."""

    agent: str
    metadata: bytes
    pool_base: int
    pool_size: int
    versions_addr: int
    slots: int

    def as_meta(self) -> dict:
        return {"agent": self.agent, "metadata": self.metadata, "pool_base": self.pool_base,
                "pool_size": self.pool_size, "versions_addr": self.versions_addr,
                "slots": self.slots}

    def check(self, rec: Record) -> None:
        """The record lies inside this peer's export window and version table."""
        if rec.offset + rec.nbytes > self.pool_size:
            raise BadRecord(f"record [{rec.offset}, +{rec.nbytes}) runs past the peer's "
                            f"{self.pool_size} B export window")
        if rec.slot >= self.slots:
            raise BadRecord(f"slot {rec.slot} past the peer's {self.slots} version slots")


def peer_info(meta: dict) -> PeerInfo:
    """A :class:`PeerInfo` from msgpack metadata, every field type- and range-checked."""
    agent = meta.get("agent")
    md = meta.get("metadata")
    if not isinstance(agent, str) or not 0 < len(agent.encode()) <= MAX_AGENT_NAME:
        raise ValueError(f"agent must be a name of 1..{MAX_AGENT_NAME} bytes")
    if not isinstance(md, bytes) or not 0 < len(md) <= MAX_METADATA:
        raise ValueError(f"metadata must be 1..{MAX_METADATA} bytes of bin")
    ints = {}
    for f in ("pool_base", "pool_size", "versions_addr", "slots"):
        v = meta.get(f)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 64:
            raise ValueError(f"field {f!r} must be an unsigned 64-bit integer")
        ints[f] = v
    if ints["pool_size"] == 0 or ints["slots"] == 0:
        raise ValueError("pool_size and slots must be positive")
    return PeerInfo(agent, md, **ints)
