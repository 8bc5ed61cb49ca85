"""``lmc demo`` on a small workload: every pass generates the same tokens, warm passes are
served by lmc (L1, then the disk tier after a restart), and the table is printed."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from lmc.config import CacheConfig
from lmc.demo import DEMO_CONFIG, Workload, format_table, register_cli, run_demo

REPO = Path(__file__).resolve().parents[2]


def test_demo_passes_and_table(tiny_dir: Path) -> None:
    w = Workload(system_tokens=300, sessions=2, rounds=2, turn_tokens=20, doc_tokens=400,
                 questions=2, max_tokens=3)
    out = io.StringIO()
    results = run_demo(tiny_dir, None, w, baseline=True, out=out)
    text = out.getvalue()
    assert [r.name for r in results] == ["no lmc (engine alone)", "lmc, cold cache",
                                         "lmc, warm (L1)", "lmc, restarted (disk -> L1)"]
    assert "generated tokens identical in every pass: yes" in text
    warm, restarted = results[2].stats, results[3].stats
    n = results[2].prompt_tokens
    assert warm["worker.tokens_from_cpu"] == n - w.num_requests  # all but each last token
    assert restarted["worker.tokens_from_disk"] > 0
    assert restarted["cache.disk.read_bytes"] > 0
    assert "from disk" in text and "TTFT p95" in text


def test_demo_on_a_hybrid_model(tmp_path: Path) -> None:
    """The demo on a sliding-window/full model: identical tokens in every pass, warm passes
    served from lmc's per-group parts."""
    from lmc.reference import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "swa", sliding_window=64,
                                 max_position_embeddings=4096)
    w = Workload(system_tokens=300, sessions=2, rounds=2, turn_tokens=20, doc_tokens=400,
                 questions=2, max_tokens=3)
    out = io.StringIO()
    results = run_demo(model, None, w, baseline=True, out=out, rounds=0)
    assert "generated tokens identical in every pass: yes" in out.getvalue()
    warm = results[2].stats
    assert warm["worker.tokens_from_cpu"] == results[2].prompt_tokens - w.num_requests


def test_format_table_handles_cpu_only() -> None:
    from lmc.demo import PassResult

    r = PassResult("x", ttfts=[0.1, 0.2, 0.3], prompt_tokens=100,
                   stats={"worker.tokens_from_cpu": 50, "cache.retrieve_bytes": 1 << 20})
    table = format_table([r], ["cpu"])
    assert "50.0%" in table and "200.0ms" in table and "1.0MiB" in table


def test_demo_yaml_matches_the_embedded_defaults() -> None:
    cfg = CacheConfig.load(REPO / "configs" / "demo.yaml")
    assert cfg == CacheConfig.load(overrides=DEMO_CONFIG)


def test_cli_registers_demo() -> None:
    p = argparse.ArgumentParser()
    register_cli(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["demo", "--quick", "--config", "x.yaml", "--model", "m"])
    assert args.quick and args.config == "x.yaml" and args.model == "m" and callable(args.func)
