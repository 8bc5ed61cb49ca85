"""Blended vs full prefill on the same prompts: the figures the quality gate judges.

For each prompt (token ids and segment spans) and each recompute ratio, the prompt runs once
with plain full prefill and once blended, and we compare: each layer's K/V over the prompt
(``||KV_blend - KV_full|| / ||KV_full||``), the next-token distributions after the prompt
(``KL(full || blend)``, nats) and the first N greedy tokens (the fraction generated before
the first divergence). The KV is read from the request's blocks right after its prefill
step, so what is compared is exactly what decoding will attend to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmc.reference.engine import LLM
from lmc.reference.request import SamplingParams

Span = tuple[int, int]


@dataclass(frozen=True)
class Capture:
    """One prompt's run: next-token logits ``[vocab]``, K/V ``[layers, 2, tokens, heads,
    dim]`` (fp32) and the greedy tokens generated."""

    logits: torch.Tensor
    kv: torch.Tensor
    tokens: list[int]


@dataclass(frozen=True)
class Comparison:
    kv_deviation: list[float]  # per layer
    kl: float
    agreement: float


def run_prompt(llm: LLM, ids: Sequence[int], spans: Sequence[Span] | None, max_tokens: int
               ) -> Capture:
    """Run one prompt alone (greedy, EOS ignored) and capture its prefill's KV."""
    params = SamplingParams(max_tokens=max(2, max_tokens), ignore_eos=True, return_logits=True)
    rid = llm.add_request(list(ids), params, segments=list(spans) if spans else None)
    n = len(ids)
    kv = None
    outputs = []
    while True:
        outputs += [o for o in llm.step() if o.request_id == rid]
        request = llm.scheduler.requests.get(rid)
        if kv is None and request is not None and request.num_computed_tokens >= n:
            kv = read_kv(llm, request.block_ids, n)
        if outputs:
            break
    error = llm.pop_error(rid)
    if error is not None or kv is None:
        raise RuntimeError(f"prompt run failed: {error or 'its prefill was not captured'}")
    out = outputs[0]
    assert out.logits is not None
    return Capture(out.logits[0].float(), kv, out.token_ids[:max_tokens])


def read_kv(llm: LLM, block_ids: Sequence[int], n: int) -> torch.Tensor:
    """K/V of positions ``[0, n)`` from a request's blocks, ``[layers, 2, n, heads, dim]``."""
    bs = llm.block_size
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    pos = torch.arange(n)
    slots = (table[pos // bs] * bs + pos % bs).to(llm.device)
    layers = []
    for kv in llm.kv_caches:
        _, _, _, heads, dim = kv.shape
        layers.append(torch.stack([kv[i].view(-1, heads, dim).index_select(0, slots).float()
                                   for i in (0, 1)]))
    return torch.stack(layers).cpu()


def compare(full: Capture, blend: Capture) -> Comparison:
    dims = tuple(range(1, full.kv.dim()))
    err = (blend.kv - full.kv).pow(2).sum(dim=dims).sqrt()
    ref = full.kv.pow(2).sum(dim=dims).sqrt().clamp_min(1e-30)
    logp = F.log_softmax(full.logits, dim=-1)
    logq = F.log_softmax(blend.logits, dim=-1)
    kl = float((logp.exp() * (logp - logq)).sum().clamp_min(0.0))
    n = len(full.tokens)
    same = next((i for i, (a, b) in enumerate(zip(full.tokens, blend.tokens, strict=True))
                 if a != b), n)
    return Comparison((err / ref).tolist(), kl, same / n if n else 1.0)
