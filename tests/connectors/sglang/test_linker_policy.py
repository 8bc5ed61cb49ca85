"""LMCCacheLinker's ``lookup`` is the load policy's count (issue 23), through SGLang 0.5.23's
own external-linker wiring on CPU: with a disk slower than the engine's prefill SGLang is
told of no page and none is read; with a fast disk, no prefill prior (one INFO line naming
the setting) or ``load_policy: load_all``, every page, each layer in the device pool
bit-exact when the attention's wait returns. Runs ``linker_policy_flow.py`` in the SGLang
venv (see ``sglang_scripts/runner.py``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang_scripts"))
from runner import run_script  # noqa: E402

FLOW = Path(__file__).resolve().parent / "linker_policy_flow.py"  # absolute: runner's folder is not ours
pytestmark = pytest.mark.integration


def test_linker_lookup_answers_the_load_policys_count():
    out = run_script(str(FLOW)).stdout
    passed = {m.group(1): m.group(2) for m in re.finditer(r"^PASS (\w+): (.*)$", out, re.M)}
    assert passed.get("slow") == "0 of 8 pages loaded", out[-4000:]
    for name in ("fast", "noprior", "loadall"):
        assert passed.get(name) == "8 of 8 pages loaded", (name, out[-4000:])
