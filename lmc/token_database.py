"""Content addresses for token chunks: a 128-bit xxh3 chain seeded by a namespace digest.

``key[i] = xxh3_128(key[i-1] || little-endian uint32 bytes of chunk i)``, with ``key[-1]`` the
namespace digest. A key therefore names the whole prefix up to the end of its chunk, so equal
prefixes give equal keys in every process and on every machine (no Python ``hash()`` anywhere),
and a change of model, KV shape, dtype, sharding, chunk size or tenant gives disjoint keys.

The prompt is converted to bytes once (``struct.pack`` for lists, a dtype cast for tensors and
arrays) and hashed with one call per chunk: no per-token Python work.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

FORMAT_VERSION = 1
KEY_BYTES = 16
ChunkKey = bytes  # 16 bytes

Tokens = Any  # list[int] | np.ndarray | torch.Tensor


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
        if tokens.dtype != np.uint32 and tokens.size:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi > 0xFFFFFFFF:
                raise ValueError(f"token ids must be in [0, 2**32), got range [{lo}, {hi}]")
        return tokens.astype("<u4", copy=False).tobytes()
    if isinstance(tokens, (list, tuple)):
        try:
            return struct.pack(f"<{len(tokens)}I", *tokens)
        except struct.error as e:
            raise ValueError(f"token ids must be ints in [0, 2**32): {e}") from None
    raise TypeError(f"tokens must be a list of ints, numpy array or torch tensor, "
                    f"got {type(tokens).__name__}")


class ChunkedTokenDatabase:
    """Cuts a prompt into ``chunk_size`` chunks and gives each its chained key."""

    def __init__(self, chunk_size: int = 256, save_unfull_chunk: bool = True,
                 namespace: bytes = b"\0" * KEY_BYTES) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if len(namespace) != KEY_BYTES:
            raise ValueError(f"namespace must be {KEY_BYTES} bytes, got {len(namespace)}")
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self.namespace = bytes(namespace)

    def num_tokens(self, tokens: Tokens) -> int:
        return tokens.shape[0] if hasattr(tokens, "shape") else len(tokens)

    def keys(self, tokens: Tokens, limit: int | None = None) -> list[ChunkKey]:
        """Keys of the chunks of ``tokens`` (the partial tail included when configured).

        ``limit`` caps the number of tokens considered (a prefix of the prompt).
        """
        data = tokens_to_bytes(tokens)
        n = len(data) // 4 if limit is None else min(limit, len(data) // 4)
        step = self.chunk_size * 4
        end = n * 4 if self.save_unfull_chunk else (n // self.chunk_size) * step
        mv = memoryview(data)
        digest = xxhash.xxh3_128_digest
        prev = self.namespace
        out: list[ChunkKey] = []
        append = out.append
        for off in range(0, end, step):
            prev = digest(prev + mv[off: min(off + step, end)])
            append(prev)
        return out

    def process_tokens(self, tokens: Tokens, mask: Sequence[bool] | torch.Tensor | np.ndarray
                       | None = None) -> list[tuple[int, int, ChunkKey]]:
        """``[(start, end, key)]`` for every chunk whose tokens the mask selects.

        ``mask`` False marks a prefix that the caller does not want (already cached, say): it
        must cover whole chunks, else ``ValueError``. Keys still chain through that prefix.
        """
        n = self.num_tokens(tokens)
        skip = self.mask_prefix(mask, n)
        keys = self.keys(tokens)
        cs = self.chunk_size
        out = []
        for i, key in enumerate(keys):
            start = i * cs
            if start >= skip:
                out.append((start, min(start + cs, n), key))
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


def key_hex(key: ChunkKey) -> str:
    return key.hex()

