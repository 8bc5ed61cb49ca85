"""Content addresses for token chunks: a 128-bit xxh3 chain seeded by a namespace digest.

``key[i] = xxh3_128(key[i-1] || little-endian uint32 bytes of chunk i)``, with ``key[-1]`` the
namespace digest. A key therefore names the whole prefix up to the end of its chunk, so equal
prefixes give equal keys in every process and on every machine (no Python ``hash()`` anywhere),
and a change of model, KV shape, dtype, sharding, chunk size or tenant gives disjoint keys.
A request with a LoRA adapter or a ``cache_salt`` starts its chain from a root of its own,
:func:`request_root` of the namespace and its :func:`request_tag`; a request with neither
starts from the namespace, so its keys are exactly what they always were.

The prompt is converted to bytes once (the optional C helper ``lmc._tokens`` or
``array.fromlist`` for lists, a dtype cast for tensors and arrays) and hashed with one call per
chunk: no per-token Python work. :class:`RequestKeys` keeps a growing request's keys so each
scheduler step hashes only the chunks its new tokens completed.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
import xxhash

FORMAT_VERSION = 1
KEY_BYTES = 16
ChunkKey = bytes  # 16 bytes
Chunk = tuple[int, int, ChunkKey]  # (start, end, key) of one chunk of a prompt

Tokens = Any  # list[int] | np.ndarray | torch.Tensor

try:  # built by setup.py when a C compiler is present: ~5x faster list packing and chaining
    from lmc._tokens import chain as _native_chain
    from lmc._tokens import u32le as _native_u32le
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _native_u32le = _native_chain = None


_U32 = next(c for c in "IL" if array.array(c).itemsize == 4)  # 'I' on every platform we know


def _list_u32le(tokens: list[int] | tuple[int, ...]) -> bytes:
    """Pure-Python packing: ``array.fromlist`` unboxes ~2x faster than ``struct.pack(*)``."""
    a = array.array(_U32)
    try:
        a.fromlist(tokens if isinstance(tokens, list) else list(tokens))
    except (OverflowError, TypeError) as e:
        bad = next((i for i, t in enumerate(tokens)
                    if not isinstance(t, int) or not 0 <= t <= 0xFFFFFFFF), None)
        raise (TypeError if isinstance(e, TypeError) else ValueError)(
            f"token ids must be ints in [0, 2**32): token {bad} is {tokens[bad]!r}"
            if bad is not None else f"token ids must be ints in [0, 2**32): {e}") from None
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
        a.byteswap()
    return a.tobytes()


def pack_list(tokens: list[int] | tuple[int, ...]) -> bytes:
    """Little-endian uint32 bytes of a list of token ids (C helper when built)."""
    if _native_u32le is not None:
        return _native_u32le(tokens)
    return _list_u32le(tokens)


def namespace_digest(
    model_id: str,
    kv_fields: dict[str, Any],
    tp_rank: int = 0,
    tp_size: int = 1,
    chunk_size: int = 256,
    tenant: str | None = None,
) -> bytes:
    """The chain's seed: everything that must match for two chunks' KV to be interchangeable."""
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
    if not (0 <= tp_rank < tp_size):
        raise ValueError(f"tp_rank must be in [0, tp_size), got tp_rank={tp_rank} tp_size={tp_size}")
    doc = {
        "format": FORMAT_VERSION,
        "model": model_id,
        "kv": kv_fields,
        "tp": [tp_rank, tp_size],
        "chunk": chunk_size,
        "tenant": tenant,
    }
    return xxhash.xxh3_128_digest(json.dumps(doc, sort_keys=True).encode())


_TAG_PERSON = b"lmc-key-tag"  # BLAKE2b personalisations: these digests are no chain key's
_ROOT_PERSON = b"lmc-key-root"


def _field(kind: bytes, value: str | None, what: str) -> bytes:
    """One field of a tag: absent and empty are different (length-prefixed, so no value can
    end where another begins)."""
    if value is None:
        return kind + b"\xff"
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string or None, got {type(value).__name__}")
    raw = value.encode("utf-8", "surrogatepass")  # any str: lone surrogates are data too
    return kind + b"\x01" + len(raw).to_bytes(8, "little") + raw


def request_tag(lora_name: str | None = None, cache_salt: str | None = None) -> bytes | None:
    """The part of a request's key root that is the request's own: its LoRA adapter and its
    ``cache_salt``; ``None`` for a request with neither (its keys are the namespace's chain,
    exactly as before tags existed, so stored KV stays valid).

    Why these fields: they are what vLLM's prefix cache folds into its block hashes besides
    the tokens (multimodal inputs and prompt embeddings are not cached by lmc at all). An
    adapter changes the weights, hence the KV of the same tokens; a salt is its user's wish to
    share KV only with requests of the same salt (a hit shows in the time to first token).

    * **LoRA identity is the adapter's name**, as the requests name it (vLLM's
      ``lora_request.lora_name``). vLLM's own cache also folds in the adapter's local path;
      lmc leaves the path out so that instances that load the same adapter from different
      places share. The operator must ensure that one name means the same weights on every
      instance sharing lmc's tiers (re-pointing a name at new weights needs a new name, or
      another ``tenant``).
    * **The salt is never recoverable from a key:** it enters only through BLAKE2b
      (preimage-resistant, unlike the xxh3 of the chain), so the tag, the root and every
      key are digests of it. A salt of any length and content is accepted (it is hashed,
      never stored); an empty salt is a salt, apart from no salt.

    The tag is the same on every tensor-parallel rank (it travels in the connector's
    metadata and lookups, 16 bytes); each rank's root is :func:`request_root` of it.
    ``TypeError`` names a field that is not a string.
    """
    if lora_name is None and cache_salt is None:
        return None
    if lora_name is not None and isinstance(lora_name, str) and not lora_name:
        raise ValueError("a LoRA adapter's name must not be empty")
    data = _field(b"L", lora_name, "the LoRA adapter's name") + \
        _field(b"S", cache_salt, "cache_salt")
    return hashlib.blake2b(data, digest_size=KEY_BYTES, person=_TAG_PERSON).digest()


def request_root(namespace: bytes, tag: bytes | None) -> bytes:
    """Where a request's key chain starts: the namespace digest itself without a tag (the
    keys of every untagged request are unchanged), else a BLAKE2b digest of the namespace and
    the tag (:func:`request_tag`), so a tagged chain shares no key with an untagged one or
    with another tag's (a chain key is an xxh3 output: equal to a BLAKE2b one by chance
    only, 2^-128)."""
    if tag is None:
        return namespace
    if len(tag) != KEY_BYTES or len(namespace) != KEY_BYTES:
        raise ValueError(f"a key tag and a namespace are {KEY_BYTES} bytes, got "
                         f"{len(tag)} and {len(namespace)}")
    return hashlib.blake2b(bytes(namespace) + bytes(tag), digest_size=KEY_BYTES,
                           person=_ROOT_PERSON).digest()


class RootedKeys(list):
    """A request's chunk keys from a root other than the namespace (a tagged request): a
    plain list of keys that also says so, for the listeners that describe chunks by their
    tokens (KV events), which must not take them for the namespace's."""

    root: bytes = b""


