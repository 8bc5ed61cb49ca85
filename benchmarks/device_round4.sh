#!/usr/bin/env bash
# The device checks of round 4's last session, in about 6 minutes on a lent H200 (16 cores):
#
#   1. pytest -m gpu: the codecs' device kernels give the CPU path's bytes (issue 37), the
#      CUDA transfer's per-layer calls, the pools and the cache engine's round trips;
#   2. bench_codecs_gpu.py: encode/decode on the device and the coded save/hit against the
#      raw PCIe copy (issue 37's "on a GPU when lent" figures) -> $OUT/codecs_gpu.txt;
#   3. bench_agent_replay.py: the agentic workload's bar (issue 39) on an unloaded 16-core
#      host, hints and plain -> $OUT/agent.txt.
# Each step is cut to what is left of the budget (DEV_BUDGET, default 420 s).
#
#   bash benchmarks/device_round4.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
RES=${OUT:-$(mktemp -d -t lmc-dev.XXXXXX)}
mkdir -p "$RES"
BUDGET=${DEV_BUDGET:-400}
T0=$(date +%s)
FAIL=0
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME LIMIT_S LOG CMD...: run within min(LIMIT_S, what is left)
    local name=$1 limit=$2 log=$3; shift 3
    local l; l=$(left)
    (( l < limit )) && limit=$l
    if (( limit < 15 )); then echo "== $name: skipped (${l}s left of ${BUDGET}s)"; return 0; fi
    echo "== $name (limit ${limit}s, $(( $(date +%s) - T0 ))s in)"
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$RES/$log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc after $(( $(date +%s) - T0 ))s"
    (( rc != 0 )) && FAIL=1
    return 0
}
$PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
nproc; uptime; date -u

step "gpu tests" 150 gpu_tests.txt $PY -m pytest -q -m gpu -p no:cacheprovider \
    tests/transfer tests/core/test_cache_engine.py tests/reference \
    tests/memory
step "codecs on the device" 60 codecs_gpu.txt $PY benchmarks/bench_codecs_gpu.py
step "agentic replay (issue 39)" 200 agent.txt $PY benchmarks/bench_agent_replay.py
echo "== done in $(( $(date +%s) - T0 ))s; results in $RES"; ls -l "$RES"
exit $FAIL
