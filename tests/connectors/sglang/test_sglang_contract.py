"""lmc's SGLang plug-ins against SGLang 0.5.23's real classes, with no patches (run in the
SGLang venv: ``sglang_scripts/sglang_contract.py``; see ``sglang_scripts/runner.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang_scripts"))
from runner import run_script  # noqa: E402

pytestmark = pytest.mark.integration

CHECKS = (
    "page-hash twin:",
    "storage class: concrete subclass",
    *(f"{k} {lay}: batch_set_v1" for k in ("mha", "mla")
      for lay in ("layer_first", "page_first", "page_first_direct")),
    "cross-layout:",
    "namespaces:",
    "identity:",
    "refusals:",
    "errors on the data path",
    "linker: concrete UnifiedCacheLinker",
    "linker refusals:",
)


def test_contract_against_real_sglang_classes():
    out = run_script("sglang_contract.py").stdout
    passed = [line for line in out.splitlines() if line.startswith("PASS ")]
    for check in CHECKS:
        assert any(line[5:].startswith(check) for line in passed), f"missing: {check}\n{out}"
