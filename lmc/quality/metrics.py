"""The figures a lossy KV feature is judged by, as plain functions of logits and tokens.

Every comparison is of two next-token distributions at the same positions: the model's with
exact KV (``p``) and with the KV the feature serves (``q``), both teacher-forced on the same
tokens. ``KL(p || q)`` in nats says how much probability mass moved; top-1 agreement says
whether greedy decoding would pick the same token; perplexity on a fixed text says how much
worse the model predicts it. Computed in float64: a KL of 1e-7 must not be rounding noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(p) || softmax(q))`` per row, nats, ``[rows]`` float64 (never below 0)."""
    _same_shape(p_logits, q_logits)
    logp = F.log_softmax(p_logits.double(), dim=-1)
    logq = F.log_softmax(q_logits.double(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(dim=-1).clamp_min(0.0)


def top1_matches(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per row, whether both distributions' most likely token is the same (bool ``[rows]``)."""
    _same_shape(p_logits, q_logits)
    return p_logits.argmax(dim=-1) == q_logits.argmax(dim=-1)


def token_nll(logits: torch.Tensor, targets: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target under its row's distribution, nats, float64."""
    t = torch.as_tensor(targets, dtype=torch.long)
    if logits.dim() != 2 or t.shape != (logits.shape[0],):
        raise ValueError(f"need logits [n, vocab] and n targets, got {tuple(logits.shape)} and "
                         f"{tuple(t.shape)}")
    logp = F.log_softmax(logits.double(), dim=-1)
    return -logp.gather(1, t[:, None]).squeeze(1)


def perplexity(logits: torch.Tensor, targets: Sequence[int] | torch.Tensor) -> float:
    """``exp(mean NLL)`` of the targets."""
    return math.exp(float(token_nll(logits, targets).mean()))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the two token lists differ (a shorter one differs where it
    ends), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
