"""The hit-rate funnel and cache hints through real vLLM 0.32 (CPU) with lmc's connector: the
funnel's "used by the engine" equals the sum of vLLM's own ``num_cached_tokens`` over
requests that hit vLLM's prefix cache, lmc's and neither; a request's ``kv_transfer_params``
hints pin its chain. Runs ``funnel_vllm.py`` in the vLLM venv (``LMC_VLLM_PYTHON``); skipped
without vLLM (failed under ``CI=true``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmc.reference import make_tiny_checkpoint
from tests.connectors.vllm.test_vllm_integration import _env, _run, _vllm_python

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parent / "funnel_vllm.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    py = _vllm_python()
    work = tmp_path_factory.mktemp("vllm-funnel")
    model = make_tiny_checkpoint(work / "tiny", max_position_embeddings=4096)
    out = work / "out.json"
    _run([py, str(SCRIPT), "--model", str(model), "--out", str(out)], work / "run.log",
         _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    return json.loads(out.read_text())


def test_the_funnel_and_vllms_cached_tokens_agree(run):
    cached, f = run["cached"], run["funnel"]
    assert cached[0] == 0 and cached[1] >= 768 and cached[2] == 0, cached
    assert f["used"] == sum(cached), (f, cached)  # the engine's own count, request by request
    assert f.get("local", 0) >= cached[1]  # vLLM's own prefix cache, counted as such
    assert f["prompt"] >= f["best"] >= f["found"] >= run["pinned_after"]
    assert f.get("miss.capacity", 0) >= 512  # OTHER, evicted by the traffic


def test_kv_transfer_params_hints_keep_the_session_through_other_traffic(run):
    """The hinted prompt's chunks were pinned in lmc's L1 (its worker is another process
    here: seen through what the next request finds); the unhinted one was evicted."""
    assert run["pinned_after"] >= 768, run
    assert run["unpinned_after"] == 0, run
