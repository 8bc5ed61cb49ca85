"""What the scheduler decided for one step: the contract between the scheduler, the
model runner and a KV connector's ``build_connector_meta``.

Positions: for each scheduled request, the K/V of positions ``[0, num_computed_tokens)``
are in the cache before the forward pass runs, *including* the
``num_external_tokens`` positions ``[num_computed_tokens - num_external_tokens,
num_computed_tokens)`` that the connector loads during this very step. The forward
computes positions ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request_id: the request's id.
        token_ids: all of the request's tokens known at scheduling time (prompt, then
            tokens generated so far); covers every position computed this step.
        num_prompt_tokens: how many of ``token_ids`` are prompt.
        block_ids: the request's blocks, in position order: position ``p`` lives in slot
            ``block_ids[p // block_size] * block_size + p % block_size``.
        num_computed_tokens: tokens whose K/V are in the cache before the forward
            (see module docstring), i.e. the first position computed this step.
        num_scheduled_tokens: how many positions the forward computes this step.
        num_external_tokens: how many of the ``num_computed_tokens`` the connector loads
            in this step (0 unless the request was admitted this step with a hit).
        is_new: first time this request is scheduled.
        is_resumed: first schedule after a preemption (its cache was dropped, so it
            starts again from position 0, prompt and generated tokens alike).
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_external_tokens: int = 0
    is_new: bool = False
    is_resumed: bool = False

    @property
    def end_position(self) -> int:
        """One past the last position computed this step."""
        return self.num_computed_tokens + self.num_scheduled_tokens

    @property
    def samples_token(self) -> bool:
        """True when this step reaches the end of the known tokens, so the logits of the
        last position are sampled (otherwise it is a non-final prefill chunk)."""
        return self.end_position == len(self.token_ids)


@dataclass
class SchedulerOutput:
    """A step's schedule.

    Attributes:
        step_id: increasing step counter.
        scheduled_requests: requests computed this step, in batch order.
        finished_req_ids: requests that finished or were aborted since the previous
            schedule (``request_finished`` was already called; their blocks are freed).
        preempted_req_ids: requests preempted while building this schedule (blocks
            freed, progress reset to 0; they will come back with ``is_resumed``).
    """

    step_id: int
    scheduled_requests: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.scheduled_requests)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {r.request_id: r.num_scheduled_tokens for r in self.scheduled_requests}

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_requests
