"""LMCCacheLinker through SGLang 0.5.23's own external-linker wiring (``create_tree_cache``,
the dynamic linker factory, the layer counter on the KV pool and worker, the scheduler's
per-batch calls): offload then a restarted engine's layer-wise load, bit-exact and each layer
in place when ``wait_until`` returns, overlapped with compute; a failed layer aborts the
request; cancel, reset and close under load; a dead Redis or lmc:// server tier; no node left
locked after any prefill; ``close()`` drains offloads still queued for the disk. Runs
``sglang_scripts/sglang_linker_flow.py`` in the SGLang venv."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang_scripts"))
from runner import run_script  # noqa: E402

pytestmark = pytest.mark.integration


def test_linker_through_sglang_wiring():
    out = run_script("sglang_linker_flow.py").stdout
    for check in ("save:", "load:", "failure at layer", "cancel:",
                  "dead remote tier (Redis, lmc daemon):", "cross-engine:"):
        assert any(x.startswith(f"PASS {check}") for x in out.splitlines()), \
            f"{check} did not pass:\n{out[-4000:]}"
    assert "0 on disk when close() began, all 8 after" in out, out[-4000:]
