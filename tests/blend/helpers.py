"""Shared pieces of the blending tests: RAG-shaped prompts, engines, a naive concatenation."""

from __future__ import annotations

from pathlib import Path

import torch

from lmc.blend.rope_shift import KeyShifter
from lmc.reference import LLM
from lmc.reference.attention import (
    AttentionMetadata,
    PrefillSlice,
    SequenceChunk,
    build_attention_metadata,
    slots_for_positions,
)
from lmc.reference.kv_cache import allocate_kv_caches
from lmc.reference.loader import load_model

LMC = {"chunk_size": 16, "local_cpu_size": "32MiB"}


def tokens(seed: int, n: int, vocab: int = 512) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rag_prompt(parts: list[list[int]], question: list[int], system: list[int] | None = None
               ) -> tuple[list[int], list[tuple[int, int]]]:
    """``system + parts... + question``, the parts marked as segments."""
    ids = list(system or [])
    spans = []
    for p in parts:
        spans.append((len(ids), len(ids) + len(p)))
        ids += p
    return ids + question, spans


def blend_llm(model_dir: Path, ratio: float, **kw) -> LLM:
    return LLM(model_dir, num_blocks=96, lmc_config=dict(LMC, **kw.pop("lmc", {})),
               blend={"override": True, "ratio": ratio}, **kw)


@torch.no_grad()
def naive_concatenation_logits(model_dir: Path, ids: list[int], spans: list[tuple[int, int]]
                               ) -> torch.Tensor:
    """The last position's logits when every segment's K/V is its own, computed alone and
    rotated into place, and only the other tokens are computed (in position order)."""
    model = load_model(model_dir, "float32", torch.device("cpu"))
    bs, n = 16, len(ids)
    caches = allocate_kv_caches(model.config, -(-n // bs) + 1, bs, torch.float32,
                                torch.device("cpu"))
    table = torch.arange(len(caches[0][0]))
    shifter = KeyShifter(model.config)
    for s, e in spans:  # each segment alone at 0..len-1, written where it sits, then placed
        slots = slots_for_positions(table, torch.arange(s, e), bs)
        meta = AttentionMetadata(slots, [PrefillSlice(0, e - s, slots, None)], None, None, None,
                                 e - s)
        model(torch.tensor(ids[s:e]), torch.arange(e - s), caches, meta)
        for kv in caches:
            rows = kv[0].view(-1, *kv.shape[3:])
            rows[slots] = shifter.shift(rows[slots], s)
    cached = {p for s, e in spans for p in range(s, e)}
    pos = 0
    hidden = None
    while pos < n:  # runs of uncached tokens, each over everything before it
        if pos in cached:
            pos += 1
            continue
        end = pos
        while end < n and end not in cached:
            end += 1
        meta = build_attention_metadata([SequenceChunk(pos, end - pos, table.tolist())], bs, "cpu")
        hidden = model(torch.tensor(ids[pos:end]), torch.arange(pos, end), caches, meta)
        pos = end
    assert hidden is not None
    return model.compute_logits(hidden[-1:])[0]
