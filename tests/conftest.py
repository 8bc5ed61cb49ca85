"""Shared fixtures; ``gpu`` tests run only where CUDA is present (the reason is printed).

Every test runs with pool invariants on (``LMC_DEBUG_INVARIANTS=1``, see
:mod:`lmc.invariants`): a view at the wrong address, overlapping blocks, or a pool closed (or
an object collected) with references still held fails the test during which it happened.
A test that leaks on purpose says so with ``@pytest.mark.leaks_expected``.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("LMC_DEBUG_INVARIANTS", "1")  # before any pool exists

import pytest  # noqa: E402
import torch  # noqa: E402

from lmc import invariants  # noqa: E402

pytest_plugins = ["pytester"]  # tests/core/test_memory.py runs the harness on a leaking test


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "leaks_expected: the test leaks pool references on purpose (not a failure)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _pool_invariants(request):
    """Fail the test whose run broke a pool invariant (including in threads it started)."""
    invariants.take()  # what earlier code left (imports, session fixtures) is not this test's
    made = invariants.pools_checked
    yield
    if invariants.pools_checked != made:
        gc.collect()  # objects dropped while referenced are reported when collected
    found = invariants.take()
    if found and request.node.get_closest_marker("leaks_expected") is None:
        pytest.fail(f"{len(found)} pool invariant violation(s):\n\n" + "\n\n".join(found),
                    pytrace=False)
