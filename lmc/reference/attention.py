"""Paged attention over a vLLM flash-layout KV cache, in plain torch.

Cache layout, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads,
head_size]``, K in plane 0 and V in plane 1. Token position ``p`` of a sequence lives in
slot ``block_ids[p // block_size] * block_size + p % block_size``; viewing a plane as
``[num_blocks * block_size, heads, head_size]`` makes a slot a row index.

A step's tokens arrive flattened (all sequences back to back). Attention is two moves:
``write_kv`` scatters the new tokens' K/V into their slots, then ``attend`` gathers each
sequence's whole context back from the cache by slot and runs
``scaled_dot_product_attention``. Reading everything back from the cache (rather than
using the freshly computed K/V) is deliberate: it is what makes KV loaded by a connector
count exactly like KV computed here.

Sequences with one new token (decodes, and prefills whose last chunk is a single token)
are batched into one padded SDPA call; longer chunks run one SDPA call per sequence,
so no work is spent on padding a decode row to a prefill's length.

Sliding-window layers (a hybrid model's, ``ModelConfig.layer_types``) attend to the last
``W`` positions only, the query's own included (as vLLM and Hugging Face count it): their
metadata (``AttentionMetadata.windows[W]``) gathers only those positions from the cache,
so a position before every query's window is never read -- what lets a KV cache hold only
the window (as lmc loads it: :mod:`lmc.hybrid`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SequenceChunk:
    """What one sequence contributes to a step: positions
    ``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` are computed now,
    everything before is already in the cache (``block_ids`` cover all of it)."""

    num_computed_tokens: int
    num_new_tokens: int
    block_ids: Sequence[int]


@dataclass
class PrefillSlice:
    """A multi-token chunk: its rows in the flat batch and its full context."""

    query_start: int
    query_len: int
    context_slots: torch.Tensor  # [context_len] slots of positions 0..context_len-1
    mask: torch.Tensor | None  # [query_len, context_len] bool; None means plain causal
    # a chunk after cached context, causal: (first query row, rows, mask [rows, keys]) per
    # block of queries, each over the keys it can see (see build_attention_metadata)
    causal_blocks: tuple[tuple[int, int, torch.Tensor], ...] = ()


@dataclass
class AttentionMetadata:
    """Everything attention needs about the step's batch; built once, used by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] slot of each new token
    prefills: list[PrefillSlice]
    decode_rows: torch.Tensor | None  # [num_decodes] rows of single-token sequences
    decode_context_slots: torch.Tensor | None  # [num_decodes, max_context] padded
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool
    num_tokens: int
    # rows whose K/V this forward writes; None: every row. A blended step leaves out the rows
    # whose K/V come from a cached segment (see lmc.blend.step)
    write_rows: torch.Tensor | None = None
    # sliding-window layers' metadata, by window (the same step, narrower contexts)
    windows: dict[int, AttentionMetadata] = field(default_factory=dict)

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata of a layer with this sliding window (``None``: full attention)."""
        return self if window is None else self.windows[window]


def slots_for_positions(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Map token positions to cache slots through a sequence's block table."""
    return block_ids[positions // block_size] * block_size + positions % block_size


def build_attention_metadata(
    chunks: Sequence[SequenceChunk], block_size: int, device: torch.device | str,
    windows: Sequence[int] = (),
) -> AttentionMetadata:
    """Slot mappings, gather indices and masks for a batch of sequence chunks, and for each
    sliding window in ``windows`` the same step's metadata for layers with that window.

    Computed on the CPU with vectorised torch ops (one small loop per sequence, none per
    token) and moved to ``device`` once.
    """
    meta = _build(chunks, block_size, torch.device(device), None)
    for w in sorted(set(windows)):
        meta.windows[w] = _build(chunks, block_size, torch.device(device), w)
    return meta


def _window_mask(start: int, n: int, lo: int, context_len: int, window: int,
                 device: torch.device) -> torch.Tensor:
    """[n, context_len - lo]: query at ``start + i`` sees key ``lo + j`` when it is no later
    and within the window (``q - window < k <= q``)."""
    q = torch.arange(start, start + n, device=device)[:, None]
    k = torch.arange(lo, context_len, device=device)[None, :]
    return (k <= q) & (k > q - window)


def _build(chunks: Sequence[SequenceChunk], block_size: int, device: torch.device,
           window: int | None) -> AttentionMetadata:
    device = torch.device(device)
    slot_parts: list[torch.Tensor] = []
    prefills: list[PrefillSlice] = []
    decode_rows: list[int] = []
    decode_slots: list[torch.Tensor] = []
    row = 0
    for chunk in chunks:
        start, n = chunk.num_computed_tokens, chunk.num_new_tokens
        if n <= 0:
            raise ValueError(f"a scheduled sequence must have new tokens, got num_new_tokens={n}")
        context_len = start + n
        needed_blocks = -(-context_len // block_size)
        if len(chunk.block_ids) < needed_blocks:
            raise ValueError(
                f"sequence needs {needed_blocks} blocks for {context_len} tokens, "
                f"has {len(chunk.block_ids)}"
            )
        table = torch.as_tensor(list(chunk.block_ids[:needed_blocks]), dtype=torch.long)
        context_slots = slots_for_positions(table, torch.arange(context_len), block_size)
        slot_parts.append(context_slots[start:])
        if window is not None and context_len > window:  # only the windows' positions
            lo = max(0, start - window + 1)
            if n == 1:
                decode_rows.append(row)
                decode_slots.append(context_slots[lo:])
            else:
                prefills.append(PrefillSlice(row, n, context_slots[lo:].to(device),
                                             _window_mask(start, n, lo, context_len, window,
                                                          device)))
        elif n == 1:
            decode_rows.append(row)
            decode_slots.append(context_slots)
        else:
            prefills.append(PrefillSlice(row, n, context_slots.to(device), None,
                                         causal_blocks(start, n, device)))
        row += n

    decode_rows_t = decode_slots_t = decode_mask = None
    if decode_rows:
        lengths = torch.tensor([len(s) for s in decode_slots])
        width = int(lengths.max())
        # Pad with the sequence's own first slot: always valid, written data, so the
        # masked-out columns can never carry NaN/garbage into the product with V.
        padded = torch.stack([F.pad(s, (0, width - len(s)), value=int(s[0])) for s in decode_slots])
        decode_mask = (torch.arange(width)[None, :] < lengths[:, None])[:, None, None, :]
        decode_rows_t = torch.tensor(decode_rows, dtype=torch.long, device=device)
        decode_slots_t = padded.to(device)
        decode_mask = decode_mask.to(device)

    return AttentionMetadata(
        slot_mapping=torch.cat(slot_parts).to(device) if slot_parts else torch.empty(0, dtype=torch.long, device=device),
        prefills=prefills,
        decode_rows=decode_rows_t,
        decode_context_slots=decode_slots_t,
        decode_mask=decode_mask,
        num_tokens=row,
    )


QUERY_BLOCK = 512  # rows per SDPA call of a chunk that follows cached context


def causal_blocks(start: int, n: int, device: torch.device | str
                  ) -> tuple[tuple[int, int, torch.Tensor], ...]:
    """Causal attention of ``n`` queries at positions ``start..start+n-1`` over keys
    ``0..start+n-1``, cut into blocks of queries: each block attends only to the keys up
    to its last position, masked within its own rows. One masked call over every key would
    compute the whole ``n x (start + n)`` rectangle (a masked SDPA skips nothing), 1.6-1.8x
    the work of the causal part on the CPU; a flash kernel, as real engines run, skips it.
    Empty for a chunk with nothing before it (plain causal)."""
    if start <= 0:
        return ()
    out = []
    for b0 in range(0, n, QUERY_BLOCK):
        b1 = min(n, b0 + QUERY_BLOCK)
        keys = start + b1
        # built where it is used: no host tensor copied to the device per block and step
        mask = (torch.arange(keys, device=device)[None, :]
                <= torch.arange(start + b0, start + b1, device=device)[:, None])
        out.append((b0, b1 - b0, mask))
    return tuple(out)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new ``key/value [num_tokens, kv_heads, head_size]`` into their slots."""
    _, _, _, kv_heads, head_size = kv_cache.shape
    kv_cache[0].view(-1, kv_heads, head_size).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, kv_heads, head_size).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def attend(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Causal attention of ``query [num_tokens, heads, head_size]`` over each sequence's
    context as it stands in the cache. Returns ``[num_tokens, heads, head_size]``."""
    _, _, _, kv_heads, head_size = kv_cache.shape
    gqa = query.shape[1] != kv_heads  # SDPA shares each KV head among its query heads
    k_rows = kv_cache[0].view(-1, kv_heads, head_size)
    v_rows = kv_cache[1].view(-1, kv_heads, head_size)
    out = torch.empty_like(query)

    for p in meta.prefills:
        q = query[p.query_start : p.query_start + p.query_len].transpose(0, 1)  # [H, n, D]
        k = k_rows.index_select(0, p.context_slots).transpose(0, 1)
        v = v_rows.index_select(0, p.context_slots).transpose(0, 1)
        if p.causal_blocks:
            kq, vq = k[None].to(q.dtype), v[None].to(q.dtype)
            for b0, rows, mask in p.causal_blocks:
                keys = mask.shape[1]
                o = F.scaled_dot_product_attention(
                    q[None, :, b0:b0 + rows], kq[:, :, :keys], vq[:, :, :keys],
                    attn_mask=mask, enable_gqa=gqa)
                out[p.query_start + b0:p.query_start + b0 + rows] = o[0].transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(
            q[None], k[None].to(q.dtype), v[None].to(q.dtype),
            attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=gqa,
        )
        out[p.query_start : p.query_start + p.query_len] = o[0].transpose(0, 1)

    if meta.decode_rows is not None:
        q = query.index_select(0, meta.decode_rows)[:, :, None, :]  # [B, H, 1, D]
        k = k_rows[meta.decode_context_slots].permute(0, 2, 1, 3)
        v = v_rows[meta.decode_context_slots].permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=meta.decode_mask, enable_gqa=gqa
        )
        out[meta.decode_rows] = o[:, :, 0, :]
    return out
