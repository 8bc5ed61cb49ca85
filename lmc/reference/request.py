"""A request's lifetime state: tokens, progress through the KV cache, blocks, status.

The fields a KV connector reads are the stable part of this object (see
``connector_api.ConnectorRequest``): ``request_id``, ``prompt_token_ids``,
``all_token_ids``, ``num_computed_tokens``, ``block_ids``, ``num_tokens``.
"""

from __future__ import annotations

import enum
import math
import operator
import time
from dataclasses import dataclass, field

import torch

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``seed`` seeds the request's own generator, so a
    sampled request is reproducible whatever else is in the batch; two requests with
    the same seed and prompt sample the same tokens. ``seed=None`` draws a seed from
    torch's global generator.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    return_logits: bool = False

    def __post_init__(self) -> None:
        # NaN compares false with everything: each check is written so that NaN fails it
        if not self.max_tokens >= 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not SEED_MIN <= _integer(self.seed) <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] "
                             f"(a torch generator's range), got {self.seed!r}")


def _integer(v: object) -> float:
    """``v`` as an integer, or NaN (fails every range check) when it is not one."""
    try:
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        return math.nan


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks held, KV arriving (async load)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(eq=False)
class Request:
    """One generation request.

    ``num_computed_tokens`` counts the leading tokens of ``all_token_ids`` whose K/V are
    in the cache (computed here or loaded by the connector). ``block_ids`` hold those
    tokens in order: position ``p`` is in block ``block_ids[p // block_size]``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens supplied by the connector (last admission)
    num_preemptions: int = 0
    first_token_time: float | None = None
    # prefill/decode: what the request came with (vLLM's shape) and what its connector
    # answered when it finished (a producer's parameters for the consumer)
    kv_transfer_params: dict | None = None
    kv_transfer_params_out: dict | None = None
    remote_loaded: bool = False  # its prompt's KV arrived asynchronously: not asked again
    logits: list[torch.Tensor] = field(default_factory=list)
    generator: torch.Generator | None = None
    # reusable segments of the prompt, (start, end) spans (lmc.blend): blended when the
    # engine has a blender and the prefill runs in one step, else computed as usual
    segments: list[tuple[int, int]] | None = None
    blend_waits: int = 0  # steps it waited for room to prefill in one step (scheduler)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.temperature > 0:
            seed = self.sampling_params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,)).item())
            self.generator = torch.Generator(device="cpu").manual_seed(seed)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens (do not mutate; use ``append_output_token``)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
