"""A RAG trace (`lmc workload rag`) replayed on the reference engine, with prefix caching
only and with blending: its segments reach the engine, blending reuses more of the prompt,
every request is answered, and the summary shows blended tokens next to prefix hits.

The tiny random-weight model has no passing quality verdict, so blending runs on the
gate's explicit override (docs/blending.md); what is measured here is reuse, not quality.
"""

from __future__ import annotations

import json

import pytest

from lmc.cli import main
from lmc.reference import LLM, make_tiny_checkpoint
from lmc.workloads import TraceError, read_trace
from lmc.workloads.replay import replay_reference

LMC = {"chunk_size": 16, "local_cpu_size": "32MiB"}
OUTPUT_LEN = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", hidden=64, layers=3,
                                heads=4, kv_heads=2)


def _rag(tmp_path, model, *extra: str) -> str:
    path = tmp_path / f"rag{len(extra)}.jsonl"
    assert main(["workload", "rag", "--documents", "5", "--doc-words", "40", "-k", "3",
                 "--queries", "10", "--question-words", "6", "--output-len", str(OUTPUT_LEN),
                 "--seed", "7", "-o", str(path), *extra]) == 0
    return str(path)


def _reuse(res) -> float:
    """Share of prompt tokens not computed: prefix hits plus blended segment tokens, less
    those the blend recomputed."""
    blended = (res.blend_tokens or 0) - (res.blend_recomputed or 0)
    return (sum(res.tier_tokens.values()) + blended) / res.prompt_tokens


@pytest.mark.parametrize("tokens", [True, False], ids=["segments", "separator"])
def test_blending_reuses_more_of_a_rag_trace_and_answers_every_request(tmp_path, model,
                                                                       tokens):
    trace = list(read_trace(_rag(tmp_path, model, *(["--tokenizer", str(model)] if tokens
                                                    else []))))
    assert all((r.segments if tokens else r.segment_separator) for r in trace)
    results = {}
    for blend in (False, True):
        with LLM(model, num_blocks=128, lmc_config=LMC,
                 blend={"override": True, "ratio": 0.15} if blend else None) as llm:
            results[blend] = replay_reference(trace, llm, fast=True, concurrency=1)
    plain, blended = results[False], results[True]
    for res in (plain, blended):
        assert not res.failed and len(res.ok) == len(trace)
        assert all(r.output_tokens == OUTPUT_LEN and r.ttft_s is not None for r in res.ok)
    assert plain.blend_tokens is None
    # the same prompts either way: the separators are dropped in both runs
    assert plain.prompt_tokens == blended.prompt_tokens
    assert blended.blend_tokens > 0 and blended.blend_recomputed > 0
    # measured: 0.33 with prefix caching only (a query sometimes starts with the same
    # document as an earlier one), 0.66-0.64 blended (segments, separator)
    assert _reuse(blended) > _reuse(plain) + 0.2, (_reuse(plain), _reuse(blended))


def test_replay_command_blends_and_reports_blended_tokens(tmp_path, model, capsys):
    trace = _rag(tmp_path, model, "--tokenizer", str(model))
    capsys.readouterr()
    records = tmp_path / "records.jsonl"
    target = f"reference:{model}"
    assert main(["replay", trace, "--target", target, "--fast", "--concurrency", "1",
                 "--blend", "--blend-override", "--blend-ratio", "0.2",
                 "--records", str(records)]) == 0
    out = capsys.readouterr().out
    assert "blending at recompute ratio 0.20" in out and "10 ok, 0 failed" in out
    blended = next(line for line in out.splitlines() if line.strip().startswith("blended"))
    assert "segments reused anywhere in the prompt" in blended and " 0.0%" not in blended
    recs = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(recs) == 10 and all(r["output_tokens"] == OUTPUT_LEN and r["error"] is None
                                   for r in recs)
    # without a verdict or the override, the gate keeps blending off and the summary says so
    assert main(["replay", trace, "--target", target, "--fast", "--blend", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "blending off (no passing lmc quality verdict" in out
    assert not any(line.strip().startswith("blended") for line in out.splitlines())
    # options that would be ignored are refused
    assert main(["replay", trace, "--target", target, "--no-lmc", "--blend"]) == 2
    assert "--blend: only for a target with lmc" in capsys.readouterr().err
    assert main(["replay", trace, "--target", target, "--blend-override"]) == 2
    assert "--blend-override: only for --blend" in capsys.readouterr().err
    assert main(["replay", trace, "--target", "http://127.0.0.1:9", "--blend"]) == 2
    assert "--blend: only for the reference target" in capsys.readouterr().err


@pytest.mark.parametrize("segments, message", [
    ([[0, 4], [2, 6]], "segments[1]: [2, 6] starts before the previous segment ends (4)"),
    ([[0, 99]], "segments[0]: [0, 99] must satisfy 0 <= start < end <= 8"),
    ([[3, "5"]], "segments[0]: expected a [start, end] pair of integers"),
])
def test_a_trace_with_bad_segments_fails_naming_file_line_and_field(tmp_path, model, capsys,
                                                                     segments, message):
    good = {"arrival_s": 0, "request_id": "a", "prompt_tokens": list(range(1, 9)),
            "output_len": 2, "segments": [[0, 4]]}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n\n"
                    + json.dumps(dict(good, request_id="b", segments=segments)) + "\n")
    with pytest.raises(TraceError) as e:
        list(read_trace(path))
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value)
    assert main(["replay", str(path), "--target", f"reference:{model}", "--blend",
                 "--blend-override"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3: {message}" in err and "Traceback" not in err


def test_replay_blend_with_a_verdict_nested_deep_runs_with_blending_off(tmp_path, model,
                                                                        capsys):
    """A verdict of 200 KB of brackets made ``lmc replay --blend`` exit 1 with a
    RecursionError traceback; it is no verdict (docs/blending.md)."""
    import shutil

    from lmc.quality.verdict import VerdictStore

    own = shutil.copytree(model, tmp_path / "m")
    path = VerdictStore.next_to(own).path("blend", "0.15", "float32")
    path.parent.mkdir()
    path.write_text("[" * 200_000)
    trace = _rag(tmp_path, own, "--tokenizer", str(own))
    capsys.readouterr()
    assert main(["replay", trace, "--target", f"reference:{own}", "--fast", "--blend",
                 "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "blending off (no passing lmc quality verdict" in out and "2 ok, 0 failed" in out


def test_replay_blends_where_a_verdict_in_the_given_folder_passed(tmp_path, model, capsys):
    """--blend-verdicts: the gate reads that folder (a model folder may be read-only)."""
    from lmc.connectors.core.model_id import model_identity
    from lmc.quality.verdict import VerdictStore
    from tests.quality.helpers import verdict

    trace = _rag(tmp_path, model, "--tokenizer", str(model))
    VerdictStore(tmp_path / "v").write(verdict("0.3", model_id=model_identity(model)))
    capsys.readouterr()
    assert main(["replay", trace, "--target", f"reference:{model}", "--fast", "--blend",
                 "--limit", "2", "--blend-verdicts", str(tmp_path / "v")]) == 0
    assert "blending at recompute ratio 0.30" in capsys.readouterr().out
    assert main(["replay", trace, "--target", f"reference:{model}", "--fast",
                 "--blend-verdicts", str(tmp_path / "v")]) == 2
    assert "--blend-verdicts: only for --blend" in capsys.readouterr().err
