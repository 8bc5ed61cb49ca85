"""Blending's gate: ``lmc blend-check`` (``lmc quality --feature blend``) writes verdicts, the
blend connector obeys them. The tiny random-weight model makes the runs fast; thresholds are
set to force a pass or a failure (what blending does to a trained model is measured in
tests/quality/test_real_model.py)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from lmc.cli import main
from lmc.connectors.reference.blend import BlendConnector
from lmc.quality.verdict import VERDICTS_DIR, VerdictStore
from lmc.reference import LLM
from tests.blend.helpers import LMC, rag_prompt, tokens

FAST = ["--num-prompts", "2", "--tokens", "4", "--ratios", "0,0.5,1"]
LOOSE = ["--kl-max", "100", "--min-agreement", "0", "--min-top1", "0", "--max-ppl-change", "100"]
STRICT = ["--kl-max", "0", "--min-agreement", "1", "--min-top1", "1", "--max-ppl-change", "0"]


@pytest.fixture
def model(llama_dir: Path, tmp_path: Path) -> Path:
    """A private copy: verdicts are written next to its config.json."""
    return Path(shutil.copytree(llama_dir, tmp_path / "model"))


def _verdict(model: Path, ratio: str = "0") -> Path:
    return model / VERDICTS_DIR / f"blend@{ratio}@float32.json"


def _blend(model: Path, **blend) -> tuple[LLM, BlendConnector]:
    llm = LLM(model, num_blocks=96, lmc_config=LMC, blend=blend or True)
    assert isinstance(llm.kv_connector, BlendConnector)
    return llm, llm.kv_connector


def _off(model: Path, caplog: pytest.LogCaptureFixture, **blend) -> str:
    """The gate's log when it keeps blending off (asserted off)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmc.connectors.reference.blend"):
        llm, conn = _blend(model, **blend)
    llm.close()
    assert conn.blender is None, caplog.text
    return caplog.text


def test_a_passing_verdict_enables_blending(model: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["blend-check", "--model", str(model), *FAST, *LOOSE]) == 0
    out = capsys.readouterr().out
    assert "unasked, the gate turns it on at 0" in out and "KL mean" in out
    store = VerdictStore.next_to(model)
    verdicts = [store.read("blend", r, "float32") for r in ("0", "0.5", "1")]
    assert all(v is not None and v.passed for v in verdicts)
    assert verdicts[2].measurement.kl_mean < 1e-6 and len(verdicts[0].measurement.kv_error) == 4
    llm, conn = _blend(model)
    with llm:
        assert conn.blender is not None and conn.blender.ratio == 0.0
        ids, spans = rag_prompt([tokens(1, 30), tokens(2, 30)], tokens(3, 5))
        llm.generate(ids, max_tokens=1, segments=spans)
        assert conn.blender.stats.requests == 1


def test_a_failing_verdict_keeps_blending_off(model: Path, capsys: pytest.CaptureFixture,
                                              caplog: pytest.LogCaptureFixture) -> None:
    assert main(["blend-check", "--model", str(model), *FAST, *STRICT]) == 1
    assert "verdict: blend FAIL (no setting passed)" in capsys.readouterr().out
    ids, spans = rag_prompt([tokens(1, 30), tokens(2, 30)], tokens(3, 5))
    plain = LLM(model, num_blocks=96).generate(ids, max_tokens=3, ignore_eos=True)[0]
    log = _off(model, caplog)
    assert "blending off" in log and "failed" in log and "lmc quality --model" in log
    llm, conn = _blend(model)
    with llm:  # the segments are computed as plain prompt tokens: the same output
        out = llm.generate(ids, max_tokens=3, ignore_eos=True, segments=spans)[0]
    assert out.token_ids == plain.token_ids
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmc.connectors.reference.blend"):
        forced = LLM(model, num_blocks=96, lmc_config=LMC, blend={"override": True})
    assert forced.kv_connector.blender is not None and "forced on" in caplog.text
    forced.close()


