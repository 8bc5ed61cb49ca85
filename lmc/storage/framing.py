"""The one framing stage every shared tier's values go through (disk, Redis, ``lmc://``, P2P).

A value outside process memory is ``[head][payload]``: the head is the
:mod:`lmc.storage.serde` header (key, shape, dtype, token count, payload length and checksum,
its own checksum) and, with an ``integrity_secret``, the keyed tag after it
(:mod:`lmc.storage.integrity`). Where each tier keeps the head differs -- in front of the
payload (Redis), in a 4 KiB block of its own (disk), as a companion value (``lmc://``), in a
directory record (P2P) -- but what is written and what a read must pass is the same, so it
lives here, once: which header version goes with a secret, the geometry check before
anything is allocated, the payload checksum (whole, or streamed by a reader that hashed the
payload as it landed) and the tag at the end.

Each tier holds one :class:`ValueFraming` as ``tier.framing`` and calls it on every write and on
every read path; :meth:`ValueFraming.verify` is the last word on every value a read returns.
The framing never copies a payload: it reads the caller's buffer in place (xxh3 and Poly1305
over a memoryview), and returns only the head's few bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmc.storage.serde import (
    HEADER_SIZE,
    TAG_SIZE,
    CorruptValue,
    Header,
    decode_header,
    encode_header,
    payload_checksum,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from lmc.memory.pool import MemoryObj
    from lmc.storage.integrity import Geometry, Integrity


class ValueFraming:
    """Makes the head of every value a tier writes and checks every value it reads."""

    def __init__(self, integrity: Integrity | None = None) -> None:
        self.integrity = integrity
        self.tagged = integrity is not None
        """Values carry a keyed tag (header version 2); a reader accepts only this version."""
        self.size = HEADER_SIZE + (TAG_SIZE if self.tagged else 0)
        """Bytes of a head: the header, and the tag with a secret."""

    # ------------------------------------------------------------------ writing
    @staticmethod
    def digest(payload: Any) -> int:
        """The payload checksum a header carries (xxh3-64 over the bytes, in place)."""
        return payload_checksum(payload)

    def header(self, key: bytes, shape: Sequence[int], dtype: torch.dtype, num_tokens: int,
               payload: Any, checksum: int | None = None, tagged: bool | None = None) -> bytes:
        """The ``HEADER_SIZE``-byte header for ``payload`` (read in place; ``checksum``: its
        xxh3 when the caller has it). ``tagged`` defaults to this framing's version."""
        return encode_header(key, tuple(shape), dtype, num_tokens, payload, checksum=checksum,
                             tagged=self.tagged if tagged is None else tagged)

    def seal(self, key: bytes, header: bytes, payload: Any) -> bytes:
        """The keyed tag that follows ``header`` (a framing with a secret only)."""
        if self.integrity is None:
            raise ValueError("this framing has no integrity secret: its values carry no tag")
        return self.integrity.seal(key, header, payload)

    def encode(self, key: bytes, obj: MemoryObj, payload: Any, checksum: int | None = None
               ) -> bytes:
        """The head for ``obj`` (``payload``: its bytes, read, never copied)."""
        header = self.header(key, obj.shape, obj.dtype, obj.num_tokens, payload, checksum)
        if self.integrity is None:
            return header
        return header + self.integrity.seal(key, header, payload)

    # ------------------------------------------------------------------ reading
    def decode(self, head: Any, key: bytes, geometry: Geometry | None = None) -> Header:
        """The header at the start of ``head``, checked: its checksum, the version a secret
        requires (or forbids), the key, and -- given the engine's geometry -- the shape and
        dtype, before anything is allocated for the value. Raises ``CorruptValue``."""
        hdr = decode_header(head, expected_key=key, tagged=self.tagged)
        if geometry is not None:
            geometry.check(hdr.shape, hdr.dtype)
        return hdr

    def verify(self, key: bytes, head: Any, hdr: Header, payload: Any,
               digest: int | None = None) -> None:
        """The payload, once whole: its length, its checksum against ``hdr`` (``digest``: the
        xxh3 a reader computed as the payload landed, else hashed here) and, with a secret,
        the tag in ``head`` (exactly ``size`` bytes) over key, header and payload. Every read
        path calls this last; raises ``CorruptValue``."""
        mv = memoryview(payload).cast("B")
        if mv.nbytes != hdr.payload_len:
            raise CorruptValue(f"payload is {mv.nbytes} bytes, header says {hdr.payload_len}")
        if (payload_checksum(mv) if digest is None else digest) != hdr.checksum:
            raise CorruptValue("payload checksum mismatch")
        if len(head) != self.size:
            raise CorruptValue(f"value head is {len(head)} bytes, expected {self.size}")
        if self.integrity is not None:
            self.integrity.check(key, head[:HEADER_SIZE], head[HEADER_SIZE:], mv)

    def admit(self, key: bytes, obj: MemoryObj, tag: Any = None,
              geometry: Geometry | None = None) -> None:
        """A value whose payload checksum its transport already verified against the
        writer's header (the ``lmc://`` client checks it as the payload arrives): its
        geometry and, with a secret, its ``tag`` (a companion value), then :meth:`verify`
        with the head recomputed from the object. Raises ``CorruptValue``."""
        if geometry is not None:
            geometry.check(obj.shape, obj.dtype)
        payload = obj.byte_view()
        if self.integrity is None:
            # nothing keyed to check: the checksum was verified in transit, so the head is
            # rebuilt with a stand-in checksum rather than hashing the payload a second time
            header = self.header(key, obj.shape, obj.dtype, obj.num_tokens, payload, 0)
            head = header
        else:
            if tag is None:
                raise CorruptValue("no integrity tag (evicted, or written without the secret)")
            header = self.header(key, obj.shape, obj.dtype, obj.num_tokens, payload)
            head = header + bytes(tag)
        hdr = decode_header(header, expected_key=key, tagged=self.tagged)
        self.verify(key, head, hdr, payload, digest=hdr.checksum)
