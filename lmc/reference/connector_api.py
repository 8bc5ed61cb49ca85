"""The KV connector interface: how an external KV store (lmc) plugs into the engine.

Shaped after vLLM's ``KVConnectorBase_V1``, simplified: one object serves both the
scheduler side and the worker side (the reference engine runs both in one process),
layers are named by index, and lookups answer with a plain int.

Call order in one engine step (``LLM.step``)::

    scheduler.schedule()
        for each request admitted from the waiting queue (new, or resumed after
        preemption; its num_computed_tokens is 0):
            n = get_num_new_matched_tokens(request, request.num_computed_tokens)
            n is clamped by the engine (below), blocks are allocated, then
            update_state_after_alloc(request, block_ids, n)
    meta = build_connector_meta(scheduler_output)            # once per step
    start_load_kv(meta)                                       # before the forward
    for layer i:  wait_for_layer_load(i)   # before layer i writes or reads its cache
                  ... new K/V written, attention computed ...
                  save_kv_layer(i, kv_caches[i], meta)         # layer i's new K/V are in
    wait_for_save()                                           # after the forward
    get_block_ids_with_load_errors()                          # after the step
    for each request that finished or was aborted:
        request_finished(request)              # blocks still allocated and intact

The worker-side calls happen only in steps that schedule at least one token, or, while
asynchronous loads are in flight, in empty steps too (``start_load_kv``, ``wait_for_save``,
then ``get_finished`` and ``get_block_ids_with_load_errors``), so the loads start and end.
In every step ``get_finished`` comes before ``get_block_ids_with_load_errors``.

Engine guarantees:

* **Last token computed.** The engine never lets the connector supply every token:
  ``n`` is clamped to ``request.num_tokens - 1 - num_computed_tokens`` so the last
  token's logits are computed here. ``n`` is *not* rounded to a block boundary; when it
  ends inside a block, the connector loads only positions ``[num_computed_tokens,
  num_computed_tokens + n)`` of that block, or the whole block: the engine writes the
  positions it computes after ``wait_for_layer_load``, so its values win.
* **Admission.** The connector is asked only when a request is admitted from the
  waiting queue; a running request is never asked again. When admission fails for lack
  of blocks the request stays waiting and is asked again at a later step.
* **Load failures.** Blocks returned by ``get_block_ids_with_load_errors`` are treated as
  never loaded: each affected request's ``num_computed_tokens`` drops back to the start
  of its first failed block, the tokens of that step for it are discarded (nothing is
  sampled from them) and recomputed in later steps, overwriting the bad blocks before
  anything reads them. Its ``num_cached_tokens`` is reduced to match.
* **Block ids** are indices into dim 1 of each layer tensor; all blocks are usable
  (no reserved null block). Slot = ``block_id * block_size + offset``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from lmc.reference.scheduler_output import SchedulerOutput


class ConnectorRequest(Protocol):
    """The request fields a connector may read (``lmc.reference.request.Request``).

    ``all_token_ids`` is the prompt followed by the tokens generated so far: a request
    resumed after preemption recomputes all of them, so a connector may match against
    it, not only the prompt. ``block_ids`` are in position order.
    """

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    num_cached_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


class KVConnector(ABC):
    """Base class for KV connectors. Methods without a body here are optional hooks."""

    # ---------------------------------------------------------------- scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int
                                   ) -> int | tuple[int, bool]:
        """How many tokens past ``num_computed_tokens`` the connector can supply.

        Must not block for long: it runs inside scheduling. The engine clamps the
        answer (see the module docstring), so over-reporting is safe but wasteful.
        ``(n, True)`` (vLLM's form) makes the load *asynchronous*: the request gets its
        blocks and waits, unscheduled, until ``get_finished`` reports it; other requests
        run meanwhile. A partly failed async load reports its bad blocks through
        ``get_block_ids_with_load_errors`` by the same step, and those positions are
        recomputed.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Called once per admission, after blocks were allocated for the request.

        ``block_ids`` are the request's blocks, covering the external tokens and this
        step's tokens. ``num_external_tokens`` is the clamped count the connector must
        load (0 when there is nothing to load; the call still happens). At this call
        ``request.num_computed_tokens`` does not yet include the external tokens: the
        load covers positions ``[request.num_computed_tokens,
        request.num_computed_tokens + num_external_tokens)`` (vLLM's order).
        """

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Once per step after scheduling: package what the worker side needs (loads to
        run, saves to make). The engine passes the result to ``start_load_kv`` and
        ``save_kv_layer`` unchanged."""

    def request_finished(self, request: ConnectorRequest) -> dict | None:  # noqa: B027
        """The request finished or was aborted. Its blocks are still allocated and hold
        its K/V; they are freed as soon as this returns. May return ``kv_transfer_params``
        for the request's output (a prefill/decode producer's answer)."""

    def set_step_budget(self, max_num_batched_tokens: int) -> None:  # noqa: B027
        """Once at start: the scheduler's token budget per step (prompts longer than it are
        prefilled in chunks over several steps). A connector that decides how much of a hit
        to load needs it: only the first chunk's compute can hide a load."""

    # ------------------------------------------------------------------- worker side

    def register_kv_windows(self, windows: dict[str, int | None]) -> None:  # noqa: B027
        """Once at start, before ``register_kv_caches``, for a model with sliding-window
        layers: layer name -> its window in tokens (``None``: full attention). A layer with
        window ``W`` reads only the last ``W`` positions (its own included) of a sequence:
        a connector may load only those. Every layer's cache is indexed by the one block
        table of the sequence."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:  # noqa: B027
        """Once at start: layer name -> cache tensor ``[2, num_blocks, block_size,
        num_kv_heads, head_size]``, in layer order (names ``model.layers.N.self_attn``)."""

    @abstractmethod
    def start_load_kv(self, meta: Any) -> None:
        """Before the forward pass: begin loading this step's external KV."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s external KV is in its cache tensor."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, meta: Any) -> None:
        """Layer ``layer_idx``'s K/V for this step's tokens are in ``kv_layer``: save
        what should be saved (may be asynchronous until ``wait_for_save``)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward pass: block until this step's saves no longer need the
        cache contents (the blocks may be freed or reused after this)."""

    def get_finished(self) -> set[str]:
        """Requests whose asynchronous load ended since the last call (called every
        step, before ``get_block_ids_with_load_errors``)."""
        return set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose external load failed in this step (cleared once reported)."""
        return set()

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources; called by ``LLM.close``."""


# Connectors the engine can build by name, as vLLM names its connectors by module path: a
# module is imported only when its connector is asked for, so the engine carries none of
# them. A connector module offers ``build_connector(config, *, model_dir, **options) ->
# KVConnector`` and ``check_config(config)`` (the config checked before the model loads).
CONNECTOR_MODULES = {"lmc": "lmc.connectors.reference"}


def connector_module(name: str) -> ModuleType:
    """The module that builds the connector called ``name``."""
    path = CONNECTOR_MODULES.get(name)
    if path is None:
        raise ValueError(f"unknown KV connector {name!r} (known: "
                         f"{', '.join(sorted(CONNECTOR_MODULES))})")
    return importlib.import_module(path)
