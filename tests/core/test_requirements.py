"""tests/requirements.py: the one helper for what a test needs from the machine. A missing
piece skips naming it; under CI=true (where .ci/run installs everything) it fails instead of
letting the suite pass with the test unseen."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.requirements import missing, under_ci

TESTS = Path(__file__).resolve().parents[1]
# tests/storage/backends/p2p/conftest.py belongs to another change in flight; it is to call missing() too
NOT_YET: set[str] = set()


def test_a_missing_piece_skips_naming_it(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert not under_ci()
    with pytest.raises(pytest.skip.Exception, match="redis-server not installed"):
        missing("redis-server not installed")


@pytest.mark.parametrize("ci", ["true", "True", "TRUE"])
def test_a_missing_piece_fails_under_ci(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="redis-server not installed.*CI=true"):
        missing("redis-server not installed")


@pytest.mark.parametrize("ci", ["", "false", "0"])
def test_other_values_of_ci_skip(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception):
        missing("nixl")


def test_no_test_reads_ci_itself():
    """Every CI-aware skip goes through tests/requirements.py (a second copy drifts: one
    compared CI to "true", another took any value, a third skipped even under CI)."""
    reads = re.compile(r"""environ(\.get\(|\[)\s*["']CI["']""")
    found = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py")
                   if reads.search(p.read_text(errors="replace")))
    assert set(found) - NOT_YET == {"requirements.py"}, found
