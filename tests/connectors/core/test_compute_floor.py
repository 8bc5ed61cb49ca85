"""The compute floor (lmc/connectors/core/compute_floor.py): the model's arithmetic from its
config and the device's matmul rate measured."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lmc.connectors.core.compute_floor import compute_floor, model_flops


def test_model_flops_count_projections_mlp_and_attention() -> None:
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128}
    per_token, attention = model_flops(cfg)
    q, kv = 64, 32  # 4 heads and 2 KV heads of 16
    assert per_token == 2 * 2 * (64 * (q + 2 * kv) + q * 64 + 3 * 64 * 128)
    assert attention == 2 * 2 * q
    assert model_flops({"hidden_size": 64}) is None  # a shape it cannot tell: no floor


def test_the_floor_of_a_checkpoint(tiny_dir: Path) -> None:
    """A rate per token and per attention unit from the checkpoint's config and a matmul
    timed on this device (how it compares with the forward is measured in
    benchmarks/bench_fresh_link.py, never asserted)."""
    cfg = json.loads((tiny_dir / "config.json").read_text())
    floor = compute_floor(cfg, torch.device("cpu"), torch.float32)
    assert floor is not None and floor.c0 == 0 and floor.c1 > 0 and floor.c2 > 0
    assert compute_floor({"hidden_size": 64}, torch.device("cpu"), torch.float32) is None
