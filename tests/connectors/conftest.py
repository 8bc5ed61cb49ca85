"""Fixtures for the connector tests: one tiny checkpoint per session, made offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmc.reference import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine spinning
    OpenMP threads slow them down many times over: run these tests on one thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
