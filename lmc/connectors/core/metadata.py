"""What the scheduler side tells the worker side, once per step: plain, picklable dataclasses.

vLLM builds the scheduler-side connector in the EngineCore process and the worker-side one in
each worker process; the only thing that crosses between them is the object returned by
``build_connector_meta``. So everything here is tuples of ints and strings (no tensors, no
engine objects, no references to either side), and the worker needs nothing else to act:
token ids, block ids and positions are all spelled out.

Positions follow the engine's convention: position ``p`` of a request lives in slot
``block_ids[p // block_size] * block_size + p % block_size``. A hybrid model's engine keeps a
block table per KV group (:mod:`lmc.transfer.kv_groups`): ``group_block_ids`` carries them
all, in the groups' order (a negative id: a block the group does not hold, such as a
sliding window's skipped blocks); empty, every group uses ``block_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lmc.connectors.core.hints import CacheHints


@dataclass(frozen=True)
class LoadSpec:
    """Load stored KV into one request's blocks.

    ``token_ids`` is the request's tokens cut at the end of the last chunk to load, so that
    the chunk keys computed from it are exactly the stored ones. Only positions
    ``[start, end)`` are written: positions before ``start`` are the engine's own (a local
    prefix-cache hit) and positions from ``end`` on are computed by the engine (the last
    prompt token always is). ``mask_start`` is ``start`` rounded down to a chunk boundary:
    chunks before it are neither fetched nor written. ``key_tag``: the request's own part of
    its key root (:func:`lmc.token_database.request_tag`: its LoRA adapter, its
    ``cache_salt``), ``None`` for a plain request; every key of the load chains from it.
    """

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int
    mask_start: int
    key_tag: bytes | None = None
    group_block_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SaveSpec:
    """Save the chunks of one request that became complete in this step.

    ``token_ids`` is cut at the end of the last complete chunk (or at the end of the prompt,
    for its partial last chunk); ``start`` is the chunk-aligned first position to save. Every
    position in ``[start, len(token_ids))`` has its K/V in ``block_ids`` once the step's
    forward has written it. ``key_tag``: as :class:`LoadSpec`'s. ``horizon``: the length
    of the sequence the tokens begin (its prompt; a hybrid model keeps its sliding-window
    and state parts around that sequence's checkpoints, :mod:`lmc.hybrid.rules`); 0: the
    tokens' own length. ``hints``: the request's cache hints (session, priority, TTL:
    :mod:`lmc.connectors.core.hints`), applied to its chain once the save is committed.
    """

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    key_tag: bytes | None = None
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    horizon: int = 0
    hints: CacheHints | None = None

    @property
    def end(self) -> int:
        return len(self.token_ids)


@dataclass
class ConnectorMetadata:
    """One step's work for the worker side.

    ``forget``: requests that finished since an earlier step, so the worker drops what it
    keeps per request (chunk keys) before this step's work: a request id may then name a new
    request. Repeated until a step with loads or saves carries it (adapters may skip binding
    an empty step's metadata).

    ``async_loads``: loads the engine does not wait for inside a step (a prefill/decode
    consumer's: the prompt's KV is pulled from the producer in the background while other
    requests run); the worker reports each one finished later (``get_finished``)."""

    step_id: int = 0
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    async_loads: list[LoadSpec] = field(default_factory=list)
    compute_tokens: int = 0
    compute_attention: float = 0.0

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves and not self.async_loads


class ScheduledView(Protocol):
    """The fields of one scheduled request the scheduler side reads (duck-typed: the
    reference engine's ``ScheduledRequest`` has them; an adapter may build a
    :class:`StepRequest`)."""

    # read-only: a frozen dataclass (the reference engine's) satisfies it
    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_scheduled_tokens(self) -> int: ...


@dataclass(frozen=True)
class StepRequest:
    """A scheduled request in engine-neutral terms, for adapters whose engine's own
    scheduler output does not already have these fields.

    ``num_computed_tokens`` counts the positions whose K/V are in the cache before this
    step's forward, the ones the connector loads during the step included; the forward
    computes ``num_scheduled_tokens`` positions from there. ``key_tag``: the request's
    key tag (:class:`LoadSpec`), read by the scheduler side where a view has one;
    ``group_block_ids``: a hybrid model's block table per KV group (:class:`LoadSpec`).
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    block_ids: Sequence[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    key_tag: bytes | None = None
    group_block_ids: tuple[tuple[int, ...], ...] = ()
