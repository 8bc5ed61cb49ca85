"""How a shared tier frames one chunk: ``[head][payload]``, the head being the
:mod:`lmc.storage.serde` header (key, shape, dtype, token count, payload length and checksum, its own
checksum) and, with an ``integrity_secret``, the keyed tag after it (:mod:`lmc.storage.integrity`).

One object per tier (:class:`ValueHead`) makes the head and checks it, so the rules -- which
header version goes with a secret, the geometry check before anything is allocated, the
payload checksum and the tag at the end -- live in one place instead of in each reader and
writer. This is the first step of the codec stage (docs/design.md, "The tier kit"): the Redis
tier (whole and layered reads, writes) goes through it; the disk tier, ``lmc://`` (client
and daemon) and P2P still frame their values themselves, each in its own layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmc.storage.serde import (
    HEADER_SIZE,
    TAG_SIZE,
    Header,
    decode_header,
    encode_header,
    verify_payload,
)

if TYPE_CHECKING:
    from lmc.memory.pool import MemoryObj
    from lmc.storage.integrity import Geometry, Integrity


class ValueHead:
    """The head of every value a tier writes, and its checks on every value it reads."""

    def __init__(self, integrity: Integrity | None = None) -> None:
        self.integrity = integrity
        self.size = HEADER_SIZE + (TAG_SIZE if integrity is not None else 0)
        """Bytes before the payload."""

    def encode(self, key: bytes, obj: MemoryObj, payload: Any) -> bytes:
        """The head for ``obj`` (``payload``: its bytes, read, never copied)."""
        header = encode_header(key, obj.shape, obj.dtype, obj.num_tokens, payload,
                               tagged=self.integrity is not None)
        if self.integrity is None:
            return header
        return header + self.integrity.seal(key, header, payload)

    def decode(self, head: Any, key: bytes, geometry: Geometry | None = None) -> Header:
        """The header at the start of ``head``, checked: its checksum, the version a secret
        requires (or forbids), the key, and -- given the engine's geometry -- the shape and
        dtype, before anything is allocated for the value. Raises ``CorruptValue``."""
        hdr = decode_header(head, expected_key=key, tagged=self.integrity is not None)
        if geometry is not None:
            geometry.check(hdr.shape, hdr.dtype)
        return hdr

    def verify(self, key: bytes, head: Any, hdr: Header, payload: Any) -> None:
        """The payload, once whole: its length and checksum against ``hdr`` and, with a
        secret, the tag in ``head`` over key, header and payload. Raises ``CorruptValue``."""
        verify_payload(hdr, payload)
        self.check_tag(key, head, payload)

    def check_tag(self, key: bytes, head: Any, payload: Any) -> None:
        """The tag alone (a reader that checksummed the payload as it arrived)."""
        if self.integrity is not None:
            self.integrity.check(key, head[:HEADER_SIZE], head[HEADER_SIZE:self.size],
                                 payload)
