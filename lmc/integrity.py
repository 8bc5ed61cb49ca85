"""Keyed integrity tags for values in shared stores (Redis, the lmc daemon, peers).

Why: the ``lmc.serde`` checksums catch accidents, not intent. Anyone who can write to a shared
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
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

from lmc.serde import TAG_SIZE, CorruptValue

NONCE_SIZE = 16
MIN_SECRET_BYTES = 16
_AEAD_NONCE = bytes(12)  # each one-time key authenticates one value: a constant nonce is safe
_MASTER_PERSON = b"lmc-int-master"
_VALUE_PERSON = b"lmc-int-value"
SECRET_HINT = 'e.g. python3 -c "import secrets; print(secrets.token_hex(32))"'


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

    def __init__(self, secret: bytes | str) -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(raw) < MIN_SECRET_BYTES:
            raise ValueError(f"integrity_secret: at least {MIN_SECRET_BYTES} bytes of random "
                             f"secret are needed, got {len(raw)} ({SECRET_HINT})")
        self._aead = _aead()
        self._master = hashlib.blake2b(raw, digest_size=32, person=_MASTER_PERSON).digest()

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
            try:
                data = Path(path).read_bytes().strip()
            except OSError as e:
                raise ValueError(f"integrity_secret_file {path!r}: cannot read it: "
                                 f"{e.strerror or e}") from None
            if not data:
                raise ValueError(f"integrity_secret_file {path!r} is empty ({SECRET_HINT})")
            return cls(data)
        return cls(secret) if secret else None

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
