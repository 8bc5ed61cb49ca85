"""What a value read back from another process must pass: keyed tags and the engine's geometry.

Tiers using it: Redis and the ``lmc://`` daemon (keyed tags and geometry), the disk tier
(geometry only: its directory is one process's), the SGLang page store (geometry of a page).
Peers: ``lmc/storage/backends/p2p/backend.py`` and ``docs/threats/p2p.md`` say what they verify. Threat
model of the others: ``docs/threats/tiers.md``.

Why: the ``lmc.storage.serde`` checksums catch accidents, not intent. Anyone who can write to a shared
store can recompute an xxh3, so a value rewritten with a self-consistent header would be
served as KV. With ``integrity_secret`` set, every value a shared tier writes carries a tag
only a holder of the secret can compute, over the key asked for, the header and the payload;
a value whose tag does not verify is a miss (and deleted, like any bad value).

What protects whom: a writer to the store (or the wire) without the secret cannot forge a
value, alter one, or replay one under another key (the key is authenticated, and the header
holds it). A holder of the secret can do all of these; nothing is encrypted.

The tag (``TAG_SIZE`` = 32 bytes) is a 16-byte random nonce and a 16-byte Poly1305 tag: the
nonce and a master key derived from the secret give a fresh one-time key per value
(keyed BLAKE2b), and ChaCha20-Poly1305 (RFC 8439) authenticates ``key || header`` as its
plaintext and the payload as its associated data, so the payload is read in place, never
copied. Why not keyed BLAKE2b or HMAC-SHA256 over the payload: measured here (2 cores, SHA
extensions), BLAKE2b runs at ~0.5 GiB/s and HMAC-SHA256 at ~1.3, below the Redis tier's own
2-3 GiB/s, so the tag would halve the tier; Poly1305 runs at ~5 GiB/s
(``benchmarks/bench_redis.py`` prints it next to memcpy). A fresh key per value means no
one-time key is ever used twice, whatever the number of values.

Geometry. The checksums say a value is intact, not that it is this engine's: a writer to the
store can rewrite a header's shape or dtype (and its checksum) so that the value describes a
chunk no engine of this key namespace stores. Every read path of a tier given a
:class:`Geometry` (:func:`expect_geometry`) refuses such a value from its header, before
allocating for it, exactly like a checksum failure: counted, deleted, served as a miss. So a
rewritten value can neither sit in the store for ever (readers missing, writers skipping the
key as present) nor reach L1.

Secrets. ``integrity_secret`` and ``integrity_secret_file`` follow one rule: surrounding
whitespace is not part of the secret (a file's trailing newline), what is left must be at
least ``lmc.settings.MIN_SECRET_BYTES`` long; every refusal names the setting (and the file). A file that
group or others may read is used with a warning (once per file and mode); one they may write
is refused, since whoever rewrites it chooses the secret.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import stat
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from lmc.settings import check_secret
from lmc.storage.serde import TAG_SIZE, CorruptValue

if TYPE_CHECKING:  # annotations only: `lmc config` checks a secret without torch's seconds
    import torch

log = logging.getLogger(__name__)

NONCE_SIZE = 16
_AEAD_NONCE = bytes(12)  # each one-time key authenticates one value: a constant nonce is safe
_MASTER_PERSON = b"lmc-int-master"
_VALUE_PERSON = b"lmc-int-value"
_DOCUMENT_PERSON = b"lmc-int-doc"


class MissingPackage(RuntimeError, ImportError):
    """An optional package a setting needs; the message names the extra that installs it
    (an ImportError too, so that the ``lmc`` command prints it as one line)."""


def _aead() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    except ImportError:
        raise MissingPackage("integrity_secret needs the 'cryptography' package: "
                             "pip install 'lmc-kvcache[integrity]'") from None
    return ChaCha20Poly1305


class Integrity:
    """Seals and checks values with one secret. Thread-safe (no mutable state)."""

    def __init__(self, secret: bytes | str, setting: str = "integrity_secret") -> None:
        raw = check_secret(secret, setting)
        self._aead = _aead()
        self._master = hashlib.blake2b(raw, digest_size=32, person=_MASTER_PERSON).digest()
        self._documents = hashlib.blake2b(raw, digest_size=32, person=_DOCUMENT_PERSON).digest()

    def __repr__(self) -> str:  # never shows the secret
        return "Integrity(<secret>)"

    @classmethod
    def from_config(cls, config: Any) -> Integrity | None:
        """From ``integrity_secret`` or ``integrity_secret_file``; None when neither is set."""
        secret = getattr(config, "integrity_secret", None)
        path = getattr(config, "integrity_secret_file", None)
        if secret and path:
            raise ValueError("set integrity_secret or integrity_secret_file, not both")
        if path:
            return cls(_read_secret_file(str(path)), f"integrity_secret_file {str(path)!r}")
        return cls(secret) if secret is not None and secret != "" else None

    def _tag(self, nonce: bytes, key: bytes, header: bytes, payload: Any) -> bytes:
        one_time = hashlib.blake2b(nonce, key=self._master, digest_size=32,
                                   person=_VALUE_PERSON).digest()
        sealed = self._aead(one_time).encrypt(_AEAD_NONCE, bytes(key) + bytes(header), payload)
        return sealed[-16:]  # the Poly1305 tag; the "ciphertext" of key+header is not needed

    def seal(self, key: bytes, header: bytes, payload: Any) -> bytes:
        """The ``TAG_SIZE``-byte tag that follows ``header`` for ``payload`` under ``key``."""
        nonce = os.urandom(NONCE_SIZE)
        return nonce + self._tag(nonce, key, header, payload)

    def check(self, key: bytes, header: bytes, tag: Any, payload: Any) -> None:
        """Raise :class:`CorruptValue` unless ``tag`` is this secret's tag for exactly this
        key, header and payload."""
        tag = bytes(tag)
        if len(tag) != TAG_SIZE:
            raise CorruptValue(f"integrity tag is {len(tag)} bytes, expected {TAG_SIZE}")
        want = self._tag(tag[:NONCE_SIZE], key, header, payload)
        if not hmac.compare_digest(want, tag[NONCE_SIZE:]):
            raise CorruptValue("integrity tag does not verify (forged or altered value, a "
                               "value copied from another key, or a different secret)")


    def document_tag(self, kind: bytes, content: bytes) -> str:
        """A keyed BLAKE2b tag (hex) over a small document's canonical bytes (a blending
        verdict): only a holder of the secret can make one. ``kind`` (at most 16 bytes) keeps
        one kind of document's tag from vouching for another's. Speed is no concern here
        (kilobytes, once at start-up), unlike values' tags."""
        return hashlib.blake2b(content, key=self._documents, digest_size=32,
                               person=kind).hexdigest()

    def document_tag_valid(self, kind: bytes, content: bytes, tag: Any) -> bool:
        return isinstance(tag, str) and tag.isascii() and hmac.compare_digest(
            self.document_tag(kind, content), tag)


