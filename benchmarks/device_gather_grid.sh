#!/usr/bin/env bash
# Does a save need every SM? On a lent GPU (about 2.5 minutes on an H200):
#   1. print_copy_paths.py --grids: the calibration's figures, then per-layer gathers under
#      grid caps of 8..132 thread blocks (speed alone, slowdown of a concurrent forward);
#   2. bench_ttft cold prefills (16,384 tokens, 8B KV shape, 2 GiB, L1 + disk), gathers
#      forced direct, under the default grid cap and two smaller ones, each with the engine
#      alone measured in the same process.
#   bash benchmarks/device_gather_grid.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
RES=${OUT:-$(mktemp -d -t lmc-grid.XXXXXX)}
FAIL=0
timeout -k 5 70 $PY benchmarks/print_copy_paths.py --grids 8,16,33,66,132 2>&1 \
    | tee "$RES/paths.txt" || FAIL=1
for g in default 66 33; do
    echo "== cold prefill, gathers direct, grid cap $g"
    if [ "$g" = default ]; then unset LMC_CUDA_GATHER_BLOCKS; else export LMC_CUDA_GATHER_BLOCKS=$g; fi
    LMC_CUDA_GATHER_MODE=direct timeout -k 5 55 $PY benchmarks/bench_ttft.py --device cuda \
        --model 8b-kv --tokens 16384 --cold-only --cold-reps 3 --json "$RES/cold_$g.json" 2>&1 \
        | grep -E "^\| (full|lmc)|^lmc cold:|^CPU by thread|inside lmc" | tee "$RES/cold_$g.txt" || FAIL=1
done
exit $FAIL
