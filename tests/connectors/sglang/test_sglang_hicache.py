"""LMCHiCacheStorage through SGLang 0.5.23's own HiCache controller (threads, prefetch and
backup queues, host pool, layer-done counter): a producer stores, a restarted engine loads
bit-exact on every layer; layer_first and page_first; zero-copy v1 and generic paths; SGLang's
random storage faults and a dead Redis or lmc:// server tier give fewer hits, never a crash,
hang, leaked lock or wrong KV; pages still queued for the disk when SGLang detaches the backend
are written by ``close()`` (a restarted engine finds them). Runs
``sglang_scripts/sglang_hicache_flow.py --all`` in the SGLang venv.

Threat model: ``docs/threats/tiers.md``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang_scripts"))
from runner import run_script  # noqa: E402

pytestmark = pytest.mark.integration


def test_hicache_storage_through_sglang_controller():
    out = run_script("sglang_hicache_flow.py", "--all").stdout
    for scenario in ("layer_first v1 fault=none", "page_first v1 fault=none",
                     "layer_first generic fault=none", "page_first generic fault=none",
                     "page_first v1 fault=random", "layer_first v1 fault=dead-remote",
                     "page_first v1 fault=dead-daemon", "layer_first v1 fault=slow-disk"):
        assert f"PASS {scenario}:" in out, f"{scenario} did not pass:\n{out[-4000:]}"
    for scenario in ("fault=none", "dead-remote", "dead-daemon", "slow-disk"):
        lines = [x for x in out.splitlines() if x.startswith("PASS") and scenario in x]
        assert lines and all("24 tokens loaded" in x for x in lines), lines  # all from disk
    # close() drained pages that were still queued for the disk when SGLang detached
    assert "close(): 0 of 6 pages were on disk at detach, 6 after" in out, out[-4000:]


def test_hicache_storage_refuses_what_an_attacker_hands_it():
    """Unmapped slots, a foreign dtype and a rewritten stored page, against SGLang's real host
    pools (``sglang_scripts/sglang_hicache_attacks.py``; threat model:
    ``docs/threats/tiers.md``)."""
    out = run_script("sglang_hicache_attacks.py").stdout
    for check in ("unmapped slot:", "linker: pages with an unmapped", "foreign dtype:", "rewritten page (shape):",
                  "rewritten page (dtype):"):
        assert any(line.startswith(f"PASS {check}") for line in out.splitlines()), \
            f"{check} did not pass:\n{out[-4000:]}"
