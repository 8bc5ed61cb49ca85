"""``lmc replay`` on the reference engine in-process: repeated prefixes are served from lmc
(counted per tier and per request), outputs equal the engine's alone, failures are recorded
and reported, and the table, records and plot are written."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys

import pytest

from lmc.cli import main
from lmc.reference import LLM, make_tiny_checkpoint
from lmc.workloads import TraceRequest, read_trace, write_trace
from lmc.workloads import generators as g
from lmc.workloads.replay import replay_reference

SEED = int(os.environ.get("LMC_TEST_SEED", random.randrange(1 << 16)))
ENGINE = {"block_size": 16, "max_num_batched_tokens": 2048, "max_num_seqs": 4}
LMC = {"chunk_size": 64, "local_cpu_size": "32MiB"}  # small chunks: short prompts still hit


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", hidden=64, layers=2,
                                max_position_embeddings=2048)


@pytest.fixture(scope="module")
def prefix_trace(model) -> list[TraceRequest]:
    tok = g.load_tokenizer(model)
    spec = g.PrefixSpec(groups=2, prompts_per_group=3, system_tokens=200, question_tokens=20,
                        output_len=3, seed=SEED)
    return list(g.render(g.prefix_drafts(spec, tok), g.arrival_times(6, None, SEED), tok))


def test_repeated_prefixes_hit_and_outputs_equal_the_engine_alone(model, prefix_trace):
    print("seed", SEED)
    with LLM(model, **ENGINE) as alone:
        base = replay_reference(prefix_trace, alone, fast=True, concurrency=1)
    with LLM(model, lmc_config=LMC, **ENGINE) as llm:
        res = replay_reference(prefix_trace, llm, fast=True, concurrency=1)
    assert base.tier_tokens == {} and base.load_failures is None
    assert not res.failed and not base.failed
    want = {r.request_id: r.output_ids for r in base.records}
    assert {r.request_id: r.output_ids for r in res.records} == want
    assert all(len(ids) == 3 for ids in want.values())
    seen: set[str] = set()
    for r in res.records:  # sequential: each group's first request computes, the rest hit
        assert r.prompt_tokens >= 200 and r.ttft_s is not None and r.ttft_s > 0
        if r.prefix_group in seen:
            assert r.cached_tokens >= 192, r
        else:
            assert r.cached_tokens == 0, r
            seen.add(r.prefix_group)
    assert res.tier_tokens["cpu"] == sum(r.cached_tokens for r in res.records) >= 4 * 192
    assert res.load_failures == 0 and res.mode == "fast"
    times = [t for t, _, _ in res.timeline]
    assert times == sorted(times) and res.timeline[-1][2] == res.tier_tokens
    assert res.timeline[-1][1] == sum(r.prompt_tokens for r in res.records)
    # the hit-rate funnel: the engine's cached tokens are what it used; every lookup's
    # tokens are found or missed with a reason; each group's first request was never seen
    f = res.funnel
    assert f is not None and base.funnel is None
    assert f["engine_used"] == sum(r.cached_tokens for r in res.records)
    assert f["prompt_tokens"] == sum(r.prompt_tokens for r in res.records)
    assert f["lmc_found"] == sum(f["found_by_tier"].values()) >= f["loaded"]
    assert f["prompt_tokens"] == f["best_possible"] + f["misses"].get("never_seen", 0)
    assert f["misses"]["never_seen"] >= 2 * 200
    from lmc.workloads.report import format_report
    text = format_report(res)
    assert "hit-rate funnel" in text and "miss: never seen" in text


def test_sessions_wait_for_answers_at_arrival_times(model):
    tok = g.load_tokenizer(model)
    spec = g.ChatSpec(conversations=2, turns=(12, 12), system_tokens=100, user_tokens=(5, 10),
                      output_len=2, active=2, seed=SEED)
    drafts = g.chat_drafts(spec, tok)[:6]
    reqs = list(g.render(drafts, g.arrival_times(len(drafts), 40.0, SEED), tok))
    with LLM(model, lmc_config=LMC, **ENGINE) as llm:
        res = replay_reference(reqs, llm)
    assert res.mode == "timed" and not res.failed
    by_id = {r.request_id: r for r in res.records}
    for req in reqs:
        rec = by_id[req.request_id]
        assert rec.due_s >= req.arrival_s - 1e-9
        k = int(req.request_id.rsplit("-", 1)[1])
        if k:  # due no earlier than the previous turn's answer
            prev = by_id[req.request_id.rsplit("-", 1)[0] + f"-{k - 1}"]
            assert rec.due_s >= prev.due_s + prev.latency_s - 1e-6
            assert rec.cached_tokens >= 64  # the history's full chunks were saved


def test_a_failing_request_is_recorded_and_the_replay_goes_on(model):
    reqs = [TraceRequest(0, "ok-1", None, None, [5] * 40, None, 2),
            TraceRequest(0, "too-long", None, None, [5] * 3000, None, 2),
            TraceRequest(0, "bad-id", None, None, [5, 999_999], None, 2),
            TraceRequest(0, "ok-2", None, None, [6] * 40, None, 2)]
    with LLM(model, **ENGINE) as llm:
        res = replay_reference(reqs, llm, fast=True)
    errors = {r.request_id: r.error for r in res.records}
    assert errors["ok-1"] is None and errors["ok-2"] is None
    assert "too-long" in errors and errors["too-long"] and errors["bad-id"]
    assert "out of range" in errors["bad-id"]
    assert len(res.ok) == 2 and res.ttft_percentile(0.5) is not None


def test_text_prompts_need_the_models_tokenizer(model, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    (bare / "tokenizer.json").unlink()
    with LLM(bare, **ENGINE) as llm, pytest.raises(ValueError, match="has no tokenizer.json"):
        replay_reference([TraceRequest(0, "t", None, None, None, "Some text.", 1)], llm)


def test_replay_command_prints_the_table_and_writes_records_and_plot(model, tmp_path, capsys):
    trace = tmp_path / "docqa.jsonl"
    assert main(["workload", "docqa", "--documents", "2", "--doc-tokens", "300", "--rounds",
                 "2", "--question-tokens", "8", "--output-len", "2", "--seed", str(SEED),
                 "--tokenizer", str(model), "-o", str(trace)]) == 0
    cfg = tmp_path / "lmc.yaml"
    cfg.write_text(f"chunk_size: 64\nlocal_cpu_size: 32MiB\nlocal_disk: {tmp_path / 'disk'}\n"
                   "local_disk_size: 256MiB\n")
    png, records = tmp_path / "out.png", tmp_path / "records.jsonl"
    capsys.readouterr()
    assert main(["replay", str(trace), "--target", f"reference:{model}", "--config", str(cfg),
                 "--fast", "--concurrency", "1", "--threads", "1", "--plot", str(png),
                 "--records", str(records)]) == 0
    out, err = capsys.readouterr()
    assert "replay [" in err and "4/4" in err  # the progress bar
    for text in ("4 ok, 0 failed", "TTFT", "p50", "p95", "p99", "throughput", "req/s",
                 "lmc hits by tier", "cpu", "disk", "load fails"):
        assert text in out, (text, out)
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["request_id"] for r in rows] == [r.request_id for r in read_trace(trace)]
    assert sum(r["cached_tokens"] for r in rows) >= 2 * 256  # round 2 re-reads both documents
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bad_targets_and_traces_are_one_line_errors(tmp_path, capsys, prefix_trace):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, prefix_trace[:1])
    assert main(["replay", str(trace), "--target", "ftp://x"]) == 2
    assert "expected reference[:MODEL_DIR] or http://host:port" in capsys.readouterr().err
    assert main(["replay", str(trace), "--target", "http://127.0.0.1:9", "--no-lmc",
                 "--threads", "2"]) == 2
    assert "--no-lmc, --threads: only for the reference target" in capsys.readouterr().err
    assert main(["replay", str(trace), "--target", "reference", "--model", "m"]) == 2
    assert "--model: only for the HTTP target" in capsys.readouterr().err
    assert main(["replay", str(trace), "--target", "reference", "--records",
                 str(tmp_path / "no" / "r.jsonl")]) == 2
    assert "--records" in capsys.readouterr().err
    trace.write_text('{"arrival_s": 0}\n')
    assert main(["replay", str(trace), "--target", "reference"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmc replay: ") and "t.jsonl:1: request_id: missing" in err


def test_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch, prefix_trace):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, prefix_trace[:1])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as in an install without it
    assert main(["replay", str(trace), "--target", "reference", "--plot",
                 str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install 'lmc-kvcache[plot]'" in err
    assert "Traceback" not in err and not (tmp_path / "p.png").exists()
