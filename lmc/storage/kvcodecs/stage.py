"""A tier's codec stage: a lossy codec and/or a lossless compressor, and the value header that
says what a stored value holds.

A coded value is ``[header][body]``, one uint8 run the tier below stores and frames like any
chunk (its :mod:`lmc.storage.serde` header, checksum and keyed tag cover every byte of it).
The header (:data:`HEADER`, 80 bytes, little-endian)::

    magic "LMCZ" | version u8 | method u8 | lossless u8 | dtype code u8 | stage ident 32 B
    | pad 4 | shape 4 x u32 | stored body length u64 | body length before lossless u64

``method`` is ``CODED`` (the lossy codec's layer blocks) or ``EXACT`` (the chunk's own bytes:
a dtype the codec does not take, or values it cannot represent, such as a NaN); ``lossless``
is 0 or the compressor that shrank the body. The stage ident names the codec and every
parameter (``int4-kivi.g32.h64+zstd1``): a reader whose own ident differs refuses the value
(it also lives under other keys, :meth:`CodecStage.namespace`), so a reader configured
otherwise misses, never misreads. Every length is checked against the shape before anything
is decoded or decompressed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Mapping
from typing import Any

import torch

from lmc.storage.kvcodecs.base import KVCodec, NotEncodable
from lmc.storage.kvcodecs.fp8 import Fp8E4M3
from lmc.storage.kvcodecs.int4 import Int4Kivi
from lmc.storage.kvcodecs.int8 import Int8
from lmc.storage.kvcodecs.lossless import NAMES as LOSSLESS_NAMES
from lmc.storage.kvcodecs.lossless import Lossless
from lmc.storage.serde import CODE_DTYPES, DTYPE_CODES, CorruptValue

MAGIC = b"LMCZ"
VERSION = 1
EXACT, CODED = 0, 1
_FIELDS = struct.Struct("<4sBBBB32s4x4IQQ")
HEADER = _FIELDS.size  # 80
CODECS: dict[str, type[KVCodec]] = {c.name: c for c in (Fp8E4M3, Int8, Int4Kivi)}
ALIASES = {"fp8": "fp8-e4m3", "int4": "int4-kivi"}
NO_CODEC = ("none", "exact")


@dataclasses.dataclass(frozen=True)
class Coded:
    """What one chunk became: the header's fields and the body to store after it."""

    method: int
    lossless: int
    body: Any  # a uint8 tensor or bytes
    body_len: int  # before the lossless stage

    @property
    def stored_len(self) -> int:
        return len(self.body) if isinstance(self.body, bytes) else self.body.numel()


