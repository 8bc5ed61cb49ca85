"""Copies for a hybrid model's KV groups: one transfer per group, over that group's layers.

Each KV group (:mod:`lmc.transfer.kv_groups`) has its own block table in the engine, so its
own slot mapping, and stores its own chunk parts: :class:`GroupedTransfer` binds one
transfer per group to the group's layers (an attention group's is the ordinary transfer
over a plain spec of its layers; a state group's is :class:`StateTransfer`). Layers of
different groups may alias one allocation (vLLM's hybrid allocator overlays its groups,
a block id belonging to one group at a time): each transfer sees only its own group's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lmc.transfer.completion import Completion, current_stream, record
from lmc.transfer.factory import TransferFactory, make_transfer
from lmc.transfer.kv_groups import STATE, KVGroup
from lmc.transfer.kv_spec import KVCaches, KVSpec
from lmc.transfer.plan import KVTransfer, TransferPlan

__all__ = ["GroupedTransfer", "StateTransfer", "layer_entries"]


def layer_entries(kv_caches: KVCaches) -> list[Any]:
    """The engine's per-layer entries, in order (a list, or a name -> entry mapping)."""
    if isinstance(kv_caches, Mapping):
        return list(kv_caches.values())
    if isinstance(kv_caches, (list, tuple)):
        return list(kv_caches)
    raise TypeError("a hybrid model's kv_caches must be a list of per-layer entries or a "
                    f"name -> entry mapping, got {type(kv_caches).__name__}")


class _StatePlan(TransferPlan):
    """Per chunk, the engine's state row holding the state after the chunk's last token."""

    def __init__(self, ranges: Sequence[tuple[int, int]], rows: np.ndarray) -> None:
        self.ranges = ranges
        self.rows = rows
        self.unmapped = bool((rows < 0).any()) if rows.size else False


class StateTransfer:
    """Moves a state group's recurrent state between the engine and chunk parts.

    Each layer's entry is a tensor ``[rows, ...]`` or a tuple of them (a layer with several
    state tensors, e.g. a convolution and an SSM state), one row per state slot; a part
    holds ``[layers, 1, 1, state_width]``, each layer's row flattened in entry order. A
    "slot mapping" gives, per position, the row holding the state after that position
    (``-1``: no such state now); a chunk's state is the row of its last position.
    """

    def __init__(self, group: KVGroup, dtype: torch.dtype, entries: Sequence[Any]) -> None:
        self.group = group
        self.dtype = dtype
        self.layers: list[tuple[torch.Tensor, ...]] = []
        for i, entry in zip(group.layers, entries):
            parts = (entry,) if isinstance(entry, torch.Tensor) else tuple(entry)
            if not parts or not all(isinstance(t, torch.Tensor) for t in parts):
                raise TypeError(f"state layer {i}: expected a tensor or a tuple of tensors")
            width = sum(int(np.prod(t.shape[1:])) for t in parts)
            rows = {int(t.shape[0]) for t in parts}
            if width != group.state_width or len(rows) != 1:
                raise ValueError(f"state layer {i} holds {width} elements per row over "
                                 f"{sorted(rows)} rows; its group says {group.state_width} "
                                 "per row, one row count")
            if any(t.dtype != dtype for t in parts):
                raise TypeError(f"state layer {i} has dtypes {[str(t.dtype) for t in parts]}, "
                                f"its group stores {dtype}")
            self.layers.append(parts)
        self.device = self.layers[0][0].device
        self.num_rows = int(self.layers[0][0].shape[0])

    def check_slots(self, slots: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
            raise TypeError("a state group's slot mapping must be a 1-D tensor")
        if slots.numel() != num_tokens:
            raise ValueError(f"state slot mapping has {slots.numel()} entries for "
                             f"{num_tokens} tokens")
        out = slots.to(device="cpu", dtype=torch.int64)
        if out.numel() and int(out.max()) >= self.num_rows:
            raise ValueError(f"state slot {int(out.max())} past the {self.num_rows} rows")
        return out

    def has_negative(self, slots: torch.Tensor) -> bool:
        return bool(slots.numel()) and int(slots.min()) < 0

    def plan(self, slots: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> _StatePlan:
        s = slots.numpy()
        return _StatePlan(ranges, np.array([s[e - 1] for _, e in ranges], dtype=np.int64))

    def record_event(self, stream: Any = None) -> Completion:
        return record(self.device, stream)

    def _rows(self, plan: TransferPlan, layers: Iterable[int] | None) -> Iterable[
            tuple[int, int, int]]:
        rows = plan.rows  # type: ignore[attr-defined]
        todo = range(len(self.layers)) if layers is None else layers
        for i, row in enumerate(rows):
            if row >= 0:
                for j in todo:
                    yield i, j, int(row)

    def gather(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
               layers: Iterable[int] | None = None, *, after: Completion | None = None,
               stream: Any = None, arrays: Any = None) -> Completion:
        if after is not None:
            after.wait(stream)
        for i, j, row in self._rows(plan, layers):
            off = 0
            for t in self.layers[j]:
                w = int(np.prod(t.shape[1:]))
                bufs[i][j, 0, 0, off:off + w].copy_(t[row].reshape(-1).to(bufs[i].device))
                off += w
        return record(self.device, stream)

    def scatter(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
                layers: Iterable[int] | None = None, arrays: Any = None, *,
                after: Completion | None = None, stream: Any = None) -> Completion:
        if after is not None:
            after.wait(stream)
        for i, j, row in self._rows(plan, layers):
            off = 0
            for t in self.layers[j]:
                w = int(np.prod(t.shape[1:]))
                t[row].copy_(bufs[i][j, 0, 0, off:off + w].reshape(t.shape[1:]))
                off += w
        return record(self.device, stream)


class GroupedTransfer:
    """One transfer per KV group of ``spec`` (``parts[g]``), bound to the group's layers of
    ``kv_caches`` (every engine layer, in order)."""

    def __init__(self, spec: KVSpec, kv_caches: KVCaches,
                 prefer: str | TransferFactory = "auto") -> None:
        entries = layer_entries(kv_caches)
        if len(entries) != spec.num_layers:
            raise ValueError(f"kv_caches has {len(entries)} layers, the spec's KV groups "
                             f"cover {spec.num_layers}")
        self.spec = spec
        self.parts: list[Any] = []
        for gi, g in enumerate(spec.groups):
            sub = [entries[i] for i in g.layers]
            if g.kind == STATE:
                self.parts.append(StateTransfer(g, spec.group_dtype(gi), sub))
            else:
                self.parts.append(make_transfer(spec.group_spec(gi), sub, prefer))
        self.attention = next(p for p in self.parts if isinstance(p, KVTransfer))
        self.device = self.attention.device

    def record_event(self, stream: Any = None) -> Completion:
        return self.attention.record_event(stream)

    def check_slots(self, slot_mapping: Any, num_tokens: int) -> list[torch.Tensor]:
        """Per group, its checked slot mapping: ``slot_mapping`` is one per group (a
        sequence) or one tensor every group shares (an engine with one block table)."""
        if isinstance(slot_mapping, torch.Tensor):
            maps: Sequence[Any] = [slot_mapping] * len(self.parts)
        else:
            maps = list(slot_mapping)
            if len(maps) != len(self.parts):
                raise ValueError(f"{len(maps)} slot mappings for {len(self.parts)} KV groups")
        return [p.check_slots(m, num_tokens) for p, m in zip(self.parts, maps)]

    def synchronize(self) -> None:
        for p in self.parts:
            if isinstance(p, KVTransfer):
                p.synchronize()

    def stream(self) -> Any:
        return current_stream(self.device)
