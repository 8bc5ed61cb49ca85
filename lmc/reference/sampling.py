"""Token selection from fp32 logits: greedy, or temperature + top-p (nucleus).

Temperature scaling is shifted by the row's largest logit, so any finite temperature > 0
(1e-300 included) gives a distribution, never NaN.

Sampling runs on the CPU with each request's own ``torch.Generator``, so a seeded
request draws the same tokens whatever it is batched with and whatever device the
model runs on. A request's generator advances only when it actually samples a token.
"""

from __future__ import annotations

import torch

from lmc.reference.request import SamplingParams


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches ``top_p``
    (the top token always survives). Returns unnormalised probabilities."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` shifted so the largest is 0: a tiny temperature sends the
    others to -inf (softmax: all mass on the top token) instead of inf - inf = NaN."""
    if not torch.isfinite(logits).all():
        raise ValueError("logits are not finite (NaN or infinity): cannot sample")
    shifted = logits.double() - logits.max()  # fp64: 1e-300 is 0 in fp32 (0 / 0 = NaN)
    return (shifted / temperature).float()


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """Pick one token from ``logits [vocab]`` (fp32, CPU)."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(scaled(logits, params.temperature), dim=-1)
    probs = top_p_filter(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Row-wise ``sample_token`` over ``logits [batch, vocab]``; greedy rows in one op."""
    logits = logits.float().cpu()
    greedy = logits.argmax(dim=-1).tolist()
    return [
        greedy[i] if p.temperature == 0.0 else sample_token(logits[i], p, generators[i])
        for i, p in enumerate(params)
    ]
