"""Shared helpers: prompts, engines with and without lmc, and the equality check.

Tolerance: greedy tokens must be identical, and fp32 logits within ``atol = rtol = 2e-5``
(logits have std ~4). A warm run computes only the uncached suffix, so attention sums in a
different order than the cold run; that is the whole difference, measured at <= 1e-5.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from lmc.connectors.reference import LMCReferenceConnector
from lmc.reference import LLM, RequestOutput
from tests import late_transfer

ATOL = RTOL = 2e-5
BLOCK = 16


def prompt(seed: int, length: int, vocab: int = 2048) -> list[int]:
    """Token ids starting with BOS (0), never EOS (1)."""
    rng = random.Random(seed)
    return [0] + [rng.randrange(2, vocab) for _ in range(length - 1)]


def lmc_llm(model_dir: Path, chunk_size: int = 32, local_cpu_size: str = "32MiB",
            connector_kw: dict[str, Any] | None = None, **engine_kw: Any
            ) -> tuple[LLM, LMCReferenceConnector]:
    cfg = {"chunk_size": chunk_size, "local_cpu_size": local_cpu_size}
    conn = LMCReferenceConnector(cfg, model_dir=model_dir, **(connector_kw or {}))
    engine_kw.setdefault("num_blocks", 128)
    engine_kw.setdefault("block_size", BLOCK)
    llm = LLM(model_dir, kv_connector=conn, **engine_kw)
    if late_transfer.ACTIVE is not None:  # late copies: freed blocks are poisoned too
        late_transfer.poison_freed_blocks(llm.block_manager, llm.kv_caches,
                                          late_transfer.ACTIVE)
    return llm, conn


def plain_llm(model_dir: Path, **engine_kw: Any) -> LLM:
    engine_kw.setdefault("num_blocks", 128)
    engine_kw.setdefault("block_size", BLOCK)
    return LLM(model_dir, **engine_kw)


def run(llm: LLM, prompts: list[list[int]], max_tokens: int = 6) -> list[RequestOutput]:
    return llm.generate(prompts, max_tokens=max_tokens, ignore_eos=True, return_logits=True)


def assert_same(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids, f"request {g.request_id}: tokens differ"
        torch.testing.assert_close(g.logits, w.logits, atol=ATOL, rtol=RTOL)


def stat(conn: LMCReferenceConnector, key: str) -> float:
    return conn.stats().get(key, 0)
