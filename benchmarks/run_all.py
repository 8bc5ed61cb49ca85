"""``lmc bench``: the core, disk, Redis, daemon and TTFT figures in one run, as Markdown tables
in ``benchmarks/RESULTS.md``'s format (each figure beside its limit from the same run, the
ratio, and the spread of the per-repetition ratios), headed by the date, the machine and the
load average before and after each benchmark.

Each benchmark runs as its own script in its own process (``bench_*.py --json FILE``): a
fresh process per benchmark keeps one's memory and threads out of the next one's figures, and
a benchmark that fails (a missing tool, a crash) is reported in the table instead of ending
the run. Their output is shown as it comes (progress); the tables are printed at the end, or
written to ``--out``.

    lmc bench                       # every figure at the recorded sizes (tens of minutes)
    lmc bench --quick               # tiny sizes, one repetition: a smoke run (~30 s)
    lmc bench --only core,disk --out /tmp/figures.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
Row = tuple[str, str, str, str, str, str]  # figure, lmc, limit, ratio, spread, target
HEADER = ("figure", "lmc", "limit (same run)", "ratio", "spread", "target")


@dataclasses.dataclass(frozen=True)
class Suite:
    """One benchmark script, its arguments at full and at smoke size, and its table."""

    name: str
    title: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    table: Callable[[Any], list[Row]]
    needs: tuple[str, ...] = ()  # executables without which it cannot run
    missing: Callable[[], str | None] | None = None  # why it cannot run here, or None


# ------------------------------------------------------------------- formatting
def num(x: float | None, unit: str = "", digits: int = 2) -> str:
    return "–" if x is None else f"{x:,.{digits}f}{(' ' + unit) if unit else ''}"


def spread(values: list[float]) -> str:
    """``min–max`` of per-repetition ratios; one repetition has none."""
    return "–" if len(values) < 2 else f"{min(values):.2f}–{max(values):.2f}"


def paired(lmc: list[float], limit: list[float]) -> tuple[float, list[float]]:
    """Median of the per-repetition ratios, and those ratios."""
    rs = [a / b for a, b in zip(lmc, limit) if b]
    return (statistics.median(rs) if rs else float("nan")), rs


# ---------------------------------------------------------------------- tables
def core_table(rows: list[dict]) -> list[Row]:
    out: list[Row] = []
    for r in rows:
        if "store_us" in r:
            out.append((r["name"], f"{r['store_us']:.1f} / {r['retrieve_us']:.1f} µs",
                        f"– (store / retrieve; thread CPU time {r['store_cpu_us']:.1f} / "
                        f"{r['retrieve_cpu_us']:.1f} µs)", "–",
                        f"store {r['store_us_min']:.1f}–{r['store_us_max']:.1f}, retrieve "
                        f"{r['retrieve_us_min']:.1f}–{r['retrieve_us_max']:.1f} µs",
                        "≤ 5 µs (bookkeeping-only shape)"))
            continue
        lo, hi = r.get("ratio_min"), r.get("ratio_max")
        name = r["name"]
        if r.get("steady") is not None:
            name += f" (steady state {r['steady']:.2f} GiB/s"
            name += (f"; pre-fault took {r['prefault_s']:.2f} s)" if r.get("prefault_s")
                     is not None else ")")
        out.append((name, num(r["value"], r["unit"]), f"{r['limit_name']} "
                    f"{num(r['limit'], r['unit'])}", f"**{r['ratio']:.2f}**",
                    "–" if lo is None else f"{lo:.2f}–{hi:.2f}", r["target"]))
    return out


def disk_table(d: dict) -> list[Row]:
    reps, tool = d["reps"], d["tool"]
    out: list[Row] = []
    for key, name, lim in (("lmc_w", "engine durable store", "lim_w"),
                           ("tier_w", "tier put", "lim_w"),
                           ("lmc_r", "engine retrieve (L1 empty)", "lim_r"),
                           ("lmc_rp", "prefetch + retrieve", "lim_r"),
                           ("tier_r", "tier get", "lim_r")):
        ratio, rs = paired(reps[key], reps[lim])
        out.append((f"{name} ({d['chunk_mib']:g} MiB chunks, fsync "
                    f"{'on' if d['fsync'] else 'off'})", num(d["median"][key], "GiB/s"),
                    f"{tool} {'write' if lim == 'lim_w' else 'read'} "
                    f"{num(d['median'][lim], 'GiB/s')}", f"**{ratio:.2f}**", spread(rs),
                    "≥ 0.80"))
    return out


def redis_table(results: list[dict]) -> list[Row]:
    out: list[Row] = []
    for r in results:
        if "label" not in r:
            continue
        t, b = r["tier"], r["bench"]
        value = r["label"].split(" ")[0]
        out.append((f"tier put, {value}", num(t["put"], "GiB/s"),
                    f"redis-benchmark SET, fresh keys {num(r['bench_fresh_put'], 'GiB/s')}",
                    f"**{t['put_ratio']:.2f}**",
                    f"{t['put_ratio_min']:.2f}–{t['put_ratio_max']:.2f}", "≥ 0.70"))
        out.append((f"tier put, {value}, vs one-key SET", num(t["put"], "GiB/s"),
                    f"redis-benchmark SET, one key {num(b['put'], 'GiB/s')}",
                    f"{t['put_1key_ratio']:.2f}",
                    f"{t['put_1key_ratio_min']:.2f}–{t['put_1key_ratio_max']:.2f}", "–"))
        out.append((f"tier get, {value}", num(t["get"], "GiB/s"),
                    f"redis-benchmark GET {num(b['get'], 'GiB/s')}",
                    f"**{t['get_ratio']:.2f}**",
                    f"{t['get_ratio_min']:.2f}–{t['get_ratio_max']:.2f}", "≥ 0.70"))
    return out


def daemon_table(d: dict) -> list[Row]:
    samples, out = d["samples"], []
    ref = samples.get("redis-benchmark", {})
    mib = d["value"] / 2**20
    for name in ("lmc server, TCP", "lmc server, Unix", "Redis tier (redis-py)"):
        for op in ("put", "get"):
            vals = samples.get(name, {}).get(op)
            if not vals:
                continue
            lim = ref.get(op, [])
            ratio, rs = paired(vals, lim) if lim else (float("nan"), [])
            out.append((f"{name} {op}, {mib:g} MiB values, {d['clients']} clients",
                        num(statistics.median(vals), "GiB/s"),
                        f"redis-benchmark {'SET' if op == 'put' else 'GET'} "
                        f"{num(statistics.median(lim) if lim else None, 'GiB/s')}",
                        f"**{ratio:.2f}**", spread(rs), "≥ 1.0"))
    return out


def ttft_table(r: dict) -> list[Row]:
    base = r.get("prefill_s") or r["lmc_cold_s"]
    model = "" if r.get("model", "custom") == "custom" else f"{r['model']}, "
    out: list[Row] = [
        (f"TTFT, full prefill, {r['tokens']} tokens ({model}hidden {r['hidden']}, "
         f"{r['layers']} layers, {r['dtype']}, {r['kv_bytes'] // r['tokens']:,} B of KV a "
         "token)", num(base * 1e3, "ms", 1), "–", "1.0×", "–", "–"),
        ("TTFT, lmc cold (prefill + save)", num(r["lmc_cold_s"] * 1e3, "ms", 1),
         "full prefill", f"{base / r['lmc_cold_s']:.2f}×", "–", "–")]
    for key, name in (("l1_hit", "TTFT, lmc hit in L1"), ("disk_hit", "TTFT, lmc hit on disk")):
        reps = r.get(f"{key}_reps", [r[f"{key}_s"]])
        out.append((name, num(r[f"{key}_s"] * 1e3, "ms", 1), "full prefill",
                    f"**{base / r[f'{key}_s']:.1f}×**",
                    "–" if len(reps) < 2 else f"{base / max(reps):.1f}–{base / min(reps):.1f}×",
                    "≥ 10×" if key == "l1_hit" else "–"))
    for o in r.get("overlap", []):
        w = o.get("layerwise_wait_reps", [o["layerwise_wait_s"]])
        out.append((f"layer-wise, {o['suffix']}-token suffix: model waited for loads",
                    num(o["layerwise_wait_s"] * 1e3, "ms", 1),
                    f"load {num(o['load_s'] * 1e3, 'ms', 1)}, compute "
                    f"{num(o['compute_s'] * 1e3, 'ms', 1)}",
                    f"{o['layerwise_wait_s'] / o['load_s']:.2f} of the load" if o["load_s"]
                    else "–",
                    "–" if len(w) < 2 else f"{min(w) * 1e3:.1f}–{max(w) * 1e3:.1f} ms", "–"))
    return out


def ticker_table(r: dict) -> list[Row]:
    """The launch-and-wait ticker (bench_launch_ticker.py): its rate beside lmc's cold saves
    against beside plain copies (and plain copies + writes) of the same bytes."""
    rounds = r["rounds"]

    def rate(kind: str) -> float:
        return statistics.median(x[kind]["rate_per_s"] for x in rounds)

    ratios = [x["lmc"]["rate_per_s"] / x["plain"]["rate_per_s"] for x in rounds]
    out: list[Row] = [
        (f"engine ticker beside lmc saves ({r['prompts']} x {r['tokens']} tokens per round)",
         f"{rate('lmc'):,.0f} /s", f"beside plain copies {rate('plain'):,.0f} /s",
         f"**{statistics.median(ratios):.2f}**", spread(ratios), "≥ 0.9")]
    if "plain_writes" in rounds[0]:
        pw = [x["lmc"]["rate_per_s"] / x["plain_writes"]["rate_per_s"] for x in rounds]
        out.append(("engine ticker beside lmc saves, vs copies + O_DIRECT writes",
                    f"{rate('lmc'):,.0f} /s", f"beside copies + writes "
                    f"{rate('plain_writes'):,.0f} /s", f"**{statistics.median(pw):.2f}**",
                    spread(pw), "–"))
    return out


SUITES = {
    "core": Suite("core", "Core data path", "bench_core.py", (),
                  ("--quick", "--tokens", "256", "--reps", "2"), core_table),
    "disk": Suite("disk", "Disk tier", "bench_disk.py", ("--reps", "5", "--gib", "2"),
                  ("--quick",), disk_table),
    "redis": Suite("redis", "Redis tier", "bench_redis.py", ("--rounds", "7"),
                   ("--quick", "--rounds", "1", "--batch-mib", "8", "--sizes", "1MiB"), redis_table,
                   needs=("redis-server", "redis-benchmark")),
    "daemon": Suite("daemon", "Cache-server daemon", "bench_server.py", ("--reps", "7"),
                    ("--quick", "--total", "8MiB", "--daemon-size", "64MiB", "--clients",
                     "2", "--batch", "4"), daemon_table,
                    needs=("redis-server", "redis-benchmark")),
    "ttft": Suite("ttft", "Reference engine TTFT", "bench_ttft.py", ("--threads", "1"),
                  ("--tokens", "512", "--hidden", "128", "--layers", "2", "--kv-heads", "2",
                   "--reps", "2", "--suffixes", "1", "--chunk-size", "128", "--threads", "1"),
                  ttft_table),
    "ttft-real": Suite("ttft-real", "Reference engine TTFT, real model (SmolLM2-135M-Instruct)",
                       "bench_ttft.py", ("--model", "smollm2-135m", "--threads", "1"),
                       ("--model", "smollm2-135m", "--tokens", "512", "--reps", "2",
                        "--cold-reps", "1", "--suffixes", "1", "--threads", "1"),
                       ttft_table, missing=lambda: _bench_module("bench_ttft")
                       .real_model_missing()),
    "ticker": Suite("ticker", "Launch-and-wait engine thread beside cold saves",
                    "bench_launch_ticker.py", ("--writes",), ("--quick", "--writes"),
                    ticker_table),
}


def _bench_module(name: str) -> Any:
    """A benchmark script of this folder as a module (its cheap checks, not its run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"lmc_bench_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------ running
@dataclasses.dataclass
class Outcome:
    suite: Suite
    rows: list[Row]
    seconds: float
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    command: str
    error: str | None = None


def _load() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def run_suite(suite: Suite, quick: bool, log: TextIO) -> Outcome:
    """Run one benchmark script, its output shown on ``log`` line by line as it comes."""
    args = list(suite.quick if quick else suite.full)
    command = f"python benchmarks/{suite.script} {' '.join(args)}".rstrip()
    before, t0 = _load(), time.perf_counter()
    missing = [x for x in suite.needs if shutil.which(x) is None]
    if missing:
        return Outcome(suite, [], 0.0, before, before, command,
                       f"skipped: {', '.join(missing)} not found")
    why = suite.missing() if suite.missing is not None else None
    if why:
        return Outcome(suite, [], 0.0, before, before, command, f"skipped: {why}")
    with tempfile.TemporaryDirectory(prefix="lmc-bench-") as tmp:
        out = Path(tmp) / "figures.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        proc = subprocess.Popen([sys.executable, str(HERE / suite.script), *args, "--json",
                                 str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(f"  {suite.name} | {line}")
            log.flush()
            tail = (tail + [line.rstrip()])[-5:]
        rc = proc.wait()
        took, after = time.perf_counter() - t0, _load()
        if rc != 0 or not out.exists():
            return Outcome(suite, [], took, before, after, command,
                           f"failed (exit {rc}): " + " / ".join(tail))
        try:
            rows = suite.table(json.loads(out.read_text()))
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            return Outcome(suite, [], took, before, after, command,
                           f"its figures could not be read: {type(e).__name__}: {e}")
    return Outcome(suite, rows, took, before, after, command)


def machine() -> str:
    mem = ""
    try:
        kib = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                       if ln.startswith("MemTotal")).split()[1])
        mem = f", {kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    try:
        import torch
        tv = f"torch {torch.__version__}, "
        gpu = "GPU: " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        tv, gpu = "", "no torch"
    return (f"{os.cpu_count()} cores{mem}, {gpu} ({tv}Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()})")


