"""The model on one sequence, with KV the caller can read out and replace.

The quality harness needs what an engine hides: the exact KV of a prompt, a way to put other
KV (what a lossy feature would serve) in its place, and the logits of tokens computed on top
of it. ``SequenceRunner`` runs the reference engine's own model (``lmc.reference.model``, the
same layers, attention and RoPE the engine and its connectors use) over a private cache that
holds one sequence: position ``p`` is slot ``p``. Single-threaded, one sequence at a time.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import torch

from lmc.reference.attention import SequenceChunk, build_attention_metadata
from lmc.reference.kv_cache import allocate_kv_caches
from lmc.reference.loader import load_model, resolve_dtype


class SequenceRunner:
    """``capacity``: the longest sequence (prompt and answer) it will hold."""

    def __init__(self, model_dir: str | Path, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", capacity: int = 2048) -> None:
        self.device = torch.device(device)
        self.model = load_model(Path(model_dir), dtype, self.device)
        self.config = self.model.config
        self.dtype = resolve_dtype(dtype, self.config)
        if not 1 <= capacity <= self.config.max_position_embeddings:
            raise ValueError(f"a sequence of {capacity} tokens does not fit the model's "
                             f"{self.config.max_position_embeddings} positions")
        self.capacity = capacity
        # one block as long as the capacity: slot == position
        self.kv_caches = allocate_kv_caches(self.config, 1, capacity, self.dtype, self.device)

    @torch.no_grad()
    def forward(self, ids: Sequence[int], start: int, logits_from: int | None = 0
                ) -> torch.Tensor | None:
        """Compute ``ids`` at positions ``start..`` over the cache's ``[0, start)`` (their
        K/V written into it); the fp32 logits of rows ``logits_from..`` ``[rows, vocab]``,
        or None when ``logits_from`` is None."""
        n = len(ids)
        if n < 1 or start < 0 or start + n > self.capacity:
            raise ValueError(f"positions {start}..{start + n} do not fit a cache of "
                             f"{self.capacity}")
        meta = build_attention_metadata([SequenceChunk(start, n, [0])], self.capacity,
                                        self.device)
        ids_t = torch.tensor(list(ids), dtype=torch.long, device=self.device)
        pos_t = torch.arange(start, start + n, device=self.device)
        hidden = self.model(ids_t, pos_t, self.kv_caches, meta)
        if logits_from is None:
            return None
        return self.model.compute_logits(hidden[logits_from:]).cpu()

    def read_kv(self, n: int) -> torch.Tensor:
        """K/V of positions ``[0, n)``: ``[layers, 2, n, kv_heads, head_dim]``, a copy in the
        cache dtype."""
        return torch.stack([kv[:, 0, :n] for kv in self.kv_caches]).cpu().clone()

    def write_kv(self, kv: torch.Tensor) -> None:
        """Put ``kv`` (shaped as :meth:`read_kv` returns) at positions ``[0, kv.shape[2])``."""
        n = kv.shape[2]
        want = (len(self.kv_caches), 2, n, *self.kv_caches[0].shape[3:])
        if tuple(kv.shape) != want or n > self.capacity:
            raise ValueError(f"served KV has shape {tuple(kv.shape)}, expected {want}")
        if kv.dtype != self.dtype:
            raise ValueError(f"served KV is {kv.dtype}, the cache holds {self.dtype}")
        for layer, cache in zip(kv.to(self.device), self.kv_caches, strict=True):
            cache[:, 0, :n] = layer

    @torch.no_grad()
    def greedy(self, first: int, start: int, max_tokens: int, stop: Collection[int]
               ) -> list[int]:
        """Greedy tokens from ``first`` (already chosen, placed at ``start``) over the cache's
        ``[0, start)``: ``first`` and what follows, up to a stop token (kept) or
        ``max_tokens`` in all."""
        out = [first]
        while out[-1] not in stop and len(out) < max_tokens:
            logits = self.forward([out[-1]], start + len(out) - 1)
            assert logits is not None
            out.append(int(logits[-1].argmax()))
        return out
