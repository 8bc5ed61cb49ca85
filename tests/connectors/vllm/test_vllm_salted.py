"""Salted requests through real vLLM 0.32 (CPU) with lmc's connector: the output with lmc
equals vLLM's without it, a salt hits only KV stored under the same salt, and two salts (or a
salt and none) never share. Runs ``salted_vllm.py`` in the vLLM venv (``LMC_VLLM_PYTHON``),
as ``test_vllm_integration.py`` does; skipped without vLLM (failed under ``CI=true``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmc.reference import make_tiny_checkpoint
from tests.connectors.vllm.test_vllm_integration import _env, _run, _vllm_python

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parent / "salted_vllm.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Both modes: one process (with the plain vLLM's reference tokens), then the default
    multi-process engine (tags over the lookup socket)."""
    py = _vllm_python()
    work = tmp_path_factory.mktemp("vllm-salted")
    model = make_tiny_checkpoint(work / "tiny", max_position_embeddings=4096)
    got = {}
    for mode, env in (("mp0", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}), ("mp1", {})):
        out = work / f"{mode}.json"
        _run([py, str(SCRIPT), "--mode", mode, "--model", str(model), "--out", str(out)],
             work / f"{mode}.log", _env(**env))
        got[mode] = json.loads(out.read_text())
    return got


@pytest.mark.parametrize("mode", ["mp0", "mp1"])
def test_salted_outputs_equal_vllm_without_lmc(runs, mode):
    base = runs["mp0"]["baseline"]
    for name, r in runs[mode]["runs"].items():
        assert r["tokens"] == base[r["salt"] or ""]["tokens"], name


@pytest.mark.parametrize("mode", ["mp0", "mp1"])
def test_a_salt_hits_only_its_own_kv(runs, mode):
    runs = runs[mode]["runs"]
    assert runs["A_store"]["cached"] == 0
    assert runs["B_probe"]["cached"] == 0, "salt B was served salt A's KV"
    assert runs["none_probe"]["cached"] == 0, "an unsalted request was served salted KV"
    # each probe's prefill saved its own chunks: now every salt (and none) hits its own
    for name in ("A_hit", "B_hit", "none_hit"):
        assert runs[name]["cached"] >= 512, f"{name}: the same salt must hit"