def render(outcomes: list[Outcome], quick: bool, started: _dt.datetime) -> str:
    fmt = " / ".join
    lines = [f"## `lmc bench{' --quick' if quick else ''}` — "
             f"{started:%Y-%m-%d %H:%M} UTC", "",
             f"Machine: {machine()}. Ratios are medians of per-repetition ratios against the "
             "limit measured in the same run; the spread is their min–max."
             + (" Smoke-run sizes: not figures to record." if quick else ""), ""]
    for o in outcomes:
        lines += [f"### {o.suite.title} — `{o.command}`", ""]
        lines.append(f"Load average (1/5/15 min) before {fmt(f'{x:.2f}' for x in o.load_before)}"
                     f", after {fmt(f'{x:.2f}' for x in o.load_after)}; took {o.seconds:.0f} s.")
        lines.append("")
        if o.error:
            lines += [f"Not measured: {o.error}", ""]
            continue
        lines.append("| " + " | ".join(HEADER) + " |")
        lines.append("|---|---|---|---|---|---|")
        lines += ["| " + " | ".join(r) + " |" for r in o.rows]
        lines.append("")
    return "\n".join(lines)


def write_report(text: str, out: str | None, append: bool, force: bool) -> None:
    """Print, or write ``out``: an existing file is appended to only with ``append`` and
    replaced only with ``force`` -- RESULTS.md is never overwritten by accident."""
    if out is None:
        sys.stdout.write(text + "\n")
        return
    path = Path(out)
    if path.exists() and not (append or force):
        raise FileExistsError(f"{path} exists: pass --append to add this run's tables to it, "
                              "or --force to replace it")
    with path.open("a" if append and path.exists() else "w") as f:
        if append and path.exists() and path.stat().st_size:
            f.write("\n")
        f.write(text + "\n")


