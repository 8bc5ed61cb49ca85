"""The portable copy path: gather (engine paged KV -> chunk buffers) and scatter (chunk
buffers -> engine paged KV) with torch indexing and numpy, for CPU caches and GPU ones
without CuPy (the interface and plan types: :mod:`lmc.transfer.plan`; the CUDA kernels:
:mod:`lmc.transfer.cuda_copy`; choosing one: :mod:`lmc.transfer.factory`).

On CPU, gather is ``np.take`` and scatter numpy fancy assignment, on integer views of the
same width (bit-exact for every float dtype; scatter ~3x faster than ``index_copy_``, gather
as fast as ``index_select``; both release the GIL so a background thread overlaps them with
compute), straight between the cache and the chunk's numpy view: no tensor is made per chunk
or layer (each costs ~1 us, the numpy view ~0.1 us). Elsewhere ``torch.index_select`` /
``index_copy_``. When a chunk's slots cover whole, aligned blocks (the normal case:
``block_size`` divides ``chunk_size``) rows are moved a block at a time (``block_size * heads
* dim`` elements per index), else a token at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from lmc.transfer.completion import DONE, Completion, record
from lmc.transfer.kv_layouts import PlaneStrides, span_elements
from lmc.transfer.kv_spec import KVCaches, KVSpec
from lmc.transfer.plan import (
    INT_VIEW,
    ChunkPlan,
    ChunkRanges,
    KVTransfer,
    PlanRun,
    TransferPlan,
    equal_runs,
    int_view,
)

_NO_HEADS = np.empty(0, dtype=np.int64)


class TorchPlan(TransferPlan):
    """:class:`TorchTransfer`'s plan: ``parts`` in chunk order, each a :class:`PlanRun` or
    ``(i, ChunkPlan)`` for a chunk planned alone. ``chunks`` (a ChunkPlan per chunk, the
    generic view other code reads) is made from them on first use only. ``unmapped``:
    whether the slot mapping holds a slot < 0 anywhere (what ``has_negative`` would say,
    known from planning without another pass over the slots)."""

    def __init__(self, ranges: Sequence[tuple[int, int]],
                 parts: list[PlanRun | tuple[int, ChunkPlan]], unmapped: bool) -> None:
        self.ranges = ranges
        self.parts = parts
        self.unmapped = unmapped
        self._chunks: list[ChunkPlan] | None = None

    @property
    def chunks(self) -> list[ChunkPlan]:  # the base's field, made lazily here
        out = self._chunks
        if out is None:
            out = []
            rng = self.ranges
            for part in self.parts:
                if isinstance(part, PlanRun):
                    f, idx = part.first, part.index_np
                    out += [ChunkPlan(*rng[f + k], part.mode, None, idx[k], None)
                            for k in range(part.count)]
                else:
                    out.append(part[1])
            self._chunks = out
        return out

    @chunks.setter
    def chunks(self, value: list[ChunkPlan]) -> None:  # writable, as the base's field
        self._chunks = value


class TorchTransfer(KVTransfer):
    """Portable path: torch indexing (and numpy for CPU scatter); bit-exact for every dtype."""

    def __init__(self, spec: KVSpec, kv_caches: KVCaches) -> None:
        super().__init__(spec, kv_caches)
        s = spec
        self.W = s.row_width
        self.strides = s.plane_strides(self.layers[0])  # the tensors' real strides
        self.num_slots = s.num_slots(self.layers[0][0])
        self.cpu = self.device.type == "cpu"
        # Row tables work where each token's plane is one dense run of W elements at a
        # multiple of W from the tensor's start. Elsewhere (vLLM CPU's transposed K, vLLM
        # GPU's K/V interleaved per head) each plane is a strided [blocks, bs, heads, dim] view.
        self.strided = not all(_dense_rows(p, self.W, s.head_size, s.num_kv_heads)
                               for p in self.strides)
        # Per layer: row tables. Single-tensor layouts use one table for both planes.
        self.tok_tables: list[list[torch.Tensor]] = []
        self.blk_tables: list[list[torch.Tensor]] | None = None
        self.block_ok = (not self.strided and s.block_size > 1
                         and all(p.token == self.W and p.base % (s.block_size * self.W) == 0
                                 and p.block % (s.block_size * self.W) == 0 for p in self.strides))
        # Everything below works on same-width integer views: moving bits needs no float
        # kernels (CPU torch has no fp8 index_copy_), and no value is ever converted.
        self.int_dtype = INT_VIEW[spec.dtype.itemsize][0]
        self.layers = [tuple(t.view(self.int_dtype) for t in ts) for ts in self.layers]
        for tensors in self.layers:
            self.tok_tables.append([_flat_rows(t, self.W) for t in tensors]
                                   if not self.strided else list(tensors))
        if self.block_ok:
            bw = s.block_size * self.W
            self.blk_tables = [[_flat_rows(t, bw) for t in tensors] for tensors in self.layers]
            # a block's row of plane p = block id * _blk_mul[p] + _blk_add[p] (whole rows)
            self._blk_mul = np.array([p.block // bw for p in self.strides], dtype=np.int64)
            self._blk_add = np.array([p.base // bw for p in self.strides], dtype=np.int64)
            self._blk_mul_one = bool((self._blk_mul == 1).all())
        self.plane_views = [self._plane_views(ts) for ts in self.layers] if self.strided else []
        self._ends = np.zeros(0, dtype=bool)  # block-end marks (``_block_ends``), grown on use
        self.tok_np = ([[int_view(t) for t in tabs] for tabs in self.tok_tables]
                       if self.cpu and not self.strided else None)
        self.blk_np = ([[int_view(t) for t in tabs] for tabs in self.blk_tables]
                       if self.cpu and self.blk_tables is not None else None)

    def _plane_views(self, tensors: tuple[torch.Tensor, ...]
                     ) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        """Per plane: a ``[blocks, block_size, heads, dim]`` view of the layer's memory, and
        the order of axes 1-3 by decreasing stride (block copies run in memory order)."""
        s = self.spec
        nb = self.num_slots // s.block_size
        out = []
        for p, ps in enumerate(self.strides):
            t = tensors[p if len(tensors) > 1 else 0]
            view = torch.as_strided(t, (nb, s.block_size, s.num_kv_heads, s.head_size),
                                    (ps.block, ps.token, ps.head, ps.dim),
                                    t.storage_offset() + ps.base)
            st = view.stride()
            a, b, c = sorted((1, 2, 3), key=lambda ax: -st[ax])
            out.append((view, (a, b, c)))
        return out

    # ------------------------------------------------------------------ plan
    # Planning works on a host copy of the slots in numpy: small-array numpy ops cost ~1 us
    # where torch ops cost 5-10 us, and a call plans once for every layer.
    def _rows(self, first_slots: np.ndarray, unit: int) -> np.ndarray:
        """Row indices ``[planes, n]`` in rows of ``unit`` elements.

        ``unit == W``: one row per token slot. ``unit == block_size * W``: ``first_slots`` are
        the first slot of each block, one row per block.
        """
        bs = self.spec.block_size
        blk = first_slots // bs
        off = first_slots - blk * bs if unit == self.W else None
        out = np.empty((len(self.strides), first_slots.shape[0]), dtype=np.int64)
        for row, p in zip(out, self.strides):
            if p.block % unit or p.base % unit or off is not None and p.token % unit:
                elem = blk * p.block + p.base
                if off is not None and p.token:
                    elem = elem + off * p.token
                row[:] = elem // unit
                continue
            # strides in whole rows (always, where row tables apply): no division per row
            np.multiply(blk, p.block // unit, out=row)
            if p.base:
                row += p.base // unit
            if off is not None and p.token:
                row += off * (p.token // unit)
        return out

    def _to_index(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        return t if self.cpu else t.to(self.device, non_blocking=False)

    def plan(self, slots: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> TorchPlan:
        """Rows for the whole call are computed once, vectorised; runs of consecutive
        equal-size chunks (a prompt's full chunks) get their indices from one reshape (on
        CPU one :class:`PlanRun` each: no object per chunk)."""
        bs, n_all = self.spec.block_size, slots.numel()
        ranges = ranges if isinstance(ranges, (list, ChunkRanges)) else list(ranges)
        if n_all == 0 or not ranges:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            unmapped = bool(n_all) and self.has_negative(slots)
            return TorchPlan(ranges, [(i, ChunkPlan(a, b, "token", empty, None, None))
                                      for i, (a, b) in enumerate(ranges)], unmapped)
        s = slots.cpu().numpy()
        by_block = (self.block_ok or self.strided and bs > 1) and n_all >= bs
        blocks = self._blocks(s) if by_block else None
        if blocks is not None and blocks[2] is True:  # every block whole: bounds from heads
            heads, tail = blocks[1], s[len(blocks[1]) * bs:]
            lo, hi = int(heads.min()), int(heads.max()) + bs - 1
            if tail.size:
                lo, hi = min(lo, int(tail.min())), max(hi, int(tail.max()))
        else:
            lo, hi = int(s.min()), int(s.max())
        if hi >= self.num_slots:
            raise ValueError(f"slot_mapping holds slot {hi}, but the KV cache has only "
                             f"{self.num_slots} slots")
        neg = s < 0 if lo < 0 else None
        if neg is not None:
            s = np.maximum(s, 0)
            blocks = self._blocks(s) if by_block else None
        tok: list[np.ndarray] = []  # per-token rows, computed only if a chunk needs them

        def tok_rows() -> np.ndarray | None:
            if not tok and not self.strided:
                tok.append(self._rows(s, self.W))
            return tok[0] if tok else None

        blk_ok: np.ndarray | Literal[True] | None = None
        heads = _NO_HEADS  # read only where blk_ok says the blocks are aligned
        if blocks is not None:
            _, heads, blk_ok = blocks
        parts: list[PlanRun | tuple[int, ChunkPlan]] = []
        for i, j in equal_runs(ranges):
            s0, e0 = ranges[i]
            n = e0 - s0
            end = ranges[j - 1][1]
            aligned = (blk_ok is not None and s0 % bs == 0 and n % bs == 0
                       and (blk_ok is True or bool(blk_ok[s0 // bs: end // bs].all())))
            if neg is not None and neg[s0:end].any() or self.strided and not aligned:
                parts += [(k, self._plan_one(slots, neg, tok_rows(), ranges[k]))
                          for k in range(i, j)]
            elif self.strided:  # whole blocks of a strided layout: block ids
                for k in range(i, j):
                    a, b = ranges[k]
                    ids = np.ascontiguousarray(heads[a // bs: b // bs] // bs)
                    parts.append((k, ChunkPlan(a, b, "block", None if self.cpu else
                                               self._to_index(ids), ids if self.cpu else None,
                                               None)))
            elif aligned and self.cpu:
                parts.append(PlanRun(i, j - i, "block",
                                     self._block_rows(heads, s0 // bs, n // bs, j - i)))
            elif aligned:
                parts += self._plan_run(self._rows(heads, bs * self.W), s0 // bs, n // bs,
                                        ranges, i, j, "block")
            else:
                rows = tok_rows()
                assert rows is not None  # a dense layout: per-token rows exist
                parts += self._plan_run(rows, s0, n, ranges, i, j, "token")
        return TorchPlan(ranges, parts, neg is not None)

    def _blocks(self, s: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | Literal[True]]:
        """The slots cut in blocks: ``(v, heads, ok)``, ``v`` the whole blocks' slots as
        ``[blocks, block_size]``, ``heads`` their first slots, ``ok`` per block whether it
        is one aligned engine block in order (``True``: every one is, the usual case, found
        with one flat comparison: a per-row reduction costs several times as much)."""
        bs = self.spec.block_size
        nb = s.shape[0] // bs
        v = s[: nb * bs].reshape(nb, bs)
        heads = v[:, 0].copy()  # contiguous: bounds and rows are read from it
        if not (heads & (bs - 1) if bs & (bs - 1) == 0 else heads % bs).any():
            # in order within every block: each slot one past the one before, except where
            # a block starts (contiguous passes: a per-row comparison costs twice as much)
            m = nb * bs - 1
            step = np.equal(np.subtract(s[1: m + 1], s[:m]), 1)
            step |= self._block_ends(m)
            if step.all():
                return v, heads, True
        in_order = v - np.arange(bs)
        return v, heads, ((heads % bs) == 0) & (in_order == heads[:, None]).all(1)

    def _block_ends(self, m: int) -> np.ndarray:
        """``[m]`` booleans, True at each ``i`` where slot ``i + 1`` starts a block."""
        ends = self._ends
        if ends.shape[0] < m:
            bs = self.spec.block_size
            ends = np.zeros(max(m, 2 * ends.shape[0]) // bs * bs + bs, dtype=bool)
            ends[bs - 1:: bs] = True
            self._ends = ends
        return ends[:m]

    def _block_rows(self, heads: np.ndarray, first: int, per: int, count: int
                    ) -> np.ndarray:
        """Block rows of ``count`` chunks of ``per`` whole blocks from block ``first`` of
        ``heads`` (their first slots), laid out as :class:`PlanRun` wants them: made in one
        broadcast step, straight in that layout (no per-plane rows, no transposing copy)."""
        bs = self.spec.block_size
        ids = heads[first: first + count * per]
        ids = (ids >> (bs.bit_length() - 1) if bs & (bs - 1) == 0 else ids // bs)
        planes = len(self.strides)
        out = np.empty((count, planes, per), dtype=np.int64)
        add = self._blk_add[None, :, None]
        if self._blk_mul_one:  # a block per row step (every layout so far): one pass
            np.add(ids.reshape(count, 1, per), add, out=out)
        else:
            np.multiply(ids.reshape(count, 1, per), self._blk_mul[None, :, None], out=out)
            out += add
        return out.reshape(count, planes * per) if len(self.tok_tables[0]) == 1 else out

    def _plan_run(self, rows: np.ndarray, first: int, per: int,
                  ranges: Sequence[tuple[int, int]], i: int, j: int, mode: str
                  ) -> list[PlanRun | tuple[int, ChunkPlan]]:
        """Chunks ``i..j-1`` (consecutive, ``per`` rows each), starting at row column
        ``first``: on CPU one :class:`PlanRun` (numpy rows only: a tensor index is made
        only if a torch path asks for one), elsewhere a tensor index per chunk."""
        c = j - i
        planes = rows.shape[0]
        r = rows[:, first: first + c * per].reshape(planes, c, per).transpose(1, 0, 2)
        r = (r.reshape(c, planes * per) if len(self.tok_tables[0]) == 1
             else np.ascontiguousarray(r))
        if self.cpu:
            return [PlanRun(i, c, mode, r)]
        idx = self._to_index(r).unbind(0)
        return [(k, ChunkPlan(*ranges[k], mode, t, None, None))
                for k, t in zip(range(i, j), idx)]

    def _plan_one(self, slots: torch.Tensor, neg: np.ndarray | None, tok_rows: np.ndarray | None,
                  rng: tuple[int, int]) -> ChunkPlan:
        """A chunk with unmapped slots, or of the K-transposed layout: token by token."""
        start, end = rng
        if neg is not None and neg[start:end].any():
            keep = np.flatnonzero(~neg[start:end])
            if not keep.size:  # every slot unmapped: the chunk moves nothing
                return ChunkPlan(start, end, "empty", None, None, None)
            valid = self._to_index(keep)
            if self.strided:
                idx = slots[start:end][valid]
            else:
                assert tok_rows is not None  # dense layouts plan per-token rows
                idx = self._to_index(self._flat(tok_rows[:, start:end][:, keep]))
            return ChunkPlan(start, end, "masked", idx, None, valid)
        if self.strided:
            return ChunkPlan(start, end, "token", slots[start:end], None, None)
        assert tok_rows is not None  # dense layouts plan per-token rows
        arr = self._flat(tok_rows[:, start:end])
        if self.cpu:  # the tensor index only if a torch path asks for it
            return ChunkPlan(start, end, "token", None, arr, None)
        return ChunkPlan(start, end, "token", self._to_index(arr), None, None)

    def _flat(self, rows: np.ndarray) -> np.ndarray:
        """Single-table layouts index both planes in one call: plane-major, flattened."""
        return (rows.reshape(-1) if len(self.tok_tables[0]) == 1
                else np.ascontiguousarray(rows))

    # --------------------------------------------------------------- execute
    @contextlib.contextmanager
    def _ordered(self, after: Completion | None, stream: Any):
        """Run the body on ``stream`` (CUDA: default the current one) after ``after``."""
        if self.device.type != "cuda":
            if after is not None:
                after.wait()
            yield None
            return
        s = torch.cuda.current_stream(self.device) if stream is None else stream
        with torch.cuda.stream(s):
            if after is not None:
                after.wait(s)
            yield s

    def _completion(self, stream: Any) -> Completion:
        """CPU copies here are synchronous; on CUDA an event after the call's work."""
        return DONE if stream is None else record(self.device, stream)

    def gather(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
               layers: Iterable[int] | None = None, *, after: Completion | None = None,
               stream: Any = None, arrays: Sequence[np.ndarray] | None = None) -> Completion:
        with self._ordered(after, stream) as s:
            self._copy(plan, bufs, layers, arrays, self._take, self._index_into,
                       self._gather_layer)
        return self._completion(s)

    def scatter(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
                layers: Iterable[int] | None = None,
                arrays: Sequence[np.ndarray] | None = None, *,
                after: Completion | None = None, stream: Any = None) -> Completion:
        """``arrays``: optional integer numpy views of ``bufs`` (saves a conversion each)."""
        with self._ordered(after, stream) as s:
            self._copy(plan, bufs, layers, arrays, self._put, self._index_copy,
                       self._scatter_layer)
        return self._completion(s)

    def _parts(self, plan: TransferPlan, n_bufs: int) -> list[PlanRun | tuple[int, ChunkPlan]]:
        """The plan's parts in chunk order (a plan made elsewhere: one per chunk), checked
        against the number of buffers."""
        if isinstance(plan, TorchPlan):
            parts, n = plan.parts, len(plan.ranges)
        else:
            parts = list(enumerate(plan.chunks))
            n = len(parts)
        if n_bufs != n:
            raise ValueError(f"{n_bufs} buffers for {n} planned chunks")
        return parts

    def _np_buf(self, cp: ChunkPlan, i: int, bufs: Sequence[torch.Tensor],
                arrays: Sequence[np.ndarray] | None) -> np.ndarray | None:
        """Chunk ``i``'s buffer as a C-contiguous integer array where the numpy path applies
        (CPU cache, block or token rows), else None (the torch path)."""
        if not self.cpu or cp.index_np is None or self.strided:
            return None
        if arrays is not None:
            return arrays[i]
        a = int_view(bufs[i])
        return a if a.flags.c_contiguous else None  # a reshape of it would be a copy

    def _run_bufs(self, run: PlanRun, bufs: Sequence[torch.Tensor],
                  arrays: Sequence[np.ndarray] | None) -> list[tuple[int, np.ndarray | None]]:
        """The buffers of ``run``'s chunks as ``(k, a)`` pieces: ``a`` an integer array
        ``[m, *chunk shape]`` holding chunks ``first + k`` .. ``first + k + m - 1`` (from
        one span of evenly spaced pool objects where ``arrays`` offers ``spans()``, see
        :class:`lmc.memory.pool.PoolArrays`; else one chunk each), or ``None``: that chunk's
        buffer is no C-contiguous array and takes the torch path."""
        first, end = run.first, run.first + run.count
        spans = getattr(arrays, "spans", None)
        out: list[tuple[int, np.ndarray | None]] = []
        if spans is not None:
            for a, b, arr in spans():
                if a < end and b > first:
                    lo, hi = max(a, first), min(b, end)
                    out.append((lo - first, arr[lo - a: hi - a]))
            return out
        for i in range(first, end):
            if arrays is not None:
                out.append((i - first, arrays[i][None]))
                continue
            a = int_view(bufs[i])
            out.append((i - first, a[None] if a.flags.c_contiguous else None))
        return out

    def _copy(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
              layers: Iterable[int] | None, arrays: Sequence[np.ndarray] | None,
              whole: Callable[..., None], rows: Callable[..., None],
              one_layer: Callable[[int, ChunkPlan, torch.Tensor], None]) -> None:
        """The one loop of a gather (``_take``, ``_index_into``, ``_gather_layer``) and a
        scatter (``_put``, ``_index_copy``, ``_scatter_layer``). CPU block and token rows go
        through numpy straight between the cache and the chunks' arrays (no tensor made per
        chunk or layer): ``whole`` moves a run's evenly spaced chunks with one call per layer
        where their buffers are one strided array, a chunk's otherwise; ``rows`` is the torch
        path of a run's chunk whose buffer is not; ``one_layer`` moves one layer of a chunk
        planned alone (strided layouts, unmapped slots, caches off the CPU)."""
        layer_ids = range(self.spec.num_layers) if layers is None else list(layers)
        for part in self._parts(plan, len(bufs)):
            if isinstance(part, PlanRun):
                self._copy_run(part, bufs, arrays, layer_ids, whole, rows)
                continue
            i, cp = part
            if cp.start == cp.end or cp.mode == "empty":
                continue
            arr = self._np_buf(cp, i, bufs, arrays)
            if arr is not None and cp.index_np is not None:  # _np_buf: only where it is set
                whole(cp.index_np[None], cp.mode, arr[None], layer_ids)
                continue
            buf = bufs[i].view(self.int_dtype)
            for layer in layer_ids:
                one_layer(layer, cp, buf[layer])

    def _copy_run(self, run: PlanRun, bufs: Sequence[torch.Tensor],
                  arrays: Sequence[np.ndarray] | None, layer_ids: Sequence[int],
                  whole: Callable[..., None], per_chunk: Callable[..., None]) -> None:
        """One run: the pieces whose pool objects form one strided array move with one call
        per layer (``whole``), the others chunk by chunk (``per_chunk``)."""
        idx = run.index_np
        if idx.shape[-1] == 0:  # chunks of no tokens
            return
        for k, big in self._run_bufs(run, bufs, arrays):
            if big is not None:
                whole(idx[k: k + big.shape[0]], run.mode, big, layer_ids)
                continue
            tabs = self._tables(run.mode)
            buf, ix = bufs[run.first + k].view(self.int_dtype), torch.from_numpy(idx[k])
            for layer in layer_ids:
                per_chunk(tabs[layer], ix, buf[layer])

    def _gather_layer(self, layer: int, cp: ChunkPlan, dst: torch.Tensor) -> None:
        """Layer ``layer`` of a chunk planned alone into ``dst`` (``[planes, tokens, W]``)."""
        if self.strided:
            self._strided_gather(layer, cp, dst)
        elif cp.mode == "masked":
            src = self._index(self.tok_tables[layer], cp.rows()).to(dst.device,
                                                                    non_blocking=False)
            dst[:, self._valid(cp).to(dst.device)] = src.view(dst.shape[0], -1, self.W)
        else:
            self._index_into(self._tables(cp.mode)[layer], cp.rows(), dst)

    def _scatter_layer(self, layer: int, cp: ChunkPlan, src: torch.Tensor) -> None:
        """``src`` (``[planes, tokens, W]``) into layer ``layer`` of a chunk planned alone."""
        if self.strided:
            self._strided_scatter(layer, cp, src)
        elif cp.mode == "masked":
            self._index_copy(self.tok_tables[layer], cp.rows(),
                             src[:, self._valid(cp).to(src.device)])
        else:
            self._index_copy(self._tables(cp.mode)[layer], cp.rows(), src)

    def _take(self, idx: np.ndarray, mode: str, big: np.ndarray,
              layer_ids: Sequence[int]) -> None:
        """Rows ``idx`` (``[m, rows]``; ``[m, planes, rows]`` for two-table layouts) into
        ``big`` (``[m, *chunk shape]``, each chunk C-contiguous): one ``take`` per layer
        (and plane) where the destination is one contiguous array, else one per chunk."""
        m, rows = big.shape[0], idx.shape[-1]
        np_tabs = self._np_tables(mode)
        two = idx.ndim == 3
        for layer in layer_ids:
            for p, t in enumerate(np_tabs[layer]):
                # a view (each chunk's layer is contiguous): its rows of this layer/plane
                dst = (big[:, layer, p] if two else big[:, layer]).reshape(m, rows, -1)
                ix = idx[:, p] if two else idx
                if m == 1 or dst.flags.c_contiguous:
                    t.take(ix, 0, dst, "clip")
                else:  # a strided destination would be buffered: chunk by chunk
                    for q in range(m):
                        t.take(ix[q], 0, dst[q], "clip")

    def _tables(self, mode: str) -> list[list[torch.Tensor]]:
        """Per layer, the row tables of ``mode``: "token" rows, else whole-block rows (which
        exist wherever the planner made a "block" chunk: ``block_ok``)."""
        if mode == "token":
            return self.tok_tables
        if self.blk_tables is None:
            raise ValueError(f"a {mode!r} chunk for a cache without block rows")
        return self.blk_tables

    def _np_tables(self, mode: str) -> list[list[np.ndarray]]:
        """:meth:`_tables` as numpy arrays (CPU caches of a dense layout)."""
        tabs = self.tok_np if mode == "token" else self.blk_np
        if tabs is None:
            raise ValueError(f"no numpy row tables for {mode!r} chunks of this cache")
        return tabs

    @staticmethod
    def _valid(cp: ChunkPlan) -> torch.Tensor:
        if cp.valid is None:
            raise ValueError(f"{cp!r} has no valid positions")
        return cp.valid

    def _index(self, tabs: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        if len(tabs) == 1:
            return tabs[0].index_select(0, idx)
        return torch.stack([t.index_select(0, i) for t, i in zip(tabs, idx)])

    def _index_into(self, tabs: list[torch.Tensor], idx: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst`` is one layer of a chunk, ``[planes, tokens, W]``, contiguous."""
        if dst.device != tabs[0].device:  # GPU cache -> host chunk via a device temporary
            dst.copy_(self._index(tabs, idx).view(dst.shape), non_blocking=False)
            return
        if len(tabs) == 1:
            torch.index_select(tabs[0], 0, idx, out=dst.view(idx.numel(), -1))
        else:
            for p, (t, i) in enumerate(zip(tabs, idx)):
                torch.index_select(t, 0, i, out=dst[p].view(i.numel(), -1))

    def _index_copy(self, tabs: list[torch.Tensor], idx: torch.Tensor, src: torch.Tensor
                    ) -> None:
        """``src`` (one layer of a chunk, ``[planes, tokens, W]``) into rows ``idx``."""
        src = src.to(self.device, non_blocking=False)
        if len(tabs) == 1:
            tabs[0].index_copy_(0, idx, src.reshape(idx.numel(), -1))
        else:
            for p, (t, ix) in enumerate(zip(tabs, idx)):
                t.index_copy_(0, ix, src[p].reshape(ix.numel(), -1))

    def _put(self, idx: np.ndarray, mode: str, big: np.ndarray, layer_ids: Sequence[int]
             ) -> None:
        """``big`` (``[m, *chunk shape]``) into rows ``idx`` (as :meth:`_take`'s): one fancy
        assignment per layer (and plane) for all ``m`` chunks, their source strided or not
        (each chunk's rows of a layer are contiguous, so the reshape is a view)."""
        m, rows = big.shape[0], idx.shape[-1]
        np_tabs = self._np_tables(mode)
        two = idx.ndim == 3
        for layer in layer_ids:
            for p, t in enumerate(np_tabs[layer]):
                t[idx[:, p] if two else idx] = (
                    big[:, layer, p] if two else big[:, layer]).reshape(m, rows, -1)

    # Strided layouts: advanced indexing on the per-plane views.
    def _strided_gather(self, layer: int, cp: ChunkPlan, dst: torch.Tensor) -> None:
        bs, H, D = self.spec.block_size, self.spec.num_kv_heads, self.spec.head_size
        idx = cp.rows()
        if cp.mode == "block":  # whole blocks: one gather in memory order, one permuting copy
            m = idx.numel()
            for p, (view, order) in enumerate(self.plane_views[layer]):
                dst[p].view(m, bs, H, D).permute(0, *order).copy_(
                    view.permute(0, *order).index_select(0, idx))
            return
        blk, off = torch.div(idx, bs, rounding_mode="floor"), idx % bs
        pos = slice(None) if cp.valid is None else cp.valid
        for p, (view, _) in enumerate(self.plane_views[layer]):
            dst[p, pos] = view[blk, off].reshape(-1, H * D).to(dst.device)

    def _strided_scatter(self, layer: int, cp: ChunkPlan, src: torch.Tensor) -> None:
        bs, H, D = self.spec.block_size, self.spec.num_kv_heads, self.spec.head_size
        idx = cp.rows()
        if cp.mode == "block":
            m = idx.numel()
            for p, (view, order) in enumerate(self.plane_views[layer]):
                rows = src[p].reshape(m, bs, H, D).permute(0, *order)
                phys = view.permute(0, *order)
                if self.cpu:  # numpy: a GIL-free permuting copy straight into the blocks
                    phys.numpy()[cp.index_np] = rows.numpy()
                else:
                    phys.index_copy_(0, idx, rows.to(phys.device))
            return
        blk, off = torch.div(idx, bs, rounding_mode="floor"), idx % bs
        pos = slice(None) if cp.valid is None else cp.valid
        for p, (view, _) in enumerate(self.plane_views[layer]):
            view[blk, off] = src[p, pos].reshape(-1, H, D).to(view.device)


def _dense_rows(p: PlaneStrides, width: int, head_size: int, heads: int) -> bool:
    """Whether every token's row of this plane is one dense run at a multiple of ``width``
    elements from its tensor's start (then a flat ``[rows, width]`` view indexes it)."""
    return (p.dim == 1 and (heads == 1 or p.head == head_size)
            and p.base % width == 0 and p.block % width == 0 and p.token % width == 0)


def _flat_rows(t: torch.Tensor, unit: int) -> torch.Tensor:
    """``t``'s memory, from its first element to its last, as rows of ``unit`` elements
    (``t.view(-1, unit)`` for a contiguous tensor; also works for strided views)."""
    return torch.as_strided(t, (span_elements(t.shape, t.stride()) // unit, unit), (unit, 1))