_warned_modes: set[tuple[str, int]] = set()


def _read_secret_file(path: str) -> bytes:
    """The file's bytes, refused when others may rewrite it, warned about when others may
    read it (``chmod 600``)."""
    setting = f"integrity_secret_file {path!r}"
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise ValueError(f"{setting}: not a regular file")
            if mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise ValueError(f"{setting}: mode {stat.S_IMODE(mode):04o} lets group or others "
                                 f"rewrite the secret (so choose it); chmod 600 {path}")
            data = f.read(1 << 16)
    except OSError as e:
        raise ValueError(f"{setting}: cannot read it: {e.strerror or e}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH) and (path, mode) not in _warned_modes:
        _warned_modes.add((path, mode))
        log.warning("%s: mode %04o lets group or others read the secret (anyone who reads it "
                    "can forge values); chmod 600 %s", setting, stat.S_IMODE(mode), path)
    return data


# --------------------------------------------------------------------------- geometry
@dataclasses.dataclass(frozen=True)
class Geometry:
    """The chunks one engine's keys hold: ``[layers, planes, tokens, width]`` of ``dtype``
    with ``min_tokens <= tokens <= max_tokens`` (the key namespace fixes all of them but the
    token count of a prompt's last chunk)."""

    layers: int
    planes: int
    width: int
    dtype: torch.dtype
    max_tokens: int
    min_tokens: int = 1
    head_size: int | None = dataclasses.field(default=None, compare=False)
    """Elements of one head in a token's width (a KV codec's scale groups); not checked."""

    @classmethod
    def of(cls, spec: Any, max_tokens: int, min_tokens: int = 1) -> Geometry:
        """From a :class:`lmc.transfer.kv_spec.KVSpec` and the chunk (or page) size."""
        layers, planes, _, width = spec.chunk_shape(1)
        return cls(layers, planes, width, spec.dtype, max_tokens, min_tokens,
                   head_size=spec.head_size)

    @property
    def max_bytes(self) -> int:
        """The payload of the largest chunk: no read of this engine allocates more."""
        return self.layers * self.planes * self.max_tokens * self.width * self.dtype.itemsize

    def check(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Raise :class:`CorruptValue` unless ``shape``/``dtype`` is one of these chunks."""
        shape = tuple(shape)
        if (dtype != self.dtype or len(shape) != 4
                or (shape[0], shape[1], shape[3]) != (self.layers, self.planes, self.width)
                or not self.min_tokens <= shape[2] <= self.max_tokens):
            raise CorruptValue(
                f"value holds {list(shape)} {_dtype_name(dtype)}, this engine's chunks are "
                f"[{self.layers}, {self.planes}, {self._tokens()}, {self.width}] "
                f"{_dtype_name(self.dtype)} (header rewritten, or another engine's value)")

    def _tokens(self) -> str:
        if self.min_tokens == self.max_tokens:
            return str(self.max_tokens)
        return f"{self.min_tokens}..{self.max_tokens}"


@dataclasses.dataclass(frozen=True)
class GroupGeometry(Geometry):
    """A hybrid model's chunks: one part per KV group, each a :class:`Geometry` of its
    own (``members``); a value must be one of them. The base fields are the largest
    member's, so ``max_bytes`` bounds every read."""

    members: tuple[Geometry, ...] = ()

    @classmethod
    def of_groups(cls, spec: Any, max_tokens: int) -> Geometry:
        """From a hybrid :class:`lmc.transfer.kv_spec.KVSpec` (a plain one: ``Geometry.of``)."""
        if not spec.groups:
            return Geometry.of(spec, max_tokens)
        members = []
        for i in range(len(spec.groups)):
            layers, planes, tokens, width = spec.group_chunk_shape(i, max_tokens)
            members.append(Geometry(layers, planes, width, spec.group_dtype(i), tokens))
        big = max(members, key=lambda m: m.max_bytes)
        return cls(big.layers, big.planes, big.width, big.dtype, big.max_tokens,
                   big.min_tokens, head_size=spec.head_size, members=tuple(members))

    @property
    def max_bytes(self) -> int:
        return max(m.max_bytes for m in self.members)

    def check(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        for m in self.members:
            try:
                m.check(shape, dtype)
                return
            except CorruptValue:
                continue
        raise CorruptValue(f"value holds {list(shape)} {_dtype_name(dtype)}, which is no KV "
                           f"group part of this engine's ({len(self.members)} groups)")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def expect_geometry(tiers: Iterable[Any], geometry: Geometry | None) -> int:
    """Give every tier that checks geometry (an ``expected_geometry`` attribute: disk, Redis,
    ``lmc://``) the engine's; returns how many took it. ``None`` turns the check off."""
    n = 0
    for tier in tiers:
        if hasattr(tier, "expected_geometry"):
            tier.expected_geometry = geometry
            n += 1
    return n
