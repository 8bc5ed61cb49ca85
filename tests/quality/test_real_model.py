"""The harness on the real model (SmolLM2-135M-Instruct, fp32): quality is judged on trained
weights, where a lossy feature's effect on answers means something (random weights have no
attention structure to keep: tests/blend/test_gate.py only forces verdicts there)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lmc.cli import main
from lmc.connectors.reference.blend import BlendConnector
from lmc.quality.cast import CastFeature
from lmc.quality.check import run_quality
from lmc.quality.docqa import bundled_docqa
from lmc.reference import LLM
from tests.real_model import real_model_dir


@pytest.fixture(scope="module")
def model() -> Path:
    return real_model_dir("fp32")


def test_every_bundled_question_is_answered_right_from_exact_kv(model: Path) -> None:
    """The set's promise (docs/quality.md): each question kept is one this model answers
    correctly with exact KV; and bfloat16 rounding of its KV keeps every answer."""
    [v] = run_quality(model, CastFeature(), ["bfloat16"], text=None)
    m = v.measurement
    assert m.questions == len(bundled_docqa().questions) >= 12
    assert m.qa_correct_exact == m.questions, m
    assert v.passed and m.qa_identical == 1.0 and m.kl_mean < 1e-3, m


def test_lmc_quality_judges_blending_and_the_connector_obeys(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    """Ratio 0 (no token recomputed) fails on the text's perplexity (measured +7.5% against
    a +1% bound), ratio 1 equals full prefill; the gate then blends only where asked for a
    ratio a passing verdict covers. The answers get the default 20 tokens, the length the
    bundled set's promise is made at: 12 cut both first answers before their fact ("...by the
    astronomer Edith C", "...was built in 191"), so none counted as correct."""
    verdicts = tmp_path / "v"
    rc = main(["quality", "--model", str(model), "--feature", "blend", "--settings", "0,1",
               "--questions", "2", "--verdicts", str(verdicts), "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 1 and "verdict: blend FAIL (passed only at 1)" in out, out
    zero = json.loads((verdicts / "blend@0@float32.json").read_text())
    full = json.loads((verdicts / "blend@1@float32.json").read_text())
    assert not zero["passed"] and any(f.startswith("perplexity") for f in zero["failed"])
    assert zero["measurement"]["ppl_change"] > 0.03
    assert full["passed"] and full["measurement"]["kl_mean"] < 1e-4
    assert full["measurement"]["qa_identical"] == 1.0
    assert full["measurement"]["qa_correct_exact"] == 2
    assert zero["model_id"] == full["model_id"] and zero["model_id"].startswith(model.name)
    lmc = {"chunk_size": 256, "local_cpu_size": "64MiB"}
    for blend, on in (({}, False), ({"ratio": 0.5}, False), ({"ratio": 1.0}, True)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lmc.connectors.reference.blend"):
            llm = LLM(model, num_blocks=64, lmc_config=lmc,
                      blend={"verdicts": str(verdicts), **blend})
        conn = llm.kv_connector
        llm.close()
        assert isinstance(conn, BlendConnector)
        assert (conn.blender is not None) == on, (blend, caplog.text)
