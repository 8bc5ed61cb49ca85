"""The P2P tier attacked by a peer of the reader's own namespace (another tenant cannot even
reach it: ``test_p2p_tenants.py``): forged and unkeyed advertisements, READs outside the
export window, records lying about their size, bytes overwritten in an owner's window,
metadata naming another agent. Each runs in
a child process (``attack_proc.py``: NIXL never runs in pytest's process).
Threat model: ``docs/threats/p2p.md``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.server.daemon_proc import ROOT, DaemonProc

from .conftest import require_nixl

pytestmark = pytest.mark.integration


def _attack(tmp_path, scenario: str) -> dict:
    require_nixl()
    d = DaemonProc(tmp_path / "d", ["--size", "8MiB"]).start()
    try:
        out = subprocess.run([sys.executable, "-m", "tests.storage.backends.p2p.attack_proc", scenario,
                              f"p2p+lmc://127.0.0.1:{d.info['port']}?ns=attack",
                              str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                             timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT),
                                               "NIXL_LOG_LEVEL": "ERROR"})
    finally:
        d.kill()
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("@lmc ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][5:])


def test_forged_and_unkeyed_records_are_never_served(tmp_path):
    """Against a keyed reader, every lie is a counted miss the first time and dropped: the
    next read is served by the honest owner (or is a miss where only the liar holds the
    key), and after three failures the liar is skipped altogether; an unkeyed reader refuses
    a tagged record the same way."""
    r = _attack(tmp_path, "forged")
    assert r["first"] == ["miss"] * 4, r
    assert r["second"] == ["exact", "exact", "exact", "miss"], r
    assert r["contains_after"] == [True, True, True, False], r
    assert r["plain_reads_tagged"] == "miss", r
    # the fourth lie is not even read: three failures made the liar skipped
    assert r["stats"]["verify_failures"] == 3 and r["stats"]["distrusted"] == 3, r
    assert r["liar_skipped"] == "exact" and r["stats"]["distrusted_agents"] == 1, r


def test_forged_chunks_in_grouped_pulls_are_misses(tmp_path):
    """Pulls READ in groups, each group verified as it lands while the next moves: a liar's
    records inside a six-key get are misses, the honest owner's chunks exact, none wrong."""
    r = _attack(tmp_path, "grouped")
    assert r["groups"] == [1, 1, 1, 1], r
    assert r["got"] == ["exact", "miss", "exact", "miss", "exact", "exact"], r
    assert r["stats"]["verify_failures"] == 2, r


def test_reads_outside_the_export_window_are_refused(tmp_path):
    """The owner's published metadata covers its export window (64 KiB here) and version
    table only: its pool, and any span crossing the window's ends, cannot be READ."""
    r = _attack(tmp_path, "window")
    assert r["window_size"] == 64 << 10 and r["pool_size"] == 4 << 20, r
    assert r["window"] == r["window_end"] == "read", r
    for span in ("across_end", "before", "pool_start", "pool_middle"):
        assert r[span] == "refused", (span, r)
    assert r["served"] == "exact", r


def test_a_lying_record_size_evicts_nothing(tmp_path):
    """Records of another geometry (~30 MiB) or of more tokens than a chunk are refused
    before any allocation: the reader's 120 cached prompts all stay in L1 (before the fix
    the ~30 MiB allocation evicted every one L1 could let go, and still failed)."""
    r = _attack(tmp_path, "lying_size")
    assert r["before"] == 120 and r["after"] == 120, r
    assert r["loads"] == [0, 0, 0] and r["refused"] == 3, r


def test_bytes_overwritten_in_an_owners_window_are_never_served(tmp_path):
    """A peer WRITEs junk over an owner's exported chunk: even a reader without a secret
    misses it (the checksum it checks is the owner's, kept by the directory), never WRONG."""
    r = _attack(tmp_path, "overwrite")
    assert r == {"write": "DONE", "read": "miss", "verify_failures": 1}, r


def test_metadata_naming_another_agent_is_refused(tmp_path):
    r = _attack(tmp_path, "renamed")
    assert r == {"honest_before": "exact", "impostor_loaded": False,
                 "honest_after": "exact"}, r
