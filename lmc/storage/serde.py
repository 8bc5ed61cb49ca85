"""The header every chunk carries outside process memory (disk files, Redis values, the daemon).

Layout, little-endian, 72 bytes::

    magic "LMCK" | version u16 | flags u16 | key 16B | dtype u8 | pad 3B
    | shape 4 x u32 | num_tokens u32 | payload_len u64 | payload xxh3_64 u64
    | header xxh3_64 u64 (over the 64 bytes before it)

A value is served only if the header checksum holds, the key in the header is the key asked
for (a file renamed to another key's name, or a hash-slot mixup, is caught), the shape, dtype
and length agree with each other and with what the engine expects, and the payload checksum
holds. Anything else raises :class:`CorruptValue`, which every tier turns into a miss (and
deletes the bad value): corrupt KV is never returned.

Versions. Version 1 is the value as above. Version 2 has the same 72 header bytes followed by
a ``TAG_SIZE``-byte keyed integrity tag (:mod:`lmc.storage.integrity`), then the payload: shared tiers
write it when ``integrity_secret`` is set. A reader accepts exactly the version its own
configuration writes (``tagged``), so a value written with the other setting is a miss rather
than a value served unchecked. The checksums only catch accidents (anyone can recompute an
xxh3); the tag is what a writer without the secret cannot forge.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    import torch

    from lmc.memory.pool import MemoryObj

MAGIC = b"LMCK"
VERSION = 1         # header, payload
VERSION_TAGGED = 2  # header, integrity tag, payload
TAG_SIZE = 32       # bytes of the version-2 tag (see lmc.storage.integrity)
_FIELDS = struct.Struct("<4sHH16sB3x4IIQQ")
HEADER_SIZE = _FIELDS.size + 8  # 72

# dtype codes, by torch's names: the maps (DTYPE_CODES, CODE_DTYPES) are made on first use,
# so that what reads headers without tensors (``lmc stats``, the daemon's protocol module)
# does not wait seconds for torch to import
_CODE_NAMES = {"float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4,
               "float8_e5m2": 5, "uint8": 6, "int8": 7}
_maps: tuple[dict[Any, int], dict[int, Any]] | None = None


def _dtype_maps() -> tuple[dict[torch.dtype, int], dict[int, torch.dtype]]:
    global _maps
    if _maps is None:
        import torch

        codes = {getattr(torch, n): c for n, c in _CODE_NAMES.items() if hasattr(torch, n)}
        _maps = (codes, {c: d for d, c in codes.items()})
    return _maps


def __getattr__(name: str) -> Any:
    """``DTYPE_CODES`` (torch dtype -> code) and ``CODE_DTYPES`` (code -> dtype)."""
    if name == "DTYPE_CODES":
        return _dtype_maps()[0]
    if name == "CODE_DTYPES":
        return _dtype_maps()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CorruptValue(ValueError):
    """A stored value failed a check; the tier treats it as a miss and deletes it."""


@dataclasses.dataclass(frozen=True)
class Header:
    key: bytes
    dtype: torch.dtype
    shape: tuple[int, int, int, int]
    num_tokens: int
    payload_len: int
    checksum: int
    flags: int = 0
    version: int = VERSION

    @property
    def tagged(self) -> bool:
        """A ``TAG_SIZE``-byte integrity tag follows the header."""
        return self.version == VERSION_TAGGED


def encodable(obj) -> bool:
    """Whether a header can describe ``obj`` (a 4-D chunk of a dtype with a code): a tier
    that serializes skips any other chunk (the contract in ``lmc.storage.tier``)."""
    return len(obj.shape) == 4 and obj.dtype in (_maps or _dtype_maps())[0]


def payload_checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(key: bytes, shape, dtype: torch.dtype, num_tokens: int, payload,
                  checksum: int | None = None, flags: int = 0, tagged: bool = False) -> bytes:
    """Header for ``payload`` (any buffer: bytes, memoryview, numpy array); ``tagged``
    writes version 2, whose tag the caller appends (``lmc.storage.integrity.Integrity.seal``)."""
    if len(key) != 16:
        raise ValueError(f"key must be 16 bytes, got {len(key)}")
    if len(shape) != 4:
        raise ValueError(f"chunk shape must be 4-D [layers, planes, tokens, width], got {shape}")
    code = (_maps or _dtype_maps())[0].get(dtype)
    if code is None:
        raise TypeError(f"dtype {dtype} has no serialisation code")
    mv = memoryview(payload).cast("B")
    csum = payload_checksum(mv) if checksum is None else checksum
    version = VERSION_TAGGED if tagged else VERSION
    body = _FIELDS.pack(MAGIC, version, flags, key, code, *shape, num_tokens,
                        mv.nbytes, csum)
    return body + xxhash.xxh3_64_digest(body)


def decode_header(buf, expected_key: bytes | None = None, tagged: bool = False) -> Header:
    """Parse and check a header (the first ``HEADER_SIZE`` bytes of ``buf``). ``tagged``:
    the reader has an integrity secret, so only version 2 is accepted; else only version 1."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < HEADER_SIZE:
        raise CorruptValue(f"value too short for a header: {mv.nbytes} < {HEADER_SIZE} bytes")
    body = mv[: _FIELDS.size]
    if xxhash.xxh3_64_digest(body) != bytes(mv[_FIELDS.size: HEADER_SIZE]):
        raise CorruptValue("header checksum mismatch")
    magic, version, flags, key, code, s0, s1, s2, s3, ntok, plen, csum = _FIELDS.unpack(body)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {magic!r}")
    if version not in (VERSION, VERSION_TAGGED):
        raise CorruptValue(f"unsupported format version {version} (this build reads "
                           f"{VERSION} and {VERSION_TAGGED})")
    if tagged and version != VERSION_TAGGED:
        raise CorruptValue("value has no integrity tag (written without integrity_secret; "
                           "every engine sharing a store must use the same secret)")
    if not tagged and version == VERSION_TAGGED:
        raise CorruptValue("value carries an integrity tag but no integrity_secret is set "
                           "here (every engine sharing a store must use the same secret)")
    if expected_key is not None and key != expected_key:
        raise CorruptValue(f"value holds key {key.hex()}, expected {expected_key.hex()}")
    dtype = (_maps or _dtype_maps())[1].get(code)
    if dtype is None:
        raise CorruptValue(f"unknown dtype code {code}")
    shape = (s0, s1, s2, s3)
    if s0 * s1 * s2 * s3 * dtype.itemsize != plen:
        raise CorruptValue(f"shape {shape} of {dtype} does not match payload length {plen}")
    if s2 != ntok:
        raise CorruptValue(f"token count {ntok} does not match shape {shape}")
    return Header(key, dtype, shape, ntok, plen, csum, flags, version)


