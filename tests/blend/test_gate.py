"""The per-model quality gate: ``lmc blend-check`` writes a verdict, the connector obeys it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from lmc.blend.verdict import VERDICT_NAME, read_verdict
from lmc.cli import main
from lmc.connectors.reference.blend import BlendConnector
from lmc.reference import LLM
from tests.blend.helpers import LMC, rag_prompt, tokens

FAST = ["--num-prompts", "2", "--tokens", "4", "--ratios", "0,0.5,1"]


@pytest.fixture
def model(llama_dir: Path, tmp_path: Path) -> Path:
    """A private copy: verdicts are written next to its config.json."""
    return Path(shutil.copytree(llama_dir, tmp_path / "model"))


def _blend(model: Path) -> tuple[LLM, BlendConnector]:
    llm = LLM(model, num_blocks=96, lmc_config=LMC, blend=True)
    assert isinstance(llm.kv_connector, BlendConnector)
    return llm, llm.kv_connector


def test_a_passing_verdict_enables_blending(model: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["blend-check", "--model", str(model), *FAST, "--kl-max", "10",
               "--min-agreement", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verdict: PASS at recompute ratio 0.00" in out and "KL mean" in out
    verdict = read_verdict(model / VERDICT_NAME)
    assert verdict is not None and verdict.passed and verdict.ratio == 0.0
    assert [r.ratio for r in verdict.results] == [0.0, 0.5, 1.0]
    assert verdict.results[-1].kl_mean < 1e-6 and len(verdict.results[0].kv_deviation) == 4
    llm, conn = _blend(model)
    with llm:
        assert conn.blender is not None and conn.blender.ratio == 0.0
        ids, spans = rag_prompt([tokens(1, 30), tokens(2, 30)], tokens(3, 5))
        llm.generate(ids, max_tokens=1, segments=spans)
        assert conn.blender.stats.requests == 1


def test_a_failing_verdict_keeps_blending_off(model: Path, capsys: pytest.CaptureFixture,
                                              caplog: pytest.LogCaptureFixture) -> None:
    rc = main(["blend-check", "--model", str(model), *FAST, "--kl-max", "0",
               "--min-agreement", "1", "--ratios", "0,0.5"])
    assert rc == 1 and "verdict: FAIL" in capsys.readouterr().out
    ids, spans = rag_prompt([tokens(1, 30), tokens(2, 30)], tokens(3, 5))
    plain = LLM(model, num_blocks=96).generate(ids, max_tokens=3, ignore_eos=True)[0]
    with caplog.at_level(logging.INFO, logger="lmc.connectors.reference.blend"):
        llm, conn = _blend(model)
    assert conn.blender is None and "blending off" in caplog.text and "failed" in caplog.text
    with llm:  # the segments are computed as plain prompt tokens: the same output
        out = llm.generate(ids, max_tokens=3, ignore_eos=True, segments=spans)[0]
    assert out.token_ids == plain.token_ids
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmc.connectors.reference.blend"):
        forced = LLM(model, num_blocks=96, lmc_config=LMC, blend={"override": True})
    assert forced.kv_connector.blender is not None and "forced on" in caplog.text
    forced.close()


def test_verdicts_for_other_weights_or_dtypes_or_garbage_are_not_trusted(
        model: Path, qwen_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    main(["blend-check", "--model", str(model), *FAST, "--kl-max", "10", "--min-agreement", "0"])
    raw = json.loads((model / VERDICT_NAME).read_text())
    cases = {
        "is for": {**raw, "model_id": "other@0000"},
        "bfloat16": {**raw, "dtype": "bfloat16"},
        "unreadable": {**raw, "format": 99},
    }
    for why, doc in cases.items():
        (model / VERDICT_NAME).write_text(json.dumps(doc))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lmc.connectors.reference.blend"):
            llm, conn = _blend(model)
        llm.close()
        assert conn.blender is None and why in caplog.text, (why, caplog.text)
    (model / VERDICT_NAME).write_bytes(b"\xff\x00not json")
    llm, conn = _blend(model)
    llm.close()
    assert conn.blender is None
    # a verdict copied next to another checkpoint does not vouch for it
    qwen = Path(shutil.copytree(qwen_dir, model.parent / "qwen"))
    (qwen / VERDICT_NAME).write_text(json.dumps(raw))
    llm, conn = _blend(qwen)
    llm.close()
    assert conn.blender is None


def test_bad_inputs_are_named(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
                              ) -> None:
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"pieces": ["a doc", "q"]}\n{"pieces": "nope"}\n')
    cases = [
        (["--model", str(tmp_path / "none")], "no config.json"),
        (["--model", str(model), "--prompts", str(bad)], "prompts.jsonl:2"),
        (["--model", str(model), "--prompts", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
    ]
    for args, msg in cases:
        assert main(["blend-check", *args]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as e:
        main(["blend-check", "--model", str(model), "--ratios", "0.1,nan"])
    assert e.value.code == 2 and "ratios are numbers in [0, 1]" in capsys.readouterr().err
