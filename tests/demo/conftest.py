"""The demo's tests use the connector tests' fixtures: the tiny checkpoint and one torch
thread (the demo runs the reference engine with lmc's connector)."""

from tests.connectors.conftest import _one_torch_thread, tiny_dir

__all__ = ["_one_torch_thread", "tiny_dir"]
