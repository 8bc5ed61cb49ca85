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
def salted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    py = _vllm_python()
    work = tmp_path_factory.mktemp("vllm-salted")
    model = make_tiny_checkpoint(work / "tiny", max_position_embeddings=4096)
    out = work / "salted.json"
    _run([py, str(SCRIPT), "--model", str(model), "--out", str(out)], work / "salted.log",
         _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    return json.loads(out.read_text())


def test_salted_outputs_equal_vllm_without_lmc(salted):
    base = salted["baseline"]
    for name, r in salted["runs"].items():
        assert r["tokens"] == base[r["salt"] or ""]["tokens"], name


def test_a_salt_hits_only_its_own_kv(salted):
    runs = salted["runs"]
    assert runs["A_store"]["cached"] == 0
    assert runs["B_probe"]["cached"] == 0, "salt B was served salt A's KV"
    assert runs["none_probe"]["cached"] == 0, "an unsalted request was served salted KV"
    # each probe's prefill saved its own chunks: now every salt (and none) hits its own
    for name in ("A_hit", "B_hit", "none_hit"):
        assert runs[name]["cached"] >= 512, f"{name}: the same salt must hit"
