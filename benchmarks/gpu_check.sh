#!/usr/bin/env bash
# One command for a lent GPU (`make gpu-check`): install the checkout offline, run the GPU
# tests, the transfer benchmark with its copy-under-compute figure and the device's copy path
# calibration, the TTFT benchmark on CUDA, the load-or-recompute benchmark on CUDA (the disk
# tier as it is: no cache, load all, lmc's split, the sweep's best), the pinned pool's bytes
# against the size asked; print one table and append it, dated, with the device's name, to
# benchmarks/RESULTS.md.
#
#   bash benchmarks/gpu_check.sh            # on the device: < 5 min on an H100
#   bash benchmarks/gpu_check.sh --dry-run  # any machine: every step runs, CUDA parts skip
#                                           # (saying so); nothing is appended to RESULTS.md
#
# What the device image holds (no network): python3.12, torch (CUDA), cupy-cuda13x, numpy,
# xxhash, pyyaml, prometheus-client, msgpack, safetensors, tokenizers, pytest, hypothesis; no
# redis, no cryptography: the tests that need those skip, naming them. Every figure also
# lands in $OUT (the device tool's result folder, when set) as JSON plus the section appended
# to RESULTS.md (gpu_check_section.md), so a session can commit it from its own checkout.
# Each step has its own time limit; a step that fails is reported in the table and the
# script goes on, exiting non-zero at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done
RES=${OUT:-$(mktemp -d -t lmc-gpu-check.XXXXXX)}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
T0=$(date +%s)
# The whole check ends within GPU_CHECK_BUDGET seconds (default 290: a 15-minute device
# allowance keeps room for a rerun): each step's own limit is cut to what is left, keeping
# 15 s for the summary, so a slow step costs the steps after it, never the report.
# A dry run checks that every step runs, not how fast this machine is: no device time is
# spent, so there is no budget and each step's limit is only a hang guard, GPU_CHECK_SLACK
# (default 10) times the device's (a loaded 2-core machine ran the dry run's CPU stand-ins
# at a tenth of their quiet speed, and the 290 s budget cut the last step short).
if [ "$DRY" = 1 ]; then
    BUDGET=${GPU_CHECK_BUDGET:-0}
    SLACK=${GPU_CHECK_SLACK:-10}
else
    BUDGET=${GPU_CHECK_BUDGET:-290}
    SLACK=${GPU_CHECK_SLACK:-1}
fi
lim() {
    local own=$(( $1 * SLACK ))
    [ "$BUDGET" -gt 0 ] || { echo "$own"; return; }
    local rest=$(( BUDGET - ($(date +%s) - T0) - 15 ))
    [ "$rest" -gt 5 ] || rest=5
    echo $(( own < rest ? own : rest ))
}
step() { echo; echo "== gpu_check [$(( $(date +%s) - T0 )) s] $*"; }
fails=()

HAS_CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$HAS_CUDA" != 1 ]; then
    echo "gpu_check: no CUDA device on this machine: the CUDA parts are skipped (they say so)"
fi

step "install the checkout offline"
if [ "$DRY" = 1 ]; then
    echo "dry run: would run $PY -m pip install --no-deps --no-build-isolation --no-index -e ."
elif ! timeout "$(lim 180)" $PY -m pip install -q --no-deps --no-build-isolation --no-index -e .; then
    # best effort: lmc straight from the checkout (every package lives under lmc/)
    echo "gpu_check: the offline install failed; lmc is used from the checkout"
    fails+=("install")
fi
# the benchmarks run as scripts (their own folder on sys.path): the checkout comes first
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import lmc, sys; print('lmc from', lmc.__file__, 'python', sys.version.split()[0])" \
    || { echo "gpu_check: lmc does not import" >&2; exit 1; }

step "GPU tests: pytest -m gpu"
timeout "$(lim 200)" $PY -m pytest -q -m gpu -p no:cacheprovider --junitxml="$RES/gpu_tests.xml" \
    tests/core tests/memory tests/transfer tests/reference tests/connectors/vllm/test_vllm_gpu_layouts.py 2>&1 \
    | tee "$RES/gpu_tests.log" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || fails+=("gpu tests")

step "transfer bandwidth, copy under compute, copy path calibration"
timeout "$(lim 120)" $PY benchmarks/bench_gpu_transfer.py --under-compute --calibrate \
    --json "$RES/transfer.json" || fails+=("bench_gpu_transfer")

step "TTFT on CUDA: Llama-8B KV shape (32 layers, 8 KV heads of 128, bf16), 16k tokens"
timeout "$(lim 180)" $PY benchmarks/bench_ttft.py --device cuda --model 8b-kv --tokens 16384 --reps 3 \
    --cold-reps 5 --interleave --suffixes "" --json "$RES/ttft.json" || fails+=("bench_ttft")
