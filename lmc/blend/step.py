"""One blended forward: which rows keep cached K/V, and which are recomputed after the check.

CacheBlend's observation: a segment's K/V cached alone differ from what the full prompt would
give only through cross-attention to what precedes it, and a small set of tokens carries most
of that difference. Layer 0's K/V depend on the token and its position alone, so they are
equal to the placed cache (to rounding); the first layer whose K/V can differ is
``check_layer`` (1). So: every row of the step is computed through the layers before it
(queries for all rows, cached rows keeping their placed K/V), then at ``check_layer`` every
cached row's fresh K/V are compared with its cached ones and, per request, the
``ratio`` fraction with the largest deviation joins the rows that are computed from there on
(new tokens always are). The others keep their cached K/V in every layer and are not
computed further: that is the saving.

With ``ratio = 1`` every row is computed with fresh K/V from ``check_layer`` on, which equals
a full prefill to float rounding (layer 0's placed K/V differ only by rounding); with
``ratio = 0`` only the new rows are computed over the placed segments: naive concatenation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from lmc.reference.attention import AttentionMetadata, PrefillSlice


@dataclass
class BlendStats:
    """Counters since the blender was made (tokens are prompt positions)."""

    requests: int = 0  # blended prefills
    segments_hit: int = 0
    segments_computed: int = 0  # computed alone (not stored yet) and stored
    tokens_reused: int = 0  # segment tokens loaded from lmc
    tokens_computed_alone: int = 0
    tokens_recomputed: int = 0  # cached segment tokens selected for recompute
    tokens_stored: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class RequestRows:
    """One blended request's rows in the step's flat batch.

    ``cached``: rows (relative to ``row_start``) whose K/V come from cached segments, and
    their placed ``keys``/``values`` ``[layers, m, kv_heads, head_dim]`` and ``slots``."""

    row_start: int
    num_rows: int
    cached: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    ratio: float


def kv_deviation(k_fresh: torch.Tensor, v_fresh: torch.Tensor, k_cached: torch.Tensor,
                 v_cached: torch.Tensor) -> torch.Tensor:
    """Per-token deviation ``[T]``: mean squared difference of K plus that of V (fp32)."""
    dk = (k_fresh.float() - k_cached.float()).pow(2).mean(dim=(1, 2))
    dv = (v_fresh.float() - v_cached.float()).pow(2).mean(dim=(1, 2))
    return dk + dv


def num_to_recompute(ratio: float, num_cached: int) -> int:
    """How many of ``num_cached`` rows a ratio recomputes (rounded up: a ratio above 0 always
    recomputes at least one row)."""
    return min(num_cached, math.ceil(ratio * num_cached - 1e-9))


class BatchBlend:
    """The model's ``BlendStep`` for one step (see the module docstring)."""

    def __init__(self, meta: AttentionMetadata, num_rows: int, requests: list[RequestRows],
                 check_layer: int = 1, stats: BlendStats | None = None) -> None:
        device = meta.slot_mapping.device
        self.check_layer = check_layer
        self.stats = stats
        self.requests = requests
        self.num_rows = num_rows
        self._meta = meta
        rows = [r.row_start + r.cached.to(device) for r in requests]
        self.cached_rows = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long,
                                                                    device=device)
        self.keys = torch.cat([r.keys for r in requests], dim=1)
        self.values = torch.cat([r.values for r in requests], dim=1)
        self.slots = torch.cat([r.slots.to(device) for r in requests])
        is_cached = torch.zeros(num_rows, dtype=torch.bool, device=device)
        is_cached[self.cached_rows] = True
        self.meta_before = replace(meta, write_rows=torch.nonzero(~is_cached).flatten())
        self._stay: torch.Tensor | None = None  # after select: cached rows not recomputed
        self.kept = torch.arange(num_rows, device=device)
        self.recomputed = [0] * len(requests)
        self.deviations: list[torch.Tensor] = []

    def cached_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if self._stay is None:
            return self.keys[layer_idx], self.values[layer_idx], self.slots
        if not bool(self._stay.any()):
            return None
        s = self._stay
        return self.keys[layer_idx][s], self.values[layer_idx][s], self.slots[s]

    def select(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, AttentionMetadata]:
        layer = self.check_layer
        recompute = torch.zeros(len(self.slots), dtype=torch.bool, device=self.slots.device)
        offset = 0
        for i, r in enumerate(self.requests):
            m = len(r.cached)
            rows = r.row_start + r.cached.to(k.device)
            part = slice(offset, offset + m)
            dev = kv_deviation(k[rows], v[rows], self.keys[layer][part], self.values[layer][part])
            self.deviations.append(dev)
            n = num_to_recompute(r.ratio, m)
            if n:
                recompute[offset + torch.topk(dev, n).indices] = True
            self.recomputed[i] = n
            if self.stats is not None:
                self.stats.tokens_recomputed += n
            offset += m
        self._stay = ~recompute
        drop = torch.zeros(self.num_rows, dtype=torch.bool, device=k.device)
        drop[self.cached_rows[self._stay]] = True
        keep = torch.nonzero(~drop).flatten()
        self.kept = keep
        return keep, self._subset_meta(keep)

    def output_rows(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(self.kept.device)
        at = torch.searchsorted(self.kept, rows)
        if bool((at >= len(self.kept)).any()) or not torch.equal(self.kept[at.clamp(
                max=len(self.kept) - 1)], rows):
            raise ValueError("a sampled row was not computed to the end of the blended step")
        return at

    def _subset_meta(self, keep: torch.Tensor) -> AttentionMetadata:
        """The batch's attention metadata for the kept rows only: each sequence's queries
        are its kept rows, masked causally by their own positions."""
        meta = self._meta
        device = keep.device
        prefills: list[PrefillSlice] = []
        for p in meta.prefills:
            inside = keep[(keep >= p.query_start) & (keep < p.query_start + p.query_len)]
            new_start = int(torch.searchsorted(keep, torch.tensor(p.query_start, device=device)))
            if len(inside) == p.query_len:
                prefills.append(replace(p, query_start=new_start))
                continue
            context_len = len(p.context_slots)
            query_pos = context_len - p.query_len + (inside - p.query_start)
            mask = torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]
            prefills.append(PrefillSlice(new_start, len(inside), p.context_slots, mask))
        decode_rows = meta.decode_rows
        if decode_rows is not None:
            decode_rows = torch.searchsorted(keep, decode_rows)
        return replace(meta, slot_mapping=meta.slot_mapping[keep], prefills=prefills,
                       decode_rows=decode_rows, num_tokens=len(keep), write_rows=None)
