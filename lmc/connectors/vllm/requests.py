"""vLLM's ``SchedulerOutput`` in the connector core's terms (:class:`StepRequest`).

vLLM sends workers only the difference per step: a request's prompt and first block table
when it is first scheduled (``scheduled_new_reqs``), then appended block ids and the new
``num_computed_tokens`` (``scheduled_cached_reqs``). The core wants each scheduled request's
tokens, full block table and counts every step, so this tracker keeps, per request, the
live ``Request`` object (its ``all_token_ids`` grow with decoding) and the block table,
from admission (``update_state_after_alloc``) until ``request_finished``.

Duck-typed on vLLM's objects (no vLLM import), so it is tested without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmc.connectors.core.metadata import StepRequest
from lmc.connectors.vllm.groups import group_tables
from lmc.token_database import request_tag

log = logging.getLogger(__name__)


def cacheable(request: Any) -> bool:
    """Whether a request's KV is a function of its token ids and of what its key tag names
    (:func:`key_tag`): not for prompt embeddings or multimodal inputs (placeholder tokens
    stand for different images), which lmc leaves to the engine. LoRA and salted requests
    are cached, each in the chain of its own tag."""
    return (getattr(request, "prompt_token_ids", None) is not None
            and getattr(request, "prompt_embeds", None) is None
            and not getattr(request, "mm_features", None))


def key_tag(request: Any) -> bytes | None:
    """The request's key tag: its LoRA adapter's name and its ``cache_salt``, as vLLM's
    prefix cache folds them into its block hashes (:func:`lmc.token_database.request_tag`
    says why these and what an operator must ensure of adapter names); ``None`` for a plain
    request. ``ValueError``/``TypeError`` name a field lmc cannot key by (a LoRA request
    without a name, a salt that is not a string): such a request is left to the engine."""
    lora = getattr(request, "lora_request", None)
    name = None
    if lora is not None:
        name = getattr(lora, "lora_name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA request without a name (lora_name={name!r:.60})")
    return request_tag(name, getattr(request, "cache_salt", None))


@dataclass
class _Tracked:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    key_tag: bytes | None = None
    tables: list[list[int]] = field(default_factory=list)  # a hybrid model's, per group


class RequestTracker:
    """Block tables and live token lists of the admitted, cacheable requests. ``groups``:
    vLLM's KV cache groups; with several (a hybrid model), every group's table is kept, and
    the scheduler's own current tables (``kv_connector_block_state``: a sliding window's
    freed blocks as the null block) are preferred where the step offers them."""

    def __init__(self, save_decode: bool = False, groups: int = 1) -> None:
        self.save_decode = save_decode
        self.groups = groups
        self._reqs: dict[str, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def admit(self, request: Any, tag: bytes | None = None) -> None:
        self._reqs[request.request_id] = _Tracked(request, key_tag=tag)

    def drop(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def token_ids(self, request: Any) -> Sequence[int]:
        """What the keys are computed from: the prompt, plus generated tokens when they
        are saved or when a preempted request resumes with them in its prefix."""
        return request.all_token_ids

    def step_requests(self, so: Any) -> list[StepRequest]:
        """One :class:`StepRequest` per scheduled, tracked request of this step."""
        out: list[StepRequest] = []
        state = getattr(so, "kv_connector_block_state", None) if self.groups > 1 else None
        for new in so.scheduled_new_reqs:
            t = self._reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0]) if new.block_ids else []
            if self.groups > 1:
                t.tables = [list(g) for g in new.block_ids or ()]
            out.append(self._step(new.req_id, t, new.num_computed_tokens,
                                  so.num_scheduled_tokens.get(new.req_id, 0), state))
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            t = self._reqs.get(rid)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                t.block_ids = list(new_ids[0]) if new_ids else []
                t.tables = [list(g) for g in new_ids or ()]
            elif new_ids:
                t.block_ids.extend(new_ids[0])
                if self.groups > 1:
                    t.tables = [old + list(g) for old, g in
                                zip(t.tables or [[] for _ in new_ids], new_ids)]
            out.append(self._step(rid, t, cached.num_computed_tokens[i],
                                  so.num_scheduled_tokens.get(rid, 0), state))
        return out

    def _step(self, rid: str, t: _Tracked, computed: int, scheduled: int,
              state: Any = None) -> StepRequest:
        req = t.request
        tables: tuple[tuple[int, ...], ...] = ()
        if self.groups > 1:
            current = state.get_block_ids(rid) if state is not None else None
            tables = group_tables(current if current is not None else t.tables)
        return StepRequest(request_id=rid, token_ids=req.all_token_ids,
                           num_prompt_tokens=req.num_prompt_tokens,
                           block_ids=tuple(t.block_ids), num_computed_tokens=computed,
                           num_scheduled_tokens=scheduled, key_tag=t.key_tag,
                           group_block_ids=tables)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._reqs.pop(rid, None)
