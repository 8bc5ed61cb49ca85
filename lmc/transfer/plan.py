"""What a copy between an engine's paged KV and chunk buffers is asked and planned: the
:class:`KVTransfer` interface every copy path implements (:mod:`lmc.transfer.torch_copy`,
:mod:`lmc.transfer.cuda_copy`) and the plan types they share.

A call is planned once (slot indices turned into row indices, per chunk) and then executed for
all layers or one layer at a time, so layer-wise pipelining pays the planning cost once.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np
import torch

from lmc.transfer.completion import Completion, record
from lmc.transfer.kv_spec import KVCaches, KVSpec

INT_VIEW = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32),
            8: (torch.int64, np.int64)}
"""Item size -> the (torch, numpy) integer dtypes of that width: views that move bits."""


def int_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor as same-width integers: moves bits, never converts."""
    tdt, _ = INT_VIEW[t.element_size()]
    return t.view(tdt).numpy()


class ChunkPlan:
    """Row indices for one chunk: the tokens ``[start, end)`` of the call.

    ``mode``: "block" | "token" | "masked" | "empty" (no slot mapped). ``index``: row indices,
    plane-major, on the cache's device; ``index_np``: the same as numpy (CPU caches), from
    which ``index`` is made on first use: CPU block and token copies run in numpy and never
    need a tensor per chunk. ``valid`` ("masked"): positions within the chunk whose slot is
    >= 0."""

    __slots__ = ("start", "end", "mode", "_index", "index_np", "valid")

    def __init__(self, start: int, end: int, mode: str, index: torch.Tensor | None,
                 index_np: np.ndarray | None, valid: torch.Tensor | None) -> None:
        self.start = start
        self.end = end
        self.mode = mode
        self._index = index
        self.index_np = index_np
        self.valid = valid

    @property
    def index(self) -> torch.Tensor | None:
        t = self._index
        if t is None and self.index_np is not None:
            t = self._index = torch.from_numpy(self.index_np)
        return t

    def rows(self) -> torch.Tensor:
        """``index`` where the mode has one (every mode but "empty")."""
        t = self.index
        if t is None:
            raise ValueError(f"{self!r} has no row index")
        return t

    def __repr__(self) -> str:
        return f"ChunkPlan({self.start}, {self.end}, {self.mode!r})"


@dataclasses.dataclass
class TransferPlan:
    chunks: list[ChunkPlan]


class ChunkRanges(Sequence[tuple[int, int]]):
    """``count`` consecutive token ranges of ``size`` tokens from ``start``, the last one
    ending at ``end`` (a prompt's chunks: its tail may be shorter). Why: it is what a call
    plans nearly always, and as a list it costs a tuple per chunk to build and a comparison
    per chunk to recognise; planning reads its runs from it directly."""

    __slots__ = ("start", "size", "n", "end")

    def __init__(self, start: int, size: int, count: int, end: int) -> None:
        if size <= 0 or count < 0 or count and not (
                start + (count - 1) * size < end <= start + count * size):
            raise ValueError(f"ChunkRanges(start={start}, size={size}, count={count}, "
                             f"end={end}): the last range must end inside the last chunk")
        self.start, self.size, self.n, self.end = start, size, count, end

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> tuple[int, int]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[int, int]]: ...

    def __getitem__(self, i: int | slice) -> tuple[int, int] | list[tuple[int, int]]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(f"range {i} of {self.n}")
        a = self.start + i * self.size
        return (a, min(a + self.size, self.end))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self[:])

    def runs(self) -> list[tuple[int, int]]:
        """``(i, j)`` per run of equal ranges: the full ones, then a shorter tail."""
        c = self.n
        if not c:
            return []
        full = c if self.end - self.start == c * self.size else c - 1
        return [(0, c)] if full == c else [(0, full), (full, c)] if full else [(0, c)]

    def __repr__(self) -> str:
        return f"ChunkRanges({self.start}, {self.size}, {self.n}, {self.end})"


class PlanRun:
    """Consecutive chunks of one size and mode ("block" or "token") of a CPU plan, whose row
    indices are the rows of one array: ``index_np[k]`` is chunk ``first + k``'s
    (``[count, planes * per]`` for one-table layouts, ``[count, planes, per]`` else).

    Why: a prompt's chunks are planned by one reshape, and a Python object per chunk costs
    more than that; a run is also copied with one numpy call per layer where its buffers
    lie evenly spaced in the pool (:class:`lmc.memory.pool.PoolArrays`)."""

    __slots__ = ("first", "count", "mode", "index_np")

    def __init__(self, first: int, count: int, mode: str, index_np: np.ndarray) -> None:
        self.first = first
        self.count = count
        self.mode = mode
        self.index_np = index_np


