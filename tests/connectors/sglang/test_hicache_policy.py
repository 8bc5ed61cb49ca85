"""LMCHiCacheStorage's hit count is the load policy's (issue 23), through SGLang 0.5.23's own
HiCache controller on CPU: with a disk slower than the engine's prefill (a real disk tier
behind lmc's ``rate_limit`` wrapper, its speed measured from SGLang's own reads), SGLang is
told only the pages in lmc's L1 (0 when none is), and never reads the others; with a fast
disk, no prefill prior (one INFO line naming the setting) or ``load_policy: load_all``, every
held page; what is loaded is bit-exact on every layer. Runs
``hicache_policy_flow.py`` in the SGLang venv (see ``sglang_scripts/runner.py``).

A prefill prior that is not a rate is refused by name, with and without SGLang."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

from lmc.config import ConfigError
from lmc.connectors.sglang.pages import load_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang_scripts"))
from runner import run_script  # noqa: E402

FLOW = Path(__file__).resolve().parent / "hicache_policy_flow.py"  # absolute: runner's folder is not ours


@pytest.mark.integration
def test_batch_exists_answers_the_load_policys_count():
    out = run_script(str(FLOW)).stdout
    passed = {m.group(1): m.group(2) for m in re.finditer(r"^PASS (\w+): (.*)$", out, re.M)}
    assert passed.get("slow") == "B 3, A 2, C 0 pages", out[-4000:]  # L1 pages only / none
    for name in ("fast", "noprior", "loadall"):
        assert passed.get(name) == "B 3, A 6, C 3 pages", (name, out[-4000:])
    assert "refused" in passed, out[-4000:]


@pytest.mark.parametrize("bad", [0, -1, math.nan, "nan", math.inf, "-inf", True, 2.5, "fast"])
def test_a_prefill_prior_that_is_no_rate_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match=r"load_policy_priors\.prefill"):
        load_settings({"lmc.load_policy_priors": {"prefill": bad}})


def test_a_prefill_prior_is_kept_in_tokens_per_second():
    config, _ = load_settings({"lmc.load_policy_priors": {"prefill": 20000}})
    assert config.load_policy_priors == {"prefill": 20000.0}
