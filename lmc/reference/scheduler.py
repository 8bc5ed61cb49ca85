"""Continuous batching with chunked prefill, preemption, and the scheduler-side
connector hooks.

Each step has a token budget (``max_num_batched_tokens``). Running requests go first, in
arrival order: a decode takes one token, an unfinished prefill takes as many prompt
tokens as the budget leaves (chunked prefill). Then waiting requests are admitted while
budget, ``max_num_seqs`` and free blocks allow. There is no separate prefill or decode
phase: one step can mix both.

When a running request needs a block and none is free, the most recently admitted
running request is preempted, recompute-style: its blocks are freed, its progress
reset to 0, and it goes back to the front of the waiting queue; on re-admission it
recomputes its prompt and the tokens it had generated. A step that preempted admits
nobody new.

A connector may answer a request's external tokens as an *asynchronous* load (a prefill/
decode consumer's): the request gets blocks for them and waits in ``loading``, not
scheduled and not preemptible, until the connector reports it finished
(:meth:`Scheduler.finish_remote_loads`); it then goes back to the front of the waiting
queue with those positions computed, less any the connector reported as failed blocks.

A connector hook that raises for one request (its ``kv_transfer_params`` are the client's)
fails that request alone (:meth:`Scheduler.fail_request`): it is finished, its blocks
freed, and the engine reports the error; everyone else is scheduled as before.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque

from lmc.reference.block_manager import BlockManager
from lmc.reference.connector_api import KVConnector
from lmc.reference.request import Request, RequestStatus
from lmc.reference.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)
MAX_BLEND_WAITS = 8  # steps a blended prefill waits for a budget that holds it whole


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        connector: KVConnector | None = None,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.block_manager = block_manager
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.connector = connector
        if connector is not None:
            connector.set_step_budget(max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.loading: dict[str, Request] = {}  # asynchronous loads in flight
        self._abandoned: dict[str, list[int]] = {}  # aborted while loading: blocks, until done
        self.num_preemptions = 0
        self._step_id = 0
        self._finished_since_last: list[str] = []
        self.failed: list[tuple[Request, str]] = []  # failed alone; the engine drains it

    # ------------------------------------------------------------------ queue

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {request.num_tokens} tokens exceeds "
                f"max_model_len={self.max_model_len}"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def fail_request(self, request: Request, error: str) -> None:
        """Finish ``request`` now (aborted) because something about it failed; the engine
        reports it with ``error``. The rest of the schedule goes on without it."""
        logger.debug("request %s failed: %s", request.request_id, error)
        if not request.is_finished and request.request_id in self.requests:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        self.failed.append((request, error))

    def abort_all(self) -> int:
        """Abort every unfinished request (the engine's last resort after a failure it could
        not pin on one); a request whose abort fails is dropped from every queue and its
        blocks freed. Never raises. Returns how many there were."""
        requests = list(self.requests.values())
        for request in requests:
            try:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
            except Exception:
                self._drop(request)
        return len(requests)

    def _drop(self, request: Request) -> None:
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        self.loading.pop(request.request_id, None)
        self.requests.pop(request.request_id, None)
        with contextlib.suppress(Exception):
            self.block_manager.free(request.block_ids)
        request.block_ids = []

    def abort_request(self, request_id: str) -> bool:
        """Finish a waiting or running request now; its blocks are freed. Returns
        whether the request was found unfinished."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    @property
    def has_remote_loads(self) -> bool:
        """Asynchronous loads in flight (aborted ones included: they still hold blocks)."""
        return bool(self.loading or self._abandoned)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # --------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        output = SchedulerOutput(step_id=self._step_id, finished_req_ids=self._finished_since_last)
        self._finished_since_last = []
        budget = self.max_num_batched_tokens

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing left to compute (not reachable in normal flow)
                index += 1
                continue
            preempted_self = False
            while not self._grow_blocks(request, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    preempted_self = True
                    break
            if preempted_self:
                break
            output.scheduled_requests.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1

        while (
            not output.preempted_req_ids
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            is_resumed = request.status is RequestStatus.PREEMPTED
            is_new = request.status is RequestStatus.WAITING
            try:
                num_external, is_async = self._num_external_tokens(request)
            except Exception as e:  # this request's parameters broke the connector
                self.fail_request(request, f"KV connector lookup failed: {one_line(e)}")
                continue
            start = request.num_computed_tokens + num_external
            if request.segments and request.num_tokens - start > budget:
                # a blended prefill runs in one step: wait (a few steps at most, so a busy
                # batch cannot starve it) for a step with room, else compute it as a plain
                # prompt (chunked)
                fits = request.num_tokens - start <= self.max_num_batched_tokens
                if fits and request.blend_waits < MAX_BLEND_WAITS:
                    request.blend_waits += 1
                    break
                logger.info("request %s: %d tokens to prefill %s; its segments are computed, "
                            "not blended", request.request_id, request.num_tokens - start,
                            f"did not fit {MAX_BLEND_WAITS} steps' budgets" if fits else
                            f"exceed max_num_batched_tokens {self.max_num_batched_tokens}")
                request.segments = None
            num_new = min(request.num_tokens - start, budget)
            if not self._grow_blocks(request, start if is_async else start + num_new):
                break
            if self.connector is not None:
                try:  # before num_computed_tokens moves: the load covers
                    # [request.num_computed_tokens, request.num_computed_tokens + num_external)
                    self.connector.update_state_after_alloc(request, list(request.block_ids),
                                                            num_external)
                except Exception as e:
                    self.fail_request(request, f"KV connector allocation failed: {one_line(e)}")
                    continue
            self.waiting.popleft()
            if is_async:  # holds its blocks, unscheduled, until the connector reports it
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_computed_tokens = start
                request.num_cached_tokens = num_external
                self.loading[request.request_id] = request
                continue
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = start
            if is_new and not request.remote_loaded:
                request.num_cached_tokens = num_external
            self.running.append(request)
            output.scheduled_requests.append(
                self._scheduled(request, num_new, num_external, is_new, is_resumed)
            )
            budget -= num_new
        return output

    def _num_external_tokens(self, request: Request) -> tuple[int, bool]:
        """Ask the connector, then clamp: the last token is always computed here. Returns
        ``(tokens, asynchronous)``; a request whose async load ended is not asked again."""
        if self.connector is None or request.remote_loaded:
            return 0, False
        offered = self.connector.get_num_new_matched_tokens(request, request.num_computed_tokens)
        is_async = False
        if isinstance(offered, tuple):
            offered, is_async = offered
        offered = int(offered or 0)  # None (vLLM's "not yet") counts as no hit
        n = max(0, min(offered, request.num_tokens - 1 - request.num_computed_tokens))
        return n, bool(is_async and n > 0)

    def finish_remote_loads(self, done: set[str], bad_blocks: set[int]) -> None:
        """The connector reported these asynchronous loads ended (``bad_blocks``: the
        blocks it could not fill, from any request). Each request goes back to the front
        of the waiting queue with its positions up to its first bad block computed."""
        for rid in done:
            blocks = self._abandoned.pop(rid, None)
            if blocks is not None:  # aborted while loading: its blocks are free now
                self.block_manager.free(blocks)
                continue
            request = self.loading.pop(rid, None)
            if request is None:
                continue
            for index, block_id in enumerate(request.block_ids):
                valid = index * self.block_size
                if valid >= request.num_computed_tokens:
                    break
                if block_id in bad_blocks:
                    logger.warning("request %s: asynchronous KV load failed in block %d; "
                                   "recomputing from position %d", rid, block_id, valid)
                    request.num_computed_tokens = valid
                    request.num_cached_tokens = min(request.num_cached_tokens, valid)
                    break
            request.remote_loaded = True
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def _grow_blocks(self, request: Request, num_tokens: int) -> bool:
        """Make the request's blocks cover ``num_tokens`` positions, if blocks allow."""
        missing = -(-num_tokens // self.block_size) - len(request.block_ids)
        if missing <= 0:
            return True
        if not self.block_manager.can_allocate(missing):
            return False
        request.block_ids.extend(self.block_manager.allocate(missing))
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.remote_loaded = False  # recomputed (or looked up) like any resumed request
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s", request.request_id)

    @staticmethod
    def _scheduled(
        request: Request, num_new: int, num_external: int = 0,
        is_new: bool = False, is_resumed: bool = False,
    ) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            block_ids=tuple(request.block_ids),
            num_computed_tokens=request.num_computed_tokens,
            num_scheduled_tokens=num_new,
            num_external_tokens=num_external,
            is_new=is_new,
            is_resumed=is_resumed,
        )

    # ----------------------------------------------------------- after a step

    def handle_load_errors(self, output: SchedulerOutput, bad_blocks: set[int]) -> set[str]:
        """Roll back requests whose cached positions sit in a failed block. Returns the
        ids whose step results must be discarded."""
        invalid: set[str] = set()
        if not bad_blocks:
            return invalid
        for sched in output.scheduled_requests:
            request = self.requests.get(sched.request_id)
            if request is None:
                continue
            for index, block_id in enumerate(sched.block_ids):
                valid = index * self.block_size
                if valid >= sched.num_computed_tokens:
                    break
                if block_id in bad_blocks:
                    logger.warning(
                        "request %s: KV load failed in block %d; recomputing from position %d",
                        sched.request_id, block_id, valid,
                    )
                    request.num_computed_tokens = valid
                    request.num_cached_tokens = min(request.num_cached_tokens, valid)
                    invalid.add(sched.request_id)
                    break
        return invalid

    def update_after_step(
        self, output: SchedulerOutput, sampled: dict[str, int], invalid: set[str]
    ) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests that hit a stop.
        Returns the requests finished by this step."""
        finished: list[Request] = []
        for sched in output.scheduled_requests:
            request = self.requests.get(sched.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted in the meantime
            if sched.request_id in invalid:
                continue
            request.num_computed_tokens = sched.end_position
            token = sampled.get(sched.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            status = self._stop_status(request, token)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in request.eos_token_ids
        ):
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif loading:
            self.loading.pop(request.request_id, None)
        else:
            self.waiting.remove(request)
        request.status = status
        if self.connector is not None:  # blocks still hold its K/V
            try:
                request.kv_transfer_params_out = self.connector.request_finished(request)
            except Exception as e:  # its blocks are freed all the same
                logger.debug("request %s: connector request_finished failed: %s",
                             request.request_id, one_line(e))
        if loading:  # a load may still write them: freed when the connector reports it
            self._abandoned[request.request_id] = request.block_ids
        else:
            self.block_manager.free(request.block_ids)
        request.block_ids = []
        del self.requests[request.request_id]
        self._finished_since_last.append(request.request_id)


def one_line(e: BaseException) -> str:
    """An exception in one bounded line: its type and the start of its message."""
    return f"{type(e).__name__}: {str(e)[:300]}"