def test_a_ratio_below_the_passing_ones_is_not_covered(model: Path,
                                                       caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    """A verdict at 0.5 vouches for 0.5 and above; asked for 0.1 the gate says no (it used
    to blend anyway, with a warning)."""
    assert main(["blend-check", "--model", str(model), "--num-prompts", "1", "--tokens", "2",
                 "--ratios", "0.5", *LOOSE]) == 0
    log = _off(model, caplog, ratio=0.1)
    assert "covers blend at 0.1" in log and "passed: 0.5" in log
    llm, conn = _blend(model, ratio=0.8)
    llm.close()
    assert conn.blender is not None and conn.blender.ratio == 0.8


def test_verdicts_for_other_weights_or_dtypes_or_garbage_are_not_trusted(
        model: Path, qwen_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    main(["blend-check", "--model", str(model), "--num-prompts", "1", "--tokens", "2",
          "--ratios", "0", *LOOSE])
    path = _verdict(model)
    raw = json.loads(path.read_text())
    cases = {
        "is for other@0000": {**raw, "model_id": "other@0000"},
        "it is for blend/0/bfloat16": {**raw, "dtype": "bfloat16"},
        "format 99": {**raw, "format": 99},
    }
    for why, doc in cases.items():
        path.write_text(json.dumps(doc))
        assert why in _off(model, caplog), why
    path.write_bytes(b"\xff\x00not json")
    assert str(path) in _off(model, caplog)
    # a verdict folder copied next to another checkpoint does not vouch for it
    path.write_text(json.dumps(raw))
    qwen = Path(shutil.copytree(qwen_dir, model.parent / "qwen"))
    shutil.copytree(model / VERDICTS_DIR, qwen / VERDICTS_DIR)
    assert "is for model@" in _off(qwen, caplog)


def test_bad_inputs_are_named(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
                              ) -> None:
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"pieces": ["a doc", "q"]}\n{"pieces": "nope"}\n')
    cases = [
        (["--model", str(tmp_path / "none")], "no config.json"),
        (["--model", str(model), "--prompts", str(bad)], "prompts.jsonl:2"),
        (["--model", str(model), "--prompts", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["--model", str(model), "--ratios", "0.1,nan"], "recompute ratio must be in [0, 1]"),
        (["--model", str(model), "--ratios", "0.1,1.5"], "recompute ratio must be in [0, 1]"),
        (["--model", str(model), "--text", "novel"], "no bundled text 'novel'"),
    ]
    for args, msg in cases:
        assert main(["blend-check", *args]) == 2, args
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="'verdict' .* is now 'verdicts'"):
        _blend(model, verdict=str(tmp_path))


def _fine_tuned(model: Path, where: Path) -> Path:
    """A copy under the same folder name whose weights differ in 256 KiB at 30% of
    model.safetensors (scaled: still valid float32 weights); its verdicts come along."""
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
    assert main(["blend-check", "--model", str(model), "--num-prompts", "1", "--tokens", "2",
                 "--ratios", "0", "--text", "none", *LOOSE]) == 0
    changed = _fine_tuned(model, tmp_path / "b")
    assert _verdict(changed).is_file()
    assert "is for" in _off(changed, caplog)
    llm, conn = _blend(model)  # the original still passes
    llm.close()
    assert conn.blender is not None


def test_a_verdict_nested_200_kb_deep_is_no_verdict_never_a_crash(
        model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """docs/quality.md: "no verdict, never a crash" (the reader raised RecursionError out of
    register_kv_caches)."""
    _verdict(model).parent.mkdir()
    _verdict(model).write_text("[" * 200_000)
    _off(model, caplog)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(_verdict(model)) in warnings[0]
    assert "nested deeper than 32 levels" in warnings[0]


def test_blend_checks_old_verdict_file_is_named_not_read(model: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    (model / "lmc_blend_verdict.json").write_text('{"passed": true, "ratio": 0.0}')
    log = _off(model, caplog)
    assert "lmc_blend_verdict.json (blend-check's old file) is no longer read" in log


SECRET = "s" * 32


def _signing_config(tmp_path: Path, secret: str = SECRET) -> Path:
    cfg = tmp_path / f"lmc-{secret[:4]}.yaml"
    cfg.write_text(f"integrity_secret: {secret}\n")
    return cfg


def _blend_with_secret(model: Path, secret: str | None = SECRET) -> tuple[LLM, BlendConnector]:
    cfg = dict(LMC, integrity_secret=secret) if secret else LMC
    llm = LLM(model, num_blocks=96, lmc_config=cfg, blend=True)
    return llm, llm.kv_connector


def _edited_to_pass(doc: dict) -> dict:
    """A failing verdict edited to pass, consistently (thresholds loosened to its figures)."""
    return {**doc, "passed": True, "failed": [],
            "thresholds": {"kl_mean_max": 100.0, "top1_min": 0.0, "ppl_change_max": 100.0,
                           "qa_agreement_min": 0.0}}


def test_with_a_secret_only_a_verdict_it_signed_enables_blending(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
        caplog: pytest.LogCaptureFixture) -> None:
    """An edited verdict (passed, thresholds loosened) was accepted. With integrity_secret
    configured, lmc quality signs it and the connector refuses one unsigned, altered or
    signed with another secret: no verdict, blending off, one WARNING naming the file."""
    check = ["blend-check", "--model", str(model), "--num-prompts", "1", "--tokens", "2",
             "--ratios", "0"]
    assert main([*check, *STRICT, "--config", str(_signing_config(tmp_path))]) == 1
    assert "(signed with the integrity secret)" in capsys.readouterr().out
    path = _verdict(model)
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
    edited = _edited_to_pass(signed)
    on, warned = gate_says(edited)
    assert not on and len(warned) == 1 and str(path) in warned[0] and "does not verify" \
        in warned[0]
    unsigned = {k: v for k, v in edited.items() if k != "tag"}
    on, warned = gate_says(unsigned)
    assert not on and len(warned) == 1 and "unsigned" in warned[0]
    # a verdict signed with another secret does not verify either
    assert main([*check, *LOOSE, "--config", str(_signing_config(tmp_path, "t" * 32))]) == 0
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
    """The documented boundary (docs/quality.md): without integrity_secret whoever can write
    next to the model can turn blending on, as they could replace the weights."""
    main(["blend-check", "--model", str(model), "--num-prompts", "1", "--tokens", "2",
          "--ratios", "0", *STRICT])
    doc = json.loads(_verdict(model).read_text())
    _verdict(model).write_text(json.dumps(_edited_to_pass(doc)))
    llm, conn = _blend(model)
    llm.close()
    assert conn.blender is not None and conn.blender.ratio == 0.0
