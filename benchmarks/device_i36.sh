#!/usr/bin/env bash
# Issue 36 on a lent GPU, in about 150 s (H200, 16 cores): the GPU tests of what the
# gil-save branch changed, then the cold-prefill figure of RESULTS.md ("Cold prefill and
# first L1 hit on a GPU"), then, as long as time is left, two cold-only variants that say
# where a cold prefill's extra time goes:
#
#   1. pytest -m gpu: the CUDA transfer's layer-subset, random-shape and side-stream tests
#      (per-layer calls now reuse one table per plan), the warm-up at binding, the cache
#      engine's layer-wise round trip;
#   2. bench_ttft --device cuda --model 8b-kv --tokens 16384 (engine alone, lmc cold x3,
#      L1 hits, disk hit) -> $OUT/ttft.json; it now also prints the CPU seconds of every
#      thread and the garbage-collection passes of each cold prefill and L1 hit;
#   3. the same cold prefills with write_quiet_ms=50 (disk writes wait until the engine has
#      stopped saving) -> $OUT/ttft_quiet.json;
#   4. the same cold prefills with L1 alone (no disk tier, so no writes at all beside them)
#      -> $OUT/ttft_nodisk.json;
#   5. one cold prefill and one L1 hit whose engine thread is profiled (cProfile, top 30
#      calls: where a first hit's time goes) -> $OUT/ttft_profiled.json.
# Each step is cut to what is left of the budget (I36_BUDGET, default 150 s) and skipped
# when less than 15 s are left: the later steps are the optional ones.
#
# Run from the checkout (lmc from it: PYTHONPATH=$PWD; its C helpers built for another
# Python are not loaded, the pure-Python fallbacks are). Prints everything; exits non-zero
# if a step failed.
#
#   bash benchmarks/device_i36.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
RES=${OUT:-$(mktemp -d -t lmc-i36.XXXXXX)}
mkdir -p "$RES"
BUDGET=${I36_BUDGET:-150}
T0=$(date +%s)
FAIL=0
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME LIMIT_S CMD...: run within min(LIMIT_S, what is left)
    local name=$1 limit=$2; shift 2
    local l; l=$(left)
    (( l < limit )) && limit=$l
    if (( limit < 15 )); then echo "== $name: skipped (${l}s left of ${BUDGET}s)"; return 0; fi
    echo "== $name (limit ${limit}s, $(( $(date +%s) - T0 ))s in)"
    timeout -k 5 "$limit" "$@"
    local rc=$?
    echo "== $name: rc=$rc after $(( $(date +%s) - T0 ))s"
    (( rc != 0 )) && FAIL=1
    return 0
}
$PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
nproc; uptime

# the whole-model comparisons (test_gpu_matches_torch: all-layer calls, a path this branch
# leaves as it was) are left out for time; the per-layer ones, random shapes and side-stream
# events are the path that changed
step "gpu tests" 45 $PY -m pytest -q -m gpu -p no:cacheprovider -x \
    -k "not test_gpu_matches_torch" \
    tests/transfer/test_cuda_transfer.py tests/transfer/test_warm.py \
    tests/core/test_cache_engine.py
BENCH=(benchmarks/bench_ttft.py --device cuda --model 8b-kv --tokens 16384)
step "bench_ttft (the RESULTS.md figure)" 70 \
    $PY "${BENCH[@]}" --reps 2 --cold-reps 3 --suffixes "" --json "$RES/ttft.json"
step "cold prefills, write_quiet_ms=50" 30 \
    $PY "${BENCH[@]}" --cold-reps 3 --cold-only --no-baseline --write-quiet-ms 50 \
    --json "$RES/ttft_quiet.json"
step "cold prefills, L1 alone (no disk tier)" 30 \
    $PY "${BENCH[@]}" --cold-reps 3 --no-disk --no-baseline --json "$RES/ttft_nodisk.json"
step "first L1 hit, engine thread profiled" 30 \
    $PY "${BENCH[@]}" --cold-reps 1 --reps 1 --suffixes "" --no-baseline --profile-first-hit \
    --json "$RES/ttft_profiled.json"
echo "== done in $(( $(date +%s) - T0 ))s; results in $RES"; ls -l "$RES"
exit $FAIL