class CodecStage:
    """A lossy codec (or none) and a lossless compressor (or none), as one tier applies them."""

    def __init__(self, codec: KVCodec | None, lossless: Lossless | None = None) -> None:
        if codec is None and lossless is None:
            raise ValueError("a codec stage needs a lossy codec, a lossless stage, or both")
        self.codec = codec
        self.lossless = lossless
        self.ident = "+".join(p for p in (codec.ident if codec else "exact",
                                          lossless.ident if lossless else "") if p)
        if len(self.ident.encode()) > 32:
            raise ValueError(f"codec stage {self.ident!r} is too long to name in a header")
        self.mask = int.from_bytes(hashlib.blake2b(self.ident.encode(), digest_size=16,
                                                   person=b"lmc-kv-codec").digest(), "little")

    def __repr__(self) -> str:
        return f"CodecStage({self.ident})"

    @property
    def lossy(self) -> bool:
        return self.codec is not None

    # ------------------------------------------------------------------ keys
    def namespace(self, key: bytes) -> bytes:
        """``key`` in this stage's namespace: XOR with a mask derived from the ident (its own
        inverse, so the tier below's evictions map back to the engine's keys)."""
        return (int.from_bytes(key, "little") ^ self.mask).to_bytes(len(key), "little")

    def namespace_prefix(self, prefix: bytes) -> bytes:
        """What every namespaced key of a key starting with ``prefix`` starts with: the
        mask's XOR is byte for byte (little-endian), so a prefix maps on its own bytes."""
        mask = self.mask.to_bytes(16, "little")
        return bytes(b ^ mask[i] if i < 16 else b for i, b in enumerate(prefix))

    # ------------------------------------------------------------------ sizes
    def coded_bytes(self, shape: tuple[int, int, int, int], dtype: torch.dtype) -> int:
        """Body bytes of a coded chunk of ``shape`` (before lossless)."""
        assert self.codec is not None
        return self.codec.encoded_bytes(shape)

    def max_stored(self, shape: tuple[int, int, int, int], dtype: torch.dtype) -> int:
        """The largest value (header and body) a chunk of ``shape`` may be stored as."""
        exact = _numel(shape) * dtype.itemsize
        coded = self.codec.encoded_bytes(shape) if self.codec and self.encodes(dtype) else 0
        return HEADER + max(exact, coded)

    def encodes(self, dtype: torch.dtype) -> bool:
        return self.codec is not None and self.codec.accepts(dtype)

    # ----------------------------------------------------------------- coding
    def encode(self, x: torch.Tensor) -> Coded:
        """The body for chunk ``x``: coded when the codec takes it, else its exact bytes;
        then compressed when that shrinks it."""
        method, body = EXACT, x.reshape(-1).view(torch.uint8)
        if self.encodes(x.dtype):
            assert self.codec is not None
            buf = torch.empty(self.codec.encoded_bytes(tuple(x.shape)), dtype=torch.uint8)
            try:
                self.codec.encode(x, buf)
                method, body = CODED, buf
            except NotEncodable:
                pass
        n = body.numel()
        if self.lossless is not None:
            packed = self.lossless.compress(body.numpy())
            if len(packed) < n:
                return Coded(method, self.lossless.code, packed, n)
        return Coded(method, 0, body, n)

    def header(self, coded: Coded, shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
        return _FIELDS.pack(MAGIC, VERSION, coded.method, coded.lossless, DTYPE_CODES[dtype],
                            self.ident.encode(), *shape, coded.stored_len, coded.body_len)

    def read_header(self, head: Any, stored: int) -> tuple[int, int, torch.dtype,
                                                            tuple[int, int, int, int], int]:
        """``(method, lossless, dtype, shape, body_len)`` of a value of ``stored`` bytes,
        checked: magic, version, this stage's ident, lengths against the shape. Raises
        :class:`CorruptValue`."""
        if stored < HEADER:
            raise CorruptValue(f"coded value too short for its header: {stored} bytes")
        magic, version, method, lossless, code, ident, s0, s1, s2, s3, slen, blen = \
            _FIELDS.unpack(bytes(head[:HEADER]))
        if magic != MAGIC or version != VERSION:
            raise CorruptValue(f"not a coded value (magic {magic!r}, version {version})")
        theirs = ident.rstrip(b"\0").decode("ascii", "replace")
        if theirs != self.ident:
            raise CorruptValue(f"value coded as {theirs!r}, this tier reads {self.ident!r}")
        dtype = CODE_DTYPES.get(code)
        shape = (s0, s1, s2, s3)
        if dtype is None or min(shape) < 1:
            raise CorruptValue(f"coded value of unknown dtype code {code} or shape {shape}")
        if slen != stored - HEADER:
            raise CorruptValue(f"coded body is {stored - HEADER} bytes, the header says {slen}")
        if method == CODED and self.encodes(dtype):
            want = self.coded_bytes(shape, dtype)
        elif method == EXACT:
            want = _numel(shape) * dtype.itemsize
        else:
            raise CorruptValue(f"coded value of method {method} for {dtype}")
        if blen != want or lossless not in (0, self.lossless.code if self.lossless else 0):
            raise CorruptValue(f"coded body of {blen} bytes (lossless {lossless}), a "
                               f"{list(shape)} chunk is {want}")
        if lossless == 0 and slen != blen:
            raise CorruptValue(f"coded body is {slen} bytes uncompressed, expected {blen}")
        return method, lossless, dtype, shape, blen

    def decode(self, method: int, lossless: int, body: Any, body_len: int,
               out: torch.Tensor) -> None:
        """``body`` (the stored bytes after the header) into ``out``, the chunk."""
        if lossless:
            assert self.lossless is not None
            body = torch.frombuffer(bytearray(self.lossless.decompress(body, body_len)),
                                    dtype=torch.uint8)
        elif not isinstance(body, torch.Tensor):
            body = torch.frombuffer(body, dtype=torch.uint8)
        if method == EXACT:
            out.reshape(-1).view(torch.uint8).copy_(body)
            return
        assert self.codec is not None
        self.codec.decode(body, out)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What a tier holding ``x`` through this stage gives back."""
        if not self.encodes(x.dtype):
            return x.clone()
        assert self.codec is not None
        return self.codec.round_trip(x)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def make_codec(name: str, head_size: int | None = None, **params: Any) -> KVCodec:
    """A lossy codec by name (``fp8-e4m3``/``fp8``, ``int8``, ``int4-kivi``/``int4``)."""
    cls = CODECS.get(ALIASES.get(name, name))
    if cls is None:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)} "
                         f"(or {', '.join(NO_CODEC)} with a lossless stage)")
    try:
        return cls(head_size=head_size, **params)
    except TypeError:
        raise ValueError(f"codec {name!r} takes no parameter "
                         f"{', '.join(map(repr, params))}") from None


def parse_stage(value: Any, where: str = "codec", head_size: int | None = None) -> CodecStage:
    """A stage from config: ``int4-kivi``, ``int4-kivi,group=64+zstd``, ``exact+lz4``, or a mapping
    ``{name: int4-kivi, group: 32, lossless: zstd, level: 3}``. ``ValueError`` names
    ``where``."""
    try:
        if isinstance(value, str):
            lossy, _, rest = value.partition("+")
            name, *params = lossy.split(",")
            spec: dict[str, Any] = {"name": name, "lossless": rest or None}
            for p in params:
                k, eq, v = p.partition("=")
                if not eq or not v.isdigit():
                    raise ValueError(f"codec parameter {p!r}: expected name=<integer>, as in "
                                     "int4-kivi,group=64")
                spec[k] = int(v)
        elif isinstance(value, Mapping):
            spec = dict(value)
        else:
            raise ValueError(f"expected a codec name such as int4-kivi or fp8+zstd, or a "
                             f"mapping with name:, got {value!r}")
        name = spec.pop("name", None)
        lossless, level = spec.pop("lossless", None), spec.pop("level", 1)
        size = spec.pop("head_size", head_size)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a codec needs a name ({', '.join(CODECS)} or none), got {name!r}")
        if lossless is not None and lossless not in LOSSLESS_NAMES:
            raise ValueError(f"unknown lossless stage {lossless!r}; choose one of "
                             f"{', '.join(LOSSLESS_NAMES)}")
        codec = None if name in NO_CODEC else make_codec(name, size, **spec)
        if codec is None and spec:
            raise ValueError(f"parameters {sorted(spec)} need a lossy codec")
        return CodecStage(codec, Lossless(lossless, level) if lossless else None)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