def parse_only(value: str | None) -> list[str]:
    if not value:
        return list(SUITES)
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise ValueError(f"--only: unknown benchmark(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(SUITES)}")
    return names


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes and one or two repetitions: a smoke run (~30 s)")
    ap.add_argument("--only", help=f"comma-separated subset of: {', '.join(SUITES)}")
    ap.add_argument("--out", help="write the tables to this file (default: print them)")
    ap.add_argument("--append", action="store_true", help="append to an existing --out file")
    ap.add_argument("--force", action="store_true", help="replace an existing --out file")


def run(args: argparse.Namespace, log: TextIO = sys.stderr) -> int:
    try:
        names = parse_only(args.only)
        if args.out and Path(args.out).exists() and not (args.append or args.force):
            raise FileExistsError(f"{args.out} exists: pass --append to add this run's "
                                  "tables to it, or --force to replace it")
    except (ValueError, FileExistsError) as e:
        print(f"lmc bench: {e}", file=sys.stderr)
        return 2
    started = _dt.datetime.now(_dt.timezone.utc)
    outcomes = []
    for i, name in enumerate(names, 1):
        suite = SUITES[name]
        log.write(f"[{i}/{len(names)}] {suite.title} ({suite.script}) ...\n")
        log.flush()
        o = run_suite(suite, args.quick, log)
        outcomes.append(o)
        log.write(f"[{i}/{len(names)}] {suite.title}: "
                  f"{o.error or f'{len(o.rows)} figures'} in {o.seconds:.1f} s\n")
        log.flush()
    write_report(render(outcomes, args.quick, started), args.out, args.append, args.force)
    return 1 if any(o.error and not o.error.startswith("skipped") for o in outcomes) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmc bench", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