def verify_payload(header: Header, payload) -> None:
    mv = memoryview(payload).cast("B")
    if mv.nbytes != header.payload_len:
        raise CorruptValue(f"payload is {mv.nbytes} bytes, header says {header.payload_len}")
    if payload_checksum(mv) != header.checksum:
        raise CorruptValue("payload checksum mismatch")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (a pool object's payload)."""
    import torch

    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("payload tensor must be a contiguous CPU tensor")
    return t.view(torch.uint8).reshape(-1).numpy().data


# Byte views of pool objects (socket I/O). One implementation:
# :meth:`lmc.memory.pool.MemoryObj.byte_view` (a slice of one cached memoryview of the
# pool's buffer, checked against a freed object). Why not ``tensor_bytes``: it builds a
# typed tensor view, a byte view, a reshape and a numpy array per object, about 20 us; at a
# few GiB/s of 1 MiB values that is several percent of a core. That path remains only for an
# object whose pool is not a CPU :class:`MemoryPool`.


@functools.cache
def _cpu_pool_class() -> type:
    from lmc.memory.pool import MemoryPool

    return MemoryPool


def byte_view(obj: MemoryObj) -> memoryview:
    """A writable, zero-copy byte view of ``obj``'s memory."""
    pool = obj.pool
    if isinstance(pool, _cpu_pool_class()) and pool.buffer.device.type == "cpu":
        return obj.byte_view()
    return tensor_bytes(obj.tensor)
