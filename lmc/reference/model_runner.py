"""Runs one scheduled step through the model: builds the flat token batch and the
attention metadata, owns the KV cache tensors, and drives the worker-side connector
hooks around the forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from lmc.reference.attention import AttentionMetadata, SequenceChunk, build_attention_metadata
from lmc.reference.connector_api import KVConnector
from lmc.reference.kv_cache import allocate_kv_caches, layer_name
from lmc.reference.model import BlendStep, CausalLM
from lmc.reference.scheduler_output import SchedulerOutput

Spans = Sequence[tuple[int, int]]


class Blender(Protocol):
    """Plans a step's blended requests (``lmc.blend.blender.SegmentBlender``): before the
    forward it loads or computes their cached segments into their blocks and returns the
    ``BlendStep`` the model runs with, or None when no request in the step is blended."""

    def prepare(self, output: SchedulerOutput, meta: AttentionMetadata, row_starts: list[int],
                segments: Mapping[str, Spans], runner: ModelRunner) -> BlendStep | None: ...


class _ConnectorHooks:
    """Adapts the model's per-layer hook points to the connector's worker API."""

    def __init__(self, connector: KVConnector, meta: Any) -> None:
        self.connector = connector
        self.meta = meta

    def before_attention(self, layer_idx: int) -> None:
        self.connector.wait_for_layer_load(layer_idx)

    def after_kv_write(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        self.connector.save_kv_layer(layer_idx, kv_cache, self.meta)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, dtype, device)
        self.blender: Blender | None = None  # set by the engine when blending is on

    def named_kv_caches(self) -> dict[str, torch.Tensor]:
        """Layer name -> cache tensor, in layer order (what ``register_kv_caches`` gets)."""
        return {layer_name(i): t for i, t in enumerate(self.kv_caches)}

    @torch.no_grad()
    def execute(
        self,
        output: SchedulerOutput,
        connector: KVConnector | None = None,
        connector_meta: Any = None,
        segments: Mapping[str, Spans] | None = None,
    ) -> tuple[list[str], torch.Tensor]:
        """Run the step's forward. Returns the ids of the requests that reached the end
        of their known tokens, and their last position's logits ``[n, vocab]`` (fp32).
        ``segments``: the reusable segments of the step's requests that have them (blended
        when a blender is set)."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        chunks: list[SequenceChunk] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        row_starts: list[int] = []
        for sched in output.scheduled_requests:
            start, end = sched.num_computed_tokens, sched.end_position
            row_starts.append(len(input_ids))
            input_ids.extend(sched.token_ids[start:end])
            positions.append(torch.arange(start, end))
            chunks.append(SequenceChunk(start, sched.num_scheduled_tokens, sched.block_ids))
            if sched.samples_token:
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(sched.request_id)

        attn_meta = build_attention_metadata(chunks, self.block_size, self.device,
                                             self.model.config.sliding_windows)
        ids_t = torch.tensor(input_ids, dtype=torch.long).to(self.device)
        pos_t = torch.cat(positions).to(self.device)
        blend = None
        if self.blender is not None and segments:
            blend = self.blender.prepare(output, attn_meta, row_starts, segments, self)
        hooks = None
        if connector is not None:
            hooks = _ConnectorHooks(connector, connector_meta)
            connector.start_load_kv(connector_meta)
        hidden = self.model(ids_t, pos_t, self.kv_caches, attn_meta, hooks, blend)
        if connector is not None:
            connector.wait_for_save()
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        if blend is not None:
            rows = blend.output_rows(rows)
        return sample_ids, self.model.compute_logits(hidden.index_select(0, rows))
