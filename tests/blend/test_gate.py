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


def _fine_tuned(model: Path, where: Path) -> Path:
    """A copy under the same folder name whose weights differ in 256 KiB at 30% of
    model.safetensors (scaled: still valid float32 weights); its verdict file comes along."""
    import numpy as np

    dst = Path(shutil.copytree(model, where / model.name))
    path = dst / "model.safetensors"
    at = int(path.stat().st_size * 0.30) // 4 * 4
    with open(path, "r+b") as f:
        f.seek(at)
        region = np.frombuffer(f.read(256 << 10), dtype=np.float32) * np.float32(1.5)
        f.seek(at)
        f.write(region.tobytes())
    return dst


def test_a_verdict_for_the_original_does_not_pass_for_changed_weights(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 33: the sampled fingerprint (1 MiB at the start, middle and end of each file)
    gave the changed copy the original's identity, so the original's verdict passed the gate
    for it. The checkpoint is 13 MiB, so 30% lies outside every sample."""
    from lmc.reference import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "a" / "model")
    assert (model / "model.safetensors").stat().st_size > 8 << 20
    assert main(["blend-check", "--model", str(model), *FAST, "--kl-max", "10",
                 "--min-agreement", "0"]) == 0
    changed = _fine_tuned(model, tmp_path / "b")
    assert (changed / VERDICT_NAME).is_file()
    with caplog.at_level(logging.INFO, logger="lmc.connectors.reference.blend"):
        llm, conn = _blend(changed)
    llm.close()
    assert conn.blender is None and "is for" in caplog.text, caplog.text
    llm, conn = _blend(model)  # the original still passes
    llm.close()
    assert conn.blender is not None


def test_a_verdict_nested_200_kb_deep_is_no_verdict_never_a_crash(
        model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """docs/blending.md: "no verdict, never a crash" (the reader raised RecursionError out of
    register_kv_caches)."""
    (model / VERDICT_NAME).write_text("[" * 200_000)
    with caplog.at_level(logging.INFO, logger="lmc.connectors.reference.blend"):
        llm, conn = _blend(model)
    llm.close()
    assert conn.blender is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(model / VERDICT_NAME) in warnings[0]
    assert "nested deeper than 32 levels" in warnings[0]


SECRET = "s" * 32


def _signing_config(tmp_path: Path, secret: str = SECRET) -> Path:
    cfg = tmp_path / f"lmc-{secret[:4]}.yaml"
    cfg.write_text(f"integrity_secret: {secret}\n")
    return cfg


def _blend_with_secret(model: Path, secret: str | None = SECRET) -> tuple[LLM, BlendConnector]:
    cfg = dict(LMC, integrity_secret=secret) if secret else LMC
    llm = LLM(model, num_blocks=96, lmc_config=cfg, blend=True)
    return llm, llm.kv_connector


def test_with_a_secret_only_a_verdict_it_signed_enables_blending(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    """An edited verdict (``passed: true, ratio: 0.0``) was accepted. With integrity_secret
    configured, blend-check signs it and the connector refuses one unsigned, altered or
    signed with another secret: no verdict, blending off, one WARNING naming the file."""
    assert main(["blend-check", "--model", str(model), *FAST, "--kl-max", "0",
                 "--min-agreement", "1", "--ratios", "0,0.5",
                 "--config", str(_signing_config(tmp_path))]) == 1
    assert "(signed with the integrity secret)" in capsys.readouterr().out
    path = model / VERDICT_NAME
    signed = json.loads(path.read_text())
    assert signed["passed"] is False and len(signed["tag"]) == 64

    def gate_says(doc: dict, secret: str | None = SECRET) -> tuple[bool, list[str]]:
        path.write_text(json.dumps(doc))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lmc.connectors.reference.blend"):
            llm, conn = _blend_with_secret(model, secret)
        llm.close()
        return conn.blender is not None, [r.getMessage() for r in caplog.records
                                          if r.levelname == "WARNING"]

    on, warned = gate_says(signed)  # genuine, failed: off, and no warning (it is news)
    assert not on and warned == []
    edited = {**signed, "passed": True, "ratio": 0.0}
    on, warned = gate_says(edited)
    assert not on and len(warned) == 1 and str(path) in warned[0] and "does not verify" \
        in warned[0]
    unsigned = {k: v for k, v in edited.items() if k != "tag"}
    on, warned = gate_says(unsigned)
    assert not on and len(warned) == 1 and "unsigned" in warned[0]
    # a verdict signed with another secret does not verify either
    assert main(["blend-check", "--model", str(model), *FAST, "--kl-max", "10",
                 "--min-agreement", "0", "--config",
                 str(_signing_config(tmp_path, "t" * 32))]) == 0
    capsys.readouterr()
    other = json.loads(path.read_text())
    on, warned = gate_says(other)
    assert not on and len(warned) == 1 and "does not verify" in warned[0]
    assert gate_says(other, secret="t" * 32)[0]  # its own secret accepts it
    # re-indenting a signed verdict keeps it valid: the tag covers content, not layout
    path.write_text(json.dumps(other, indent=7, sort_keys=True))
    llm, conn = _blend_with_secret(model, "t" * 32)
    llm.close()
    assert conn.blender is not None


def test_without_a_secret_a_verdict_is_trusted_as_a_file_next_to_the_model(
        model: Path, capsys: pytest.CaptureFixture) -> None:
    """The documented boundary (docs/blending.md): without integrity_secret whoever can write
    next to the model can turn blending on, as they could replace the weights."""
    main(["blend-check", "--model", str(model), *FAST, "--kl-max", "0", "--min-agreement", "1",
          "--ratios", "0,0.5"])
    doc = json.loads((model / VERDICT_NAME).read_text())
    (model / VERDICT_NAME).write_text(json.dumps({**doc, "passed": True, "ratio": 0.0}))
    llm, conn = _blend(model)
    llm.close()
    assert conn.blender is not None and conn.blender.ratio == 0.0
