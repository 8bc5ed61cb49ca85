"""Fixtures for the connector tests: one tiny checkpoint per session, made offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmc.reference import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama")
