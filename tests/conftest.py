"""Shared fixtures; ``gpu`` tests run only where CUDA is present (the reason is printed).

Every test runs with pool invariants on (``LMC_DEBUG_INVARIANTS=1``, see
:mod:`lmc.memory.invariants`): a view at the wrong address, overlapping blocks, or a pool closed (or
an object collected) with references still held fails the test during which it happened.
A test that leaks on purpose says so with ``@pytest.mark.leaks_expected``.
"""

from __future__ import annotations

import gc
import os
import signal

os.environ.setdefault("LMC_DEBUG_INVARIANTS", "1")  # before any pool exists

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from lmc.memory import invariants  # noqa: E402

# Hypothesis: no deadline (a loaded CI machine is slow), failing examples printed with their
# reproduce blob. LMC_HYPOTHESIS_PROFILE=long runs the model-based tests (tests/core/
# test_model_*.py, which scale their own budgets from it) longer and shrinks their failures.
settings.register_profile("lmc", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", settings.get_profile("lmc"), max_examples=1000)
settings.load_profile(os.environ.get("LMC_HYPOTHESIS_PROFILE", "lmc"))

pytest_plugins = ["pytester"]  # tests/memory/test_memory.py runs the harness on a leaking test


def pytest_configure(config):
    # Ctrl-C tests (lmc server, lmc stats --watch, the demo, lmc replay) send SIGINT to lmc
    # and expect a terminal's disposition. A run started in the background (`cmd &`, nohup)
    # inherits SIGINT ignored, and every child would inherit that too: restore the default.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line(
        "markers", "leaks_expected: the test leaks pool references on purpose (not a failure)")


def pytest_collection_finish(session):
    """Freeze what exists once the tests are collected (torch, hypothesis, the test modules:
    ~1M objects) into the collector's permanent generation, once per process: the full
    ``gc.collect()`` after each pool-making test then walks only what the tests made since,
    which halves the unit files' wall time. Frozen objects are still freed by reference
    counting; only cycles among them are never collected (none of them holds a pool: no test
    has run yet)."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


# The slowest files (wall seconds each in a full run, 2026-12-04), run first: `make test`
# hands whole files to two workers (pytest-xdist, --dist loadfile) in collection order, and a
# 7-minute file picked up last would leave one worker idle at the end.
SLOWEST_FIRST = (
    "tests/connectors/vllm/test_vllm_integration.py",
    "tests/blend/test_selective_recompute.py",
    "tests/cli/test_cli_demo.py",
    "tests/storage/backends/test_contract_codec.py",
    "tests/test_readme_examples.py",
    "tests/thirdparty/test_thirdparty_tier.py",
    "tests/reference/test_ref_engine.py",
    "tests/core/test_gpu_check.py",
    "tests/connectors/vllm/test_vllm_real_model.py",
    "tests/storage/backends/mooncake/test_mooncake_faults.py",
    "tests/cli/test_cli_inputs.py",
    "tests/test_readme.py",
    "tests/cli/test_cli_plain_install.py",
    "tests/storage/backends/mooncake/test_contract_mooncake.py",
    "tests/cli/test_bench_runner.py",
    "tests/connectors/vllm/test_vllm_salted.py",
    "tests/connectors/vllm/test_vllm_hybrid.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_between_tests: list[str] = []  # violations recorded outside any test (fixtures, stray threads)


@pytest.fixture(autouse=True)
def _pool_invariants(request):
    """Fail the test whose run broke a pool invariant (including in threads it started)."""
    _between_tests.extend(invariants.take())  # not this test's: reported at session end
    made = invariants.pools_checked
    yield
    if invariants.pools_checked != made:
        gc.collect()  # objects dropped while referenced are reported when collected
    found = invariants.take()
    if found and request.node.get_closest_marker("leaks_expected") is None:
        pytest.fail(f"{len(found)} pool invariant violation(s):\n\n" + "\n\n".join(found),
                    pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    """Violations no test owned (a fixture's teardown, a thread outliving its test) still
    fail the run, instead of being dropped at the next test's start."""
    found = _between_tests + invariants.take()
    if found:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_sep("=", f"{len(found)} pool invariant violation(s) outside any test",
                         red=True)
            tr.write_line("\n\n".join(found))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