if [ "$DRY" = 1 ] && [ "$HAS_CUDA" != 1 ]; then
    echo "dry run: the same figures on the CPU, a tiny model (checks the report, not the GPU)"
    timeout "$(lim 200)" $PY benchmarks/bench_ttft.py --device cpu --tokens 512 --hidden 256 --layers 2 \
        --kv-heads 2 --heads 2 --reps 1 --interleave --suffixes "" --json "$RES/ttft.json" \
        || fails+=("bench_ttft (cpu)")
fi

step "pinned pool: bytes page-locked for the size asked"
timeout "$(lim 120)" $PY - "$RES/pool.json" "$DRY" <<'EOF' || fails+=("pinned pool")
import json, sys, time
import torch
from lmc.memory.pool import MemoryPool

out, dry = sys.argv[1], sys.argv[2] == "1"
asked = (5 << 30) + (1 << 20)  # torch's pinned allocator would page-lock 8 GiB for this
registrar = None
if not torch.cuda.is_available():
    asked = (64 << 20) + (1 << 20)

    class Counting:  # no CUDA: the pool's own code with a register call that only counts
        def register(self, addr, n): pass
        def unregister(self, addr): pass

    registrar = Counting()
    print("pinned pool: no CUDA device: cudaHostRegister skipped, a counting stand-in used")
t0 = time.perf_counter()
pool = MemoryPool(asked, "true", prefault="now", registrar=registrar)
secs = time.perf_counter() - t0
st = pool.stats()
pool.close()
pow2 = 1 << (asked - 1).bit_length()
res = {"asked": asked, "pinned": st["pinned_bytes"], "seconds": secs, "torch_would_pin": pow2,
       "real": registrar is None}
print(f"pinned pool: {st['pinned_bytes'] / 2**20:.0f} MiB page-locked for {asked / 2**20:.0f} "
      f"MiB asked in {secs:.2f} s (torch's allocator: {pow2 / 2**20:.0f} MiB)")
json.dump(res, open(out, "w"))
sys.exit(0 if st["pinned_bytes"] - asked < 2 << 20 else 1)
EOF

step "load or recompute on CUDA: the disk tier as it is, Llama-8B KV shape, 4k and 16k tokens"
timeout "$(lim 240)" $PY benchmarks/bench_load_or_recompute.py --device cuda --model 8b-kv \
    --tokens 4096,16384 --reps 3 --grid 8 --json "$RES/policy.json" \
    || fails+=("bench_load_or_recompute")
if [ "$DRY" = 1 ] && [ "$HAS_CUDA" != 1 ]; then
    if [ "$(id -u)" = 0 ] && command -v tc >/dev/null && command -v redis-server >/dev/null; then
        echo "dry run: the same figures on the CPU, a tiny model, Redis over a tc-shaped link"
        timeout "$(lim 240)" $PY benchmarks/bench_load_or_recompute.py --device cpu --tokens 256,512 \
            --hidden 256 --layers 2 --kv-heads 2 --heads 2 --reps 1 --grid 2 --settle 0.05 \
            --json "$RES/policy.json" || fails+=("bench_load_or_recompute (cpu)")
    else
        echo "dry run: the CPU stand-in of load or recompute needs root, tc and redis-server: skipped"
    fi
fi

step "launch-and-wait engine thread beside lmc's cold saves (the host's share of a GPU engine)"
if [ "$DRY" = 1 ]; then TICK=(--quick --rounds 2); else TICK=(); fi
timeout "$(lim 90)" $PY benchmarks/bench_launch_ticker.py --writes "${TICK[@]}" \
    --json "$RES/ticker.json" || fails+=("bench_launch_ticker")

step "a fresh engine behind a slow link (lmc server over tc): TTFT against the engine alone"
if [ "$(id -u)" = 0 ] && command -v tc >/dev/null && command -v ip >/dev/null; then
    if [ "$DRY" = 1 ]; then FRESH=(--tokens 512 --layers 2 --reps 1); else FRESH=(--reps 2); fi
    timeout "$(lim 150)" $PY benchmarks/bench_fresh_link.py "${FRESH[@]}" \
        --json "$RES/fresh.json" || fails+=("bench_fresh_link")
else
    echo "the fresh-engine link needs root, ip and tc: skipped"
fi

step "summary"
FAILS="${fails[*]:-}" $PY - "$RES" "$DRY" <<'EOF'
import datetime, json, os, sys, xml.etree.ElementTree as ET
from pathlib import Path

res, dry = Path(sys.argv[1]), sys.argv[2] == "1"
def load(name):
    p = res / name
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None

