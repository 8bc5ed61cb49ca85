"""What ``LLM.generate`` returns for each prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RequestOutput:
    """A finished request.

    Attributes:
        request_id: the request's id.
        prompt: the prompt text (None when the prompt was given as token ids).
        prompt_token_ids: the prompt, tokenized.
        token_ids: generated tokens, including a final stop/EOS token if one was hit.
        text: ``token_ids`` decoded, special tokens skipped ("" without a tokenizer).
        ttft_s: seconds from the request's arrival to its first generated token
            (None if it never produced one, e.g. aborted while waiting).
        num_cached_tokens: prompt tokens the KV connector supplied (0 without one).
        finish_reason: "stop" (EOS or a stop token), "length" (max_tokens or
            max_model_len) or "abort".
        kv_transfer_params: what the KV connector answered for the request when it
            finished (a prefill/decode producer's parameters for the consumer), or None.
        logits: with ``return_logits=True``, ``[len(token_ids), vocab]`` fp32 CPU: row
            ``i`` is the distribution token ``i`` was drawn from (row 0 = the prompt's
            last position); None otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    ttft_s: float | None
    num_cached_tokens: int
    finish_reason: str | None
    logits: torch.Tensor | None = None
    kv_transfer_params: dict | None = None
