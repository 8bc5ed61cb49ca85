"""The engine-facing half of blending: before a step's forward, put every blended request's
cached segments in its blocks and hand the model a :class:`~lmc.blend.step.BatchBlend`.

For each scheduled request with segments whose prefill ends in this step, each segment that
lies wholly past the request's prefix hit (and before its last token, which is always
computed) is loaded from lmc into the request's own slots; a segment not fully stored is
computed alone, at canonical positions ``0..len-1``, in one extra forward for all of the
step's missing segments, and stored (so a segment is computed alone once, then reused). Then
every segment's K/V are read out of the cache, K rotated to the segment's place, and the
forward writes them back layer by layer after the connector's load for that layer (a
connector may write whole blocks, the first segment's block included).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lmc.blend.rope_shift import KeyShifter
from lmc.blend.step import BatchBlend, BlendStats, RequestRows
from lmc.blend.store import SegmentStore
from lmc.reference.attention import AttentionMetadata, PrefillSlice, slots_for_positions
from lmc.reference.model_config import ModelConfig
from lmc.reference.scheduler import one_line
from lmc.reference.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)
DEFAULT_RATIO = 0.15


def check_ratio(ratio: float) -> float:
    if not 0.0 <= ratio <= 1.0:  # NaN fails too
        raise ValueError(f"recompute ratio must be in [0, 1], got {ratio!r}")
    return float(ratio)


class SegmentBlender:
    """Implements the reference engine's ``Blender`` (see ``lmc.reference.model_runner``).

    Args:
        store: where segments live.
        config: the model's config (its RoPE places segments; others are refused).
        ratio: fraction of each request's cached segment tokens recomputed.
        check_layer: the layer whose K/V deviation picks them (1: the first whose K/V
            depend on context).
    """

    def __init__(self, store: SegmentStore, config: ModelConfig, ratio: float = DEFAULT_RATIO,
                 check_layer: int = 1) -> None:
        if not 0 < check_layer < max(2, config.num_hidden_layers):
            raise ValueError(f"check_layer must be in [1, {config.num_hidden_layers}), "
                             f"got {check_layer}")
        self.store = store
        self.shifter = KeyShifter(config)
        self.ratio = check_ratio(ratio)
        self.check_layer = check_layer
        self.stats = BlendStats()
        self.last_step: BatchBlend | None = None

    def prepare(self, output: SchedulerOutput, meta: AttentionMetadata, row_starts: list[int],
                segments: Mapping[str, Sequence[tuple[int, int]]], runner: Any
                ) -> BatchBlend | None:
        plans: list[tuple[ScheduledRequest, int, list[tuple[int, int, torch.Tensor]]]] = []
        missing: list[tuple[Sequence[int], torch.Tensor, bytes | None]] = []
        for sched, row_start in zip(output.scheduled_requests, row_starts, strict=True):
            spans = segments.get(sched.request_id)
            if not spans:
                continue
            start, end = sched.num_computed_tokens, sched.end_position
            if end != len(sched.token_ids) or sched.num_scheduled_tokens < 2:
                continue  # not a whole prefill in one step: computed as usual
            usable = [(s, min(e, end - 1)) for s, e in spans if s >= start and min(e, end - 1) > s]
            if not usable:
                continue
            table = torch.as_tensor(sched.block_ids, dtype=torch.long)
            tag = getattr(sched, "key_tag", None)  # LoRA / cache_salt: its own segments
            segs = []
            for s, e in usable:
                tokens = sched.token_ids[s:e]
                slots = slots_for_positions(table, torch.arange(s, e), runner.block_size)
                if self._load(tokens, runner.kv_caches, slots, tag):
                    self.stats.segments_hit += 1
                    self.stats.tokens_reused += e - s
                else:
                    missing.append((tokens, slots, tag))
                segs.append((s, e, slots))
            plans.append((sched, row_start, segs))
        if not plans:
            return None
        if missing:
            self._compute_alone(missing, runner)
        requests = [self._rows(sched, row_start, segs, runner) for sched, row_start, segs in plans]
        step = BatchBlend(meta, meta.num_tokens, requests, self.check_layer, self.stats)
        self.stats.requests += len(requests)
        self.last_step = step
        return step

    def _rows(self, sched: ScheduledRequest, row_start: int,
              segs: list[tuple[int, int, torch.Tensor]], runner: Any) -> RequestRows:
        device = runner.device
        positions = torch.cat([torch.arange(s, e) for s, e, _ in segs])
        delta = torch.cat([torch.full((e - s,), s, dtype=torch.long) for s, e, _ in segs])
        slots = torch.cat([sl for _, _, sl in segs]).to(device)
        keys, values = [], []
        for kv in runner.kv_caches:
            _, _, _, heads, dim = kv.shape
            keys.append(kv[0].view(-1, heads, dim).index_select(0, slots))
            values.append(kv[1].view(-1, heads, dim).index_select(0, slots))
        k = self.shifter.shift(torch.stack(keys), delta)
        return RequestRows(row_start, sched.num_scheduled_tokens,
                           positions - sched.num_computed_tokens, k, torch.stack(values), slots,
                           self.ratio)

    def _compute_alone(self, missing: list[tuple[Sequence[int], torch.Tensor, bytes | None]],
                       runner: Any) -> None:
        """One forward computing each missing segment alone at positions ``0..len-1`` into
        its slots, then each is stored."""
        device = runner.device
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        prefills: list[PrefillSlice] = []
        row = 0
        for tokens, slots, _ in missing:
            n = len(tokens)
            ids.extend(tokens)
            positions.append(torch.arange(n))
            slot_parts.append(slots)
            prefills.append(PrefillSlice(row, n, slots.to(device), None))
            row += n
        meta = AttentionMetadata(torch.cat(slot_parts).to(device), prefills, None, None, None,
                                 row)
        runner.model(torch.tensor(ids, dtype=torch.long, device=device),
                     torch.cat(positions).to(device), runner.kv_caches, meta)
        for tokens, slots, tag in missing:
            self.stats.segments_computed += 1
            self.stats.tokens_computed_alone += len(tokens)
            try:
                self.stats.tokens_stored += self.store.save(tokens, runner.kv_caches, slots, tag)
            except Exception as e:  # not stored: it is computed alone again next time
                logger.warning("blend: storing a %d-token segment failed: %s", len(tokens),
                               one_line(e))

    def _load(self, tokens: Sequence[int], kv_caches: list[torch.Tensor], slots: torch.Tensor,
              key_tag: bytes | None = None) -> bool:
        """Load a segment; a failing store is a miss (the segment is computed alone)."""
        try:
            return self.store.load(tokens, kv_caches, slots, key_tag)
        except Exception as e:
            logger.warning("blend: loading a %d-token segment failed, computing it: %s",
                           len(tokens), one_line(e))
            return False
