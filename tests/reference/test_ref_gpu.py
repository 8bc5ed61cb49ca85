"""CUDA parity for the reference engine (skipped where no CUDA device is present)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmc.reference import LLM
from tests.reference.prompts import random_prompt
from tests.reference.ref_connector import InMemoryConnector

pytestmark = pytest.mark.gpu

PROMPTS = [random_prompt(40, 50), random_prompt(41, 7), random_prompt(42, 90)]


def _run(llm: LLM):
    return llm.generate(PROMPTS, max_tokens=8, ignore_eos=True, return_logits=True)


def test_cuda_fp32_matches_cpu(tiny_dir: Path) -> None:
    cpu = _run(LLM(tiny_dir, num_blocks=64))
    gpu = _run(LLM(tiny_dir, num_blocks=64, device="cuda"))
    for c, g in zip(cpu, gpu, strict=True):
        # TF32 is off by default for matmuls in torch, so fp32 stays close.
        torch.testing.assert_close(g.logits[0], c.logits[0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_half_precision_with_connector(tiny_dir: Path, dtype: str) -> None:
    conn = InMemoryConnector(16)
    llm = LLM(tiny_dir, num_blocks=64, device="cuda", dtype=dtype, kv_connector=conn)
    assert llm.kv_caches[0].is_cuda and llm.kv_caches[0].dtype == getattr(torch, dtype)
    first = _run(llm)
    second = _run(llm)
    assert [o.num_cached_tokens for o in second] == [48, 0, 80]
    for a, b in zip(first, second, strict=True):
        assert torch.isfinite(b.logits).all()
        assert (a.logits[0] - b.logits[0]).abs().max() < 0.1
