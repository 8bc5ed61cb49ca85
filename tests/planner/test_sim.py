"""The planner's pieces on small traces whose answers can be worked out by hand."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from lmc.cli import main
from lmc.planner import report
from lmc.planner.costmodel import MissingProfile, Profile, TierCost, fit_prefill
from lmc.planner.keys import key_trace
from lmc.planner.sim import GridPoint, grid, run_grid, simulate
from lmc.token_database import ChunkedTokenDatabase
from lmc.workloads.trace import TraceRequest, write_trace

CS = 256
BPT = 16  # KV bytes per token: a full chunk is exactly 4 KiB, one allocator unit


def _req(i: int, toks: list[int], session: str | None = None) -> TraceRequest:
    return TraceRequest(float(i), f"r{i}", session, None, toks, None, 4)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 50000) for _ in range(n)]


def test_keys_are_lmcs_chain_keys_and_sessions_hash_only_new_chunks():
    base = _prompt(1, 600)
    turn2 = base + _prompt(2, 300)
    other = _prompt(3, 100) + base[100:]  # same session, not a continuation
    kt = key_trace([_req(0, base, "s"), _req(1, turn2, "s"), _req(2, other, "s"),
                    _req(3, base)])
    db = ChunkedTokenDatabase(CS)
    ids: dict[bytes, int] = {}
    for i, toks in enumerate([base, turn2, other, base]):
        want = [ids.setdefault(k, len(ids)) for k in db.keys(toks)]
        assert kt.keys(i) == want
    assert kt.num_keys == len(ids)
    assert kt.hashed_tokens == 600 + (900 - 512) + 600 + 600  # turn 2 reused two full chunks


def test_l1_only_hits_by_hand():
    a, b = _prompt(1, 3 * CS), _prompt(2, 3 * CS)
    kt = key_trace([_req(0, a), _req(1, a), _req(2, b), _req(3, a)])
    # room for 4 chunks of 4 KiB: b's three chunks evict two of a's (LRU)
    r = simulate(kt, GridPoint(4 * 4096), bytes_per_token=BPT)
    assert r.hit_tokens == {"L1": (3 * CS - 1) + 0}
    assert list(r.per_request["L1"]) == [0, 3 * CS - 1, 0, 0]
    # room for 6: everything stays
    r = simulate(kt, GridPoint(6 * 4096), bytes_per_token=BPT)
    assert list(r.per_request["L1"]) == [0, 3 * CS - 1, 0, 3 * CS - 1]


def test_write_policies_promotion_and_the_write_queue_bound():
    p = [_prompt(i, 2 * CS) for i in range(5)]
    kt = key_trace([_req(i, toks) for i, toks in enumerate(p + p[:2])])
    l1 = 8 * 4096  # 8 chunks; the write queue takes half the pool, a quarter on evict
    disk = 64 * 8192
    r = simulate(kt, GridPoint(l1, disk, 0, "write_through"), bytes_per_token=BPT)
    # p0 is evicted by p4 and read back from disk, which evicts p1 (on disk as well)
    assert list(r.per_request["disk"]) == [0] * 5 + [2 * CS - 1] * 2
    assert list(r.per_request["L1"]) == [0] * 7
    # write-on-evict: p4's allocation evicts p0 into the queue (2 chunks, the bound), and
    # since queued chunks keep their memory it evicts p1 too, which the full queue drops:
    # lmc's documented behaviour under pressure, so p1 is lost
    r = simulate(kt, GridPoint(l1, disk, 0, "write_on_evict"), bytes_per_token=BPT)
    assert list(r.per_request["disk"]) == [0] * 5 + [2 * CS - 1, 0]
    assert r.tier_stats["disk.queue_dropped"] == 4  # p1, then p3 when p1's turn stores
    # a remote (an lmc daemon's memory) behaves like the disk below L1
    r = simulate(kt, GridPoint(l1, 0, 64 * 4096, "write_through"), bytes_per_token=BPT)
    assert list(r.per_request["remote"]) == [0] * 5 + [2 * CS - 1] * 2


def test_step_budget_offers_each_steps_chunks_to_the_write_queue():
    """Chunked prefill saves a step's completed chunks and the writer catches up between
    steps, so a queue of 4 chunks (half an 8-chunk L1) that drops from a 6-chunk prompt
    offered at once keeps everything offered 1, 2 chunks a step, and drops only the fifth
    chunk at 5 a step (chunks 0-3 queued, 4 dropped; 5 comes with the next step)."""
    a, b = _prompt(1, 6 * CS), _prompt(2, 8 * CS)  # b evicts a from L1; a's rerun reads disk
    kt = key_trace([_req(0, a), _req(1, b), _req(2, a)])
    point = GridPoint(8 * 4096, 64 * 8192, 0, "write_through")

    def run(step: int) -> tuple[list[int], float]:
        r = simulate(kt, point, bytes_per_token=BPT, step_tokens=step)
        assert list(r.per_request["L1"]) == [0, 0, 0]
        return list(r.per_request["disk"]), r.tier_stats["disk.queue_dropped"]

    assert run(0) == ([0, 0, 4 * CS], 2 + 4)  # a drops 2 chunks, b 4
    assert run(6 * CS) == ([0, 0, 4 * CS], 2 + 2)  # a in one step; b's first step drops 2
    assert run(CS) == run(2 * CS) == ([0, 0, 6 * CS - 1], 0)
    assert run(5 * CS) == ([0, 0, 4 * CS], 1 + 1)  # a's chunk 4, b's chunk 4
    serial = run_grid(kt, [point], bytes_per_token=BPT, step_tokens=CS)
    forked = run_grid(kt, [point, GridPoint(8 * 4096)], bytes_per_token=BPT, step_tokens=CS,
                      jobs=2)
    assert serial[0].hit_tokens == forked[0].hit_tokens == {"L1": 0, "disk": 6 * CS - 1}
    with pytest.raises(ValueError, match="step_tokens"):
        simulate(kt, point, bytes_per_token=BPT, step_tokens=-1)


def test_write_on_evict_writes_nothing_that_was_never_evicted():
    a = _prompt(1, 2 * CS)
    kt = key_trace([_req(0, a), _req(1, a)])
    r = simulate(kt, GridPoint(8 * 4096, 64 * 8192, 0, "write_on_evict"), bytes_per_token=BPT)
    assert r.tier_stats["disk.chunks"] == 0
    r = simulate(kt, GridPoint(8 * 4096, 64 * 8192, 0, "write_through"), bytes_per_token=BPT)
    assert r.tier_stats["disk.chunks"] == 2


def test_align_rounds_hits_down():
    a = _prompt(1, 2 * CS + 10)
    kt = key_trace([_req(0, a), _req(1, a)])
    r = simulate(kt, GridPoint(16 * 4096), bytes_per_token=BPT, align=16)
    assert r.per_request["L1"][1] == (2 * CS + 9) // 16 * 16


def test_grid_runs_in_parallel_with_the_same_answers():
    reqs = [_req(i, _prompt(i % 5, CS * (1 + i % 3) + i)) for i in range(40)]
    kt = key_trace(reqs)
    pts = grid([2 * 4096, 8 * 4096], [0, 16 * 8192], [0], ["write_through", "write_on_evict"])
    assert len(pts) == 2 + 2 * 2  # L1-only points are not repeated per policy
    serial = run_grid(kt, pts, bytes_per_token=BPT, jobs=1)
    forked = run_grid(kt, pts, bytes_per_token=BPT, jobs=2)
    assert [r.hit_tokens for r in serial] == [r.hit_tokens for r in forked]


def _profile() -> Profile:
    pts = [(n, 0.01 + 2e-5 * n + 1e-9 * n * n) for n in (256, 1024, 4096)]
    return Profile(model="test", kv_bytes_per_token=BPT, chunk_size=CS, prefill_points=pts,
                   tiers={"L1": TierCost(1 << 30), "disk": TierCost(1 << 28, 1e-4)})


def test_cost_model_fit_and_ttft():
    c0, c1, c2 = fit_prefill([(n, 0.01 + 2e-5 * n + 1e-9 * n * n) for n in (256, 1024, 4096)])
    assert (c0, c1, c2) == pytest.approx((0.01, 2e-5, 1e-9), rel=1e-6)
    # a noisy fit never goes negative
    assert min(fit_prefill([(100, 1.0), (200, 0.9), (300, 1.1)])) >= 0
    p = _profile()
    miss = p.ttft_s([4096], {})[0]
    hit = p.ttft_s([4096], {"L1": [4095]})[0]
    assert miss == pytest.approx(0.01 + 2e-5 * 4096 + 1e-9 * 4096**2)
    assert hit == pytest.approx(p.prefill_s(4095, 4096) + 4095 * BPT / (1 << 30))
    assert hit < miss
    with pytest.raises(ValueError, match="remote tier"):
        p.ttft_s([10], {"remote": [5]})


def test_knee_and_smallest_reaching():
    def row(l1: int, hit: float) -> report.Row:
        return report.Row(GridPoint(l1), {"L1": hit}, hit, None, None, None, 0.0)

    curve = [row(1 << 30, 0.2), row(2 << 30, 0.7), row(4 << 30, 0.8), row(8 << 30, 0.82)]
    assert report.knee(curve) is curve[1]
    assert report.smallest_reaching(curve, 0.75) is curve[2]
    assert report.smallest_reaching(curve, 0.9) is None


def test_missing_profile_names_the_command(tmp_path):
    with pytest.raises(MissingProfile, match="lmc plan --calibrate"):
        Profile.load(tmp_path / "none.json")


def test_cli_table_json_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [_req(i, _prompt(i % 3, CS * 2 + 7)) for i in range(12)])
    prof = _profile().save(tmp_path / "p.json")
    rc = main(["plan", str(trace), "--profile", str(tmp_path / "missing.json")])
    assert rc == 2 and "lmc plan --calibrate" in capsys.readouterr().err
    args = ["plan", str(trace), "--profile", str(prof), "--l1", "8KiB,16KiB,24KiB,48KiB",
            "--disk", "0,1MiB", "--policy", "write_through,write_on_evict", "--jobs", "1"]
    assert main([*args, "--target-hit-rate", "0.5", "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "hit total" in out and "smallest configuration reaching 50%" in out
    assert (tmp_path / "p.png").stat().st_size > 10_000
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["results"]) == 4 + 4 * 2
    best = max(r["hit_rate"]["total"] for r in doc["results"])
    # 3 distinct prompts x 4 repeats: at most 9 of 12 requests hit, each all but one token
    assert best == pytest.approx(9 * (CS * 2 + 6) / (12 * (CS * 2 + 7)))
    assert all(r["ttft_mean_s"] < doc["no_cache_ttft_mean_s"] for r in doc["results"]
               if r["hit_rate"]["total"] > 0)
    assert np.isfinite([r["ttft_p95_s"] for r in doc["results"]]).all()


def test_cli_refuses_bad_sizes_and_policies(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "x.jsonl", "--l1", "lots"])
    assert "--l1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "x.jsonl", "--policy", "write_back"])
    assert "write_through" in capsys.readouterr().err