rows = []
try:
    suite = ET.parse(res / "gpu_tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    ok = "yes" if f + e == 0 and n - s > 0 else ("no CUDA: all skipped" if n == s else "NO")
    rows.append(("pytest -m gpu", f"{n - f - e - s} passed, {f + e} failed, {s} skipped", ok))
except (OSError, ET.ParseError, AttributeError):
    rows.append(("pytest -m gpu", "no report", "NO"))
device = "no CUDA device"
tr = load("transfer.json")
if tr:
    device = tr["device"]
    m = tr["memcpy_gib_s"]
    rows.append(("pinned memcpy D2H / H2D", f"{m['gather']:.1f} / {m['scatter']:.1f} GiB/s", ""))
    for r in tr["rows"]:
        slow = r.get("forward_slowdown")
        chosen = tr["choice"].get(f"{r['direction']}/{r['shape']}") == r["strategy"]
        rows.append((f"{r['direction']} {r['calls']} {r['strategy']}"
                     f"{' (chosen)' if chosen else ''}",
                     f"{r['ratio']:.2f} of memcpy"
                     + ("" if slow is None else f", forward {slow * 100:+.1f}%"),
                     ("yes" if r["ratio"] >= 0.9 else "NO") if chosen else ""))
    for d, v in tr.get("memcpy_forward_slowdown", {}).items():
        rows.append((f"plain memcpy {d} under compute", f"forward {v * 100:+.1f}%", ""))
else:
    rows.append(("transfer / copy under compute", "skipped (no CUDA device or CuPy)", ""))
tt = load("ttft.json")
if tt:
    if tt.get("device") == "cuda":
        device = tt.get("device_name", device)
    where = "" if tt.get("device") == "cuda" else " [CPU stand-in]"
    shape = (f"{tt['tokens']} tokens, {tt['layers']} layers, {tt['kv_heads']} KV heads of "
             f"{tt['head_dim']}, {tt['dtype']}, {tt['kv_mib']:.0f} MiB KV")
    rows.append((f"TTFT model{where}", shape, ""))
    for k, name in (("prefill_s", "full prefill"), ("lmc_cold_s", "lmc cold"),
                    ("l1_hit_s", "L1 hit"), ("disk_hit_s", "disk hit"),
                    ("ideal_s", "link-bound ideal (copy + one-token step)")):
        if tt.get(k) is not None:
            rows.append((f"TTFT {name}{where}", f"{tt[k] * 1e3:.1f} ms", ""))
    cold = tt.get("lmc_cold_reps") or []
    if len(cold) > 1:
        rows.append((f"lmc cold, first / next prompts{where}",
                     f"{cold[0] * 1e3:.1f} / " + " / ".join(f"{t * 1e3:.1f}" for t in cold[1:])
                     + " ms", ""))
    if tt.get("l1_hit_reps"):
        rows.append((f"L1 hits, in order{where}",
                     " / ".join(f"{t * 1e3:.1f}" for t in tt["l1_hit_reps"]) + " ms", ""))
    for what, key in (("cold", "lmc_cold_calls"), ("L1 hit", "l1_hit_calls")):
        runs = tt.get(key) or []
        if runs:  # on a GPU the reference engine is host-bound: this is TTFT lmc adds
            own = [{k: v for k, v in c.items() if not k.startswith("cpu.")} for c in runs]
            tot = [sum(c.values()) * 1e3 for c in own]
            top = max(own[0], key=own[0].get) if own[0] else "-"
            rows.append((f"engine thread in lmc's calls, {what} (first / next){where}",
                         " / ".join(f"{t:.1f}" for t in tot) + f" ms (first's largest: {top})",
                         ""))
    cpu_rows = [("engine alone", tt.get("prefill_cpu"))] + [
        (f"{what} {i + 1}", c) for what, key in (("cold", "lmc_cold_calls"),
                                                  ("L1 hit", "l1_hit_calls"))
        for i, c in enumerate((tt.get(key) or [])[:2])]
    cpu_txt = [f"{name} {c['cpu.engine_thread'] * 1e3:.0f}/{c['cpu.process'] * 1e3:.0f}"
               for name, c in cpu_rows if c and "cpu.engine_thread" in c]
    if cpu_txt:  # engine thread's CPU well under its wall time: it waited
        rows.append((f"CPU ms, engine thread / process{where}", ", ".join(cpu_txt), ""))
    if tt.get("l1_load_s") is not None:
        rows.append((f"L1 hit: I/O thread on loads / forward waited{where}",
                     f"{tt['l1_load_s'] * 1e3:.1f} / {tt['l1_wait_s'] * 1e3:.1f} ms", ""))
    paths = {k.removeprefix("copy_path."): v for k, v in tt.get("copy_stats", {}).items()
             if k.startswith("copy_path.")}
    if paths:
        rows.append(("copy paths in the TTFT run", ", ".join(f"{k} {v}"
                                                             for k, v in sorted(paths.items())),
                     ""))
    if tt.get("l1_vs_ideal"):
        rows.append((f"L1 hit / ideal{where}", f"{tt['l1_vs_ideal']:.2f}",
                     ("yes" if tt["l1_vs_ideal"] >= 0.9 else "NO") if not where else ""))
else:
    rows.append(("TTFT on CUDA", "skipped (no CUDA device)", ""))
pol = load("policy.json")
if pol:
    sys.path.insert(0, "benchmarks")
    from bench_load_or_recompute import verdicts

    where = "" if pol.get("device") == "cuda" else " [CPU stand-in]"
    for r in pol["rows"]:
        bar, ok = verdicts(r)
        rows.append((f"load or recompute, {r['tier']}, {r['tokens']} tokens{where}",
                     f"no cache {r['no_cache_s'] * 1e3:.0f} / load all "
                     f"{r['load_all_s'] * 1e3:.0f} / chosen {r['chosen_s'] * 1e3:.0f} "
                     f"({r['chosen_tokens']:.0f} loaded) / sweep best {r['best_s'] * 1e3:.0f} "
                     f"ms (N={r['best_n']}); {bar}", ok if not where else ""))
    sp = pol.get("speeds", {})
    if "speed.prefill.c1_s" in sp:  # what the rule believed of the compute (run 4: 0.46x)
        for n in sorted({r["tokens"] for r in pol["rows"]}):
            est = (sp["speed.prefill.c0_s"] + sp["speed.prefill.c1_s"] * n
                   + sp["speed.prefill.c2_s"] * n * n)
            meas = min(r["no_cache_s"] for r in pol["rows"] if r["tokens"] == n)
            rows.append((f"lmc's compute estimate / engine alone, {n} tokens{where}",
                         f"{est * 1e3:.0f} / {meas * 1e3:.0f} ms = {est / meas:.2f}", ""))
else:
    rows.append(("load or recompute on CUDA", "skipped (no CUDA device)", ""))
tick = load("ticker.json")
if tick:
    import statistics as st

    rr = tick["rounds"]
    lp = st.median(x["lmc"]["rate_per_s"] / x["plain"]["rate_per_s"] for x in rr)
    row = (f"{lp:.2f} of the rate beside plain copies (engine thread waits "
           f"{tick['wait_us']:.0f} us per op; {tick['prompts']} x {tick['tokens']} tokens)")
    if "plain_writes" in rr[0]:
        lw = st.median(x["lmc"]["rate_per_s"] / x["plain_writes"]["rate_per_s"] for x in rr)
        row += f", {lw:.2f} of beside copies + O_DIRECT writes"
    rows.append(("launch-and-wait ticker beside lmc saves", row, "yes" if lp >= 0.9 else "NO"))
fresh = load("fresh.json")
if fresh:
    for name, r in fresh["rows"].items():
        ratio = r["auto_s"] / r["alone_s"]
        rows.append((f"fresh engine, link {name} ({fresh['tokens']} tokens)",
                     f"lmc {r['auto_s'] * 1e3:.0f} ms (loaded {r['auto_cached']}) / alone "
                     f"{r['alone_s'] * 1e3:.0f} ms = {ratio:.2f}x; load_all "
                     f"{r['load_all_s'] / r['alone_s']:.2f}x", "yes" if ratio <= 1.25 else "NO"))
pool = load("pool.json")
if pool:
    tag = "" if pool["real"] else " [stand-in register]"
    rows.append((f"pinned pool{tag}", f"{pool['pinned'] / 2**20:.0f} MiB pinned for "
                 f"{pool['asked'] / 2**20:.0f} MiB asked in {pool['seconds']:.2f} s (torch: "
                 f"{pool['torch_would_pin'] / 2**20:.0f} MiB)",
                 "yes" if pool["pinned"] - pool["asked"] < 2 << 20 else "NO"))
fails = os.environ.get("FAILS", "").strip()
when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
lines = [f"## GPU check — `make gpu-check`, {device}, {when}", "",
         "| check | figure | target met |", "|---|---|---|"]
lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
lines += ["", f"Steps that failed: {fails}." if fails else "Every step ran.", ""]
text = "\n".join(lines)
print(text)
(res / "gpu_check_section.md").write_text(text + "\n")
if dry or device == "no CUDA device":
    print("(not appended to benchmarks/RESULTS.md: "
          + ("dry run)" if dry else "no CUDA device)"))
else:
    with open("benchmarks/RESULTS.md", "a") as f:
        f.write("\n" + text)
    print("appended to benchmarks/RESULTS.md")
EOF
echo "gpu_check: results in $RES ($(( $(date +%s) - T0 )) s)"
[ ${#fails[@]} = 0 ] || { echo "gpu_check: failed steps: ${fails[*]}" >&2; exit 1; }