def _rooted(keys: list[ChunkKey], root: bytes) -> list[ChunkKey]:
    out = RootedKeys(keys)
    out.root = root
    return out


def tokens_to_bytes(tokens: Tokens) -> bytes:
    """Little-endian uint32 bytes of the token ids: the only form that is hashed."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor, got {tokens.dtype}")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens must be integers, got dtype {tokens.dtype}")
        # int64 (what tensors hold) is checked in one pass: a negative id read as uint64 is huge
        if tokens.dtype != np.uint32 and tokens.size and (
                tokens.dtype != np.int64 or int(tokens.view(np.uint64).max()) > 0xFFFFFFFF):
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi > 0xFFFFFFFF:
                raise ValueError(f"token ids must be in [0, 2**32), got range [{lo}, {hi}]")
        return tokens.astype("<u4", copy=False).tobytes()
    if isinstance(tokens, (list, tuple)):
        return pack_list(tokens)
    raise TypeError(f"tokens must be a list of ints, numpy array or torch tensor, "
                    f"got {type(tokens).__name__}")


class KeysObserver(Protocol):
    """Told of each prompt a :class:`ChunkedTokenDatabase` keys from its namespace (never of a
    tagged request's :class:`RootedKeys`): KV events note which tokens each key stands for
    (``lmc.events``). Called on the caller's thread: an observer only queues or records."""

    def on_keys(self, tokens: Tokens, keys: Sequence[ChunkKey], num_tokens: int) -> None:
        """:meth:`ChunkedTokenDatabase.keys` keyed the first ``num_tokens`` of ``tokens``."""

    def on_chunks(self, tokens: Tokens, keys: Sequence[ChunkKey], num_tokens: int,
                  chunks: list[Chunk]) -> None:
        """:meth:`ChunkedTokenDatabase.process_tokens` cut ``tokens`` with the caller's
        ``keys`` (computed ahead, so :meth:`on_keys` was not called) into ``chunks``."""


class ChunkedTokenDatabase:
    """Cuts a prompt into ``chunk_size`` chunks and gives each its chained key.

    Observers (:meth:`add_observer`) are told of every plain prompt keyed; the database
    itself never changes for them (KV events attach here rather than replacing it)."""

    def __init__(self, chunk_size: int = 256, save_unfull_chunk: bool = True,
                 namespace: bytes = b"\0" * KEY_BYTES) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if len(namespace) != KEY_BYTES:
            raise ValueError(f"namespace must be {KEY_BYTES} bytes, got {len(namespace)}")
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self.namespace = bytes(namespace)
        self.observers: tuple[KeysObserver, ...] = ()  # replaced whole: readers take no lock

    def add_observer(self, observer: KeysObserver) -> None:
        self.observers = (*self.observers, observer)

    def remove_observer(self, observer: KeysObserver) -> None:
        self.observers = tuple(o for o in self.observers if o is not observer)

    def num_tokens(self, tokens: Tokens) -> int:
        return tokens.shape[0] if hasattr(tokens, "shape") else len(tokens)

    def keys(self, tokens: Tokens, limit: int | None = None, root: bytes | None = None
             ) -> list[ChunkKey]:
        """Keys of the chunks of ``tokens`` (the partial tail included when configured).

        ``limit`` caps the number of tokens considered (a prefix of the prompt). ``root``: where
        the chain starts (a tagged request's, :func:`request_root`); the namespace when None
        or equal to it. A chain from another root is a :class:`RootedKeys`.
        """
        whole = tokens
        if limit is not None and limit < self.num_tokens(tokens):
            tokens = tokens[:limit]
        data = tokens_to_bytes(tokens)
        n = len(data) // 4
        end = n * 4 if self.save_unfull_chunk else (n // self.chunk_size) * self.chunk_size * 4
        out: list[ChunkKey] = []
        start = self.namespace if root is None else bytes(root)
        self._chain(start, data, end, out)
        if start != self.namespace:
            return _rooted(out, start)
        if out:
            for o in self.observers:
                o.on_keys(whole, out, n)
        return out

    def chain_keys(self, prev: bytes, data: bytes, end: int) -> list[ChunkKey]:
        """The chained keys of ``data[:end]`` (little-endian uint32 tokens) from ``prev``:
        the same chain as a prompt's, from another starting point (the daemon derives its
        event block hashes this way, from a seed of its own)."""
        out: list[ChunkKey] = []
        self._chain(prev, data, end, out)
        return out

    def _chain(self, prev: bytes, data: bytes, end: int, out: list[ChunkKey]) -> bytes:
        """Append the chained keys of ``data[:end]`` (chunk by chunk) to ``out``; returns the
        last key (the chain's state)."""
        step = self.chunk_size * 4
        if _native_chain is not None and end:
            keys = _native_chain(prev, data, step, end, xxhash.xxh3_128_digest)
            out += keys
            return keys[-1]
        mv = memoryview(data)
        digest = xxhash.xxh3_128_digest
        append = out.append
        for off in range(0, end, step):
            prev = digest(prev + mv[off: min(off + step, end)])
            append(prev)
        return prev

    def request_keys(self, root: bytes | None = None) -> RequestKeys:
        """A key cache for one growing request (see :class:`RequestKeys`), its chain from
        ``root`` (the namespace when None)."""
        return RequestKeys(self, root)

    def num_chunks(self, num_tokens: int) -> int:
        """Chunks (hence keys) of a prompt of ``num_tokens`` tokens."""
        cs = self.chunk_size
        return -(-num_tokens // cs) if self.save_unfull_chunk else num_tokens // cs

    def check_keys(self, keys: Sequence[ChunkKey], num_tokens: int) -> list[ChunkKey]:
        """Keys a caller computed ahead (:class:`RequestKeys`) for a prompt of
        ``num_tokens`` tokens: their count and size are checked, their content is the
        caller's promise (checking it would cost the hashing it saves)."""
        want = self.num_chunks(num_tokens)
        if len(keys) != want:
            raise ValueError(f"{len(keys)} precomputed keys for {num_tokens} tokens, "
                             f"expected {want} (chunk_size {self.chunk_size})")
        if keys and len(keys[-1]) != KEY_BYTES:
            raise ValueError(f"precomputed keys must be {KEY_BYTES} bytes, "
                             f"got {len(keys[-1])}")
        return list(keys)

    def process_tokens(self, tokens: Tokens, mask: Sequence[bool] | torch.Tensor | np.ndarray
                       | None = None, keys: Sequence[ChunkKey] | None = None) -> list[Chunk]:
        """``[(start, end, key)]`` for every chunk whose tokens the mask selects.

        ``mask`` False marks a prefix that the caller does not want (already cached, say): it
        must cover whole chunks, else ``ValueError``. Keys still chain through that prefix.
        ``keys``: this prompt's keys, already computed (see :meth:`check_keys`).
        """
        n = self.num_tokens(tokens)
        skip = self.mask_prefix(mask, n)
        tell = keys is not None and not isinstance(keys, RootedKeys) and self.observers
        keys = self.keys(tokens) if keys is None else self.check_keys(keys, n)
        cs = self.chunk_size
        first = -(-skip // cs)  # the first chunk starting at or after the skipped prefix
        lo, hi = first * cs, len(keys) * cs
        out = list(zip(range(lo, hi, cs), range(lo + cs, hi + cs, cs), keys[first:]))
        if out and out[-1][1] > n:  # the partial tail ends at the prompt's end
            out[-1] = (out[-1][0], n, out[-1][2])
        if tell:
            for o in self.observers:
                o.on_chunks(tokens, keys, n, out)
        return out

    def mask_prefix(self, mask: Any, n: int) -> int:
        """Length of the False prefix of ``mask``; checks that the rest is True and aligned."""
        if mask is None:
            return 0
        m = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
        if m.dtype != np.bool_:
            raise TypeError(f"mask must be boolean, got dtype {m.dtype}")
        if m.shape != (n,):
            raise ValueError(f"mask has shape {m.shape}, tokens have length {n}")
        skip = int(np.argmax(m)) if m.any() else n
        if not m[skip:].all():
            raise ValueError("mask must be a False prefix followed by True only")
        if skip % self.chunk_size and skip != n:
            raise ValueError(f"mask's False prefix ({skip} tokens) must be a multiple of "
                             f"chunk_size ({self.chunk_size})")
        return skip


class RequestKeys:
    """The keys of one request's token sequence, extended as its tokens arrive.

    Why: a request is looked up, loaded and saved at many scheduler steps while its prompt
    (and then its output) grows; hashing the whole sequence each time costs O(length) per
    step. Full chunks are hashed once and kept; a call hashes only the chunks completed
    since the last one, and the partial tail. A shorter sequence (a load cut at a chunk
    boundary, say) is answered from the kept keys.

    Contract: one ``RequestKeys`` follows one append-only token sequence (an engine's
    request: its tokens never change, only grow). Checking the whole prefix again would cost
    what this saves, so each call checks one chunk: the last full chunk it shares with what
    was hashed is re-hashed and compared with the kept key, and on a mismatch (a reused
    request id, a caller bug) everything is hashed afresh. Callers drop a request's
    ``RequestKeys`` when the request ends.
    """

    __slots__ = ("db", "root", "_full", "_hashed", "restarts")

    def __init__(self, db: ChunkedTokenDatabase, root: bytes | None = None) -> None:
        if root is not None and len(root) != KEY_BYTES:
            raise ValueError(f"a key root must be {KEY_BYTES} bytes, got {len(root)}")
        self.db = db
        self.root = db.namespace if root is None else bytes(root)
        self._full: list[ChunkKey] = []   # keys of the complete chunks hashed so far
        self._hashed = 0                   # tokens those chunks cover
        self.restarts = 0                  # calls whose tokens did not match (diagnostics)

    def keys(self, tokens: Tokens) -> list[ChunkKey]:
        """Same result as ``db.keys(tokens)``, hashing only what is new since the last call."""
        db = self.db
        n = db.num_tokens(tokens)
        cs = db.chunk_size
        full_end = n // cs * cs
        if self._hashed and not self._matches(tokens, min(full_end, self._hashed)):
            self.restarts += 1
            self._full, self._hashed = [], 0
        if full_end > self._hashed:
            data = tokens_to_bytes(tokens[self._hashed: full_end])
            prev = self._full[-1] if self._full else self.root
            db._chain(prev, data, len(data), self._full)
            self._hashed = full_end
        out = self._full[: full_end // cs]
        if db.save_unfull_chunk and n > full_end:
            prev = out[-1] if out else self.root
            out.append(xxhash.xxh3_128_digest(prev + tokens_to_bytes(tokens[full_end:n])))
        return out if self.root == db.namespace else _rooted(out, self.root)

    def _matches(self, tokens: Tokens, end: int) -> bool:
        """Whether the full chunk ending at ``end`` hashes to the key kept for it."""
        if end <= 0:
            return True
        i = end // self.db.chunk_size - 1
        prev = self._full[i - 1] if i else self.root
        chunk = tokens_to_bytes(tokens[end - self.db.chunk_size: end])
        return xxhash.xxh3_128_digest(prev + chunk) == self._full[i]

    @property
    def hashed_tokens(self) -> int:
        """Tokens whose full chunks are cached (diagnostics and tests)."""
        return self._hashed


def key_hex(key: ChunkKey) -> str:
    return key.hex()