def equal_runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(i, j)`` for each run of chunks ``ranges[i:j]`` that are consecutive (each starts
    where the previous ends) and of one size. The usual call -- a prompt's full chunks, then
    maybe a shorter tail -- is recognised by one list comparison, with no loop per chunk
    (a :class:`ChunkRanges` says so itself)."""
    if isinstance(ranges, ChunkRanges):
        return ranges.runs()
    count = len(ranges)
    if not count:
        return []
    s0, e0 = ranges[0]
    n = e0 - s0
    full = count if ranges[-1][1] - ranges[-1][0] == n else count - 1
    if n > 0 and full and ranges[:full] == list(zip(range(s0, s0 + full * n, n),
                                                    range(e0, e0 + full * n, n))):
        return [(0, count)] if full == count else [(0, full), (full, count)]
    out = []
    i = 0
    while i < count:
        s0, e0 = ranges[i]
        n = e0 - s0
        j, end = i + 1, e0
        while j < count:
            a, b = ranges[j]
            if a != end or b - a != n:
                break
            end = b
            j += 1
        out.append((i, j))
        i = j
    return out


class KVTransfer(abc.ABC):
    """Moves KV between an engine's cache (fixed at construction) and chunk buffers.

    Chunk buffers are ``[layers, planes, tokens, heads*dim]`` tensors (``KVSpec.chunk_shape``).
    Slots ``< 0`` are skipped: gather leaves those rows untouched, scatter does not write them.

    ``gather``/``scatter`` may return before the copy has run: they return a
    :class:`~lmc.transfer.completion.Completion`, and until it is done the copy owns ``bufs`` and the
    KV slots it writes (see :mod:`lmc.transfer.completion`). ``after``: a handle the copy must wait for
    before it starts (an event on the engine's stream: the gather never reads KV the forward
    has not written). ``stream``: the CUDA stream to run on (default: the current one).
    """

    def __init__(self, spec: KVSpec, kv_caches: KVCaches) -> None:
        self.spec = spec
        self.layers = spec.validate(kv_caches)
        self.device = self.layers[0][0].device

    @abc.abstractmethod
    def plan(self, slots: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> TransferPlan:
        """Prepare moving tokens ``slots[start:end]`` for each ``(start, end)`` in ``ranges``."""

    @abc.abstractmethod
    def gather(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
               layers: Iterable[int] | None = None, *, after: Completion | None = None,
               stream: Any = None, arrays: Sequence[np.ndarray] | None = None) -> Completion:
        """Engine cache -> ``bufs[i]`` (one per planned chunk), for ``layers`` (default all).
        ``arrays`` may carry C-contiguous integer numpy views of the same buffers (then a CPU
        copy may read only those, and ``bufs`` may be a lazy sequence it never indexes)."""

    @abc.abstractmethod
    def scatter(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
                layers: Iterable[int] | None = None,
                arrays: Sequence[np.ndarray] | None = None, *,
                after: Completion | None = None, stream: Any = None) -> Completion:
        """``bufs[i]`` -> engine cache, for ``layers`` (default all). ``arrays`` may carry
        integer numpy views of the same buffers; implementations may ignore it."""

    def record_event(self, stream: Any = None) -> Completion:
        """A point on ``stream`` (default: the caller's current stream), for ``after=``."""
        return record(self.device, stream)

    def synchronize(self) -> None:  # noqa: B027 - a no-op where transfers are synchronous
        """Wait until every transfer issued so far is complete (no-op on CPU)."""

    def has_negative(self, slots: torch.Tensor) -> bool:
        """Whether any slot is unmapped (numpy on host: far cheaper than a torch reduction)."""
        if slots.device.type == "cpu":
            return bool(slots.numpy().min() < 0) if slots.numel() else False
        return bool((slots < 0).any())

    def check_slots(self, slots: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Validate a slot mapping; return it as int64, where it was. Host (CPU) slots are
        accepted for any cache and are the fast path: planning never waits for the device."""
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"slot_mapping must be a torch.Tensor, got {type(slots).__name__}")
        if slots.dim() != 1:
            raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slots.shape)}")
        if slots.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"slot_mapping must be int32 or int64, got {slots.dtype}")
        if slots.numel() != num_tokens:
            raise ValueError(f"slot_mapping has {slots.numel()} entries for {num_tokens} tokens")
        if slots.device != self.device and slots.device.type != "cpu":
            raise ValueError(f"slot_mapping is on {slots.device}, the KV cache is on {self.device}")
        return slots.to(torch.int64)
