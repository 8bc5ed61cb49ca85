"""``lmc plan --step-tokens``, run as a real ``lmc`` process: a bad value ends with exit 2
and a line naming the flag (never a traceback), a good one names the budget in the report
and predicts with it (the no-cache TTFT of prompts longer than a step grows by its steps'
fixed costs)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from lmc.planner.costmodel import Profile, TierCost

ROOT = Path(__file__).resolve().parents[2]
FIT = (0.02, 1 / 20_000, 0.0)


def lmc(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmc.cli", *map(str, args)], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """A trace (one shared 2,048-token prefix, then a fresh 300-token tail each) and a
    calibration profile (20 ms a step, 20k tokens/s, a disk read at 10k tokens/s)."""
    rng = random.Random(3)
    prefix = [rng.randrange(2, 2000) for _ in range(2048)]
    with (tmp_path / "t.jsonl").open("w") as f:
        for i in range(6):
            tail = [rng.randrange(2, 2000) for _ in range(300)]
            f.write(json.dumps({"arrival_s": i, "request_id": f"r{i}",
                                "prompt_tokens": prefix + tail, "output_len": 1}) + "\n")
    pts = [(n, FIT[0] + FIT[1] * n) for n in (256, 1024, 4096)]
    prof = Profile(model="t", kv_bytes_per_token=512, chunk_size=256, prefill_points=pts,
                   tiers={"L1": TierCost(512 * 400_000.0), "disk": TierCost(512 * 10_000.0)},
                   fit=FIT)
    return tmp_path / "t.jsonl", prof.save(tmp_path / "p.json")


@pytest.mark.parametrize("value", ["-1", "1.5", "lots", str((1 << 20) + 1), "1e3"])
def test_a_bad_step_budget_is_named(files: tuple[Path, Path], value: str) -> None:
    trace, prof = files
    out = lmc("plan", trace, "--profile", prof, "--step-tokens", value, cwd=trace.parent)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    assert "--step-tokens" in out.stderr and "[0, 1048576]" in out.stderr, out.stderr


def test_the_report_names_the_budget_and_predicts_with_it(files: tuple[Path, Path]) -> None:
    trace, prof = files
    common = ("plan", trace, "--profile", prof, "--l1", "64MiB", "--disk", "0")
    none = lmc(*common, cwd=trace.parent)
    assert none.returncode == 0, none.stderr
    assert "chunked prefill: none (--step-tokens 0)" in none.stdout
    chunked = lmc(*common, "--step-tokens", "512", cwd=trace.parent)
    assert chunked.returncode == 0, chunked.stderr
    lines = [x for x in chunked.stdout.splitlines() if x.startswith("chunked prefill")]
    assert lines == ["chunked prefill: 512 tokens per step (--step-tokens): a load hides under "
                     "the first step only"]
    js = [json.loads(lmc(*common, *extra, "--json", cwd=trace.parent).stdout)
          for extra in ((), ("--step-tokens", "512"))]
    assert js[0]["step_tokens"] == 0 and js[1]["step_tokens"] == 512
    # no cache: 2,348 tokens take 5 steps of 512, four more per-step costs than one step
    assert js[1]["no_cache_ttft_mean_s"] == pytest.approx(js[0]["no_cache_ttft_mean_s"]
                                                          + 4 * FIT[0])
    ttft = [j["results"][0]["ttft_mean_s"] for j in js]
    assert ttft[1] > ttft[0]  # the rest after a hit takes steps too
