"""Tiny random-weight checkpoints (plain RoPE, Llama 3 scaling, Qwen2), made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmc.reference import make_tiny_checkpoint

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", hidden=128,
                                layers=4, heads=4, kv_heads=2, vocab=512)


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama3", seed=3, hidden=128,
                                layers=4, heads=4, kv_heads=2, vocab=512,
                                rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2", model_type="qwen2",
                                seed=1, hidden=128, layers=4, heads=4, kv_heads=2, vocab=512)


@pytest.fixture(params=["llama", "llama3", "qwen2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue({"llama": "llama_dir", "llama3": "llama3_dir",
                                    "qwen2": "qwen_dir"}[request.param])
