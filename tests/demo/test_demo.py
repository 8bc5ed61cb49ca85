"""``lmc demo`` end to end: on a small random-text workload, every pass generates the same
tokens, warm passes are served by lmc (L1, then the disk tier after a restart), and the table
is printed; on the real model (SmolLM2-135M-Instruct, the short script), the model's answers
are printed, correct, and the same token ids with lmc off, cold, warm and restarted."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from lmc.config import CacheConfig
from lmc.demo import DEMO_CONFIG, Workload, format_table, real_script, register_cli, run_demo
from lmc.demo.passes import PassResult
from tests.real_model import real_model_dir

REPO = Path(__file__).resolve().parents[2]
PASSES = ["no lmc (engine alone)", "lmc, cold cache", "lmc, warm (L1)",
          "lmc, restarted (disk -> L1)"]


def test_demo_passes_and_table(tiny_dir: Path) -> None:
    w = Workload(system_tokens=300, sessions=2, rounds=2, turn_tokens=20, doc_tokens=400,
                 questions=2, max_tokens=3)
    out = io.StringIO()
    results = run_demo(tiny_dir, None, w, baseline=True, out=out, rounds=2)
    text = out.getvalue()
    assert [r.name for r in results] == PASSES
    assert "generated tokens identical in every pass: yes" in text
    base, warm, restarted = results[0], results[2].stats, results[3].stats
    assert len(base.rounds) == len(results[2].rounds) == 2  # the interleaved rounds
    n = results[2].prompt_tokens
    assert warm["worker.tokens_from_cpu"] == n - results[2].requests  # all but each last token
    assert restarted["worker.tokens_from_disk"] > 0
    assert restarted["cache.disk.read_bytes"] > 0
    assert "from disk" in text and "TTFT p95" in text
    assert "no lmc (engine alone) x2" in text and "answers (" not in text  # random weights


def test_demo_on_the_real_model_answers_alike_in_every_pass() -> None:
    """The default demo's model and script (shortened: one chat of two rounds and one
    document question), the baseline included: the answers are the model's own, correct
    from exact KV, and identical in all four passes (run_demo raises otherwise)."""
    real_model_dir("fp32")  # converted once (skips naming the package when it is missing)
    out = io.StringIO()
    results = run_demo(None, None, baseline=True, out=out, rounds=1, short=True)
    text = out.getvalue()
    assert [r.name for r in results] == PASSES, text
    assert "model: smollm2-135m-instruct (fp32" in text
    assert "generated tokens identical in every pass: yes" in text
    script = real_script(short=True)
    assert results[0].requests == script.num_requests == 3
    for r in results:
        assert r.outputs == results[0].outputs and r.answers == results[0].answers
    answers = results[0].answers
    assert "1987" in answers[0] and "fifty" in answers[1] and "1965" in answers[2], answers
    for q, a in zip(["When did the workshop on Mill Lane open?",
                     "How many bicycles does it repair a week?",
                     "When did the railway line close?"], answers):
        assert q in text and f"-> {a}" in text
    assert results[2].stats["worker.tokens_from_cpu"] == (results[2].prompt_tokens
                                                          - results[2].requests)
    assert results[3].stats["worker.tokens_from_disk"] > 0
    assert "speed-up: " in text and "x TTFT p50 (the table's rows" in text


def test_demo_on_a_hybrid_model(tmp_path: Path) -> None:
    """The demo on a sliding-window/full model: identical tokens in every pass, warm passes
    served from lmc's per-group parts."""
    from lmc.reference import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "swa", sliding_window=64,
                                 max_position_embeddings=4096)
    w = Workload(system_tokens=300, sessions=2, rounds=2, turn_tokens=20, doc_tokens=400,
                 questions=2, max_tokens=3)
    out = io.StringIO()
    results = run_demo(model, None, w, baseline=True, out=out, rounds=1)
    assert "generated tokens identical in every pass: yes" in out.getvalue()
    warm = results[2].stats
    assert warm["worker.tokens_from_cpu"] == results[2].prompt_tokens - results[2].requests


def test_format_table_handles_cpu_only() -> None:
    r = PassResult("x", rounds=[[0.1, 0.2, 0.3]], prompt_tokens=100,
                   stats={"worker.tokens_from_cpu": 50, "cache.retrieve_bytes": 1 << 20})
    table = format_table([r], ["cpu"])
    assert "50.0%" in table and "200.0ms" in table and "1.0MiB" in table


def test_demo_yaml_matches_the_embedded_defaults() -> None:
    cfg = CacheConfig.load(REPO / "configs" / "demo.yaml")
    assert cfg == CacheConfig.load(overrides=DEMO_CONFIG)


def test_cli_registers_demo() -> None:
    p = argparse.ArgumentParser()
    register_cli(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["demo", "--quick", "--config", "x.yaml", "--model", "m", "--short",
                         "--rounds", "2"])
    assert args.quick and args.short and args.config == "x.yaml" and args.model == "m"
    assert args.rounds == 2 and callable(args.func)
