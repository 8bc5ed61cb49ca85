#!/usr/bin/env bash
# A cold prefill's save path on a lent GPU, by gather mode (issue 36's open question: is
# the staged device-to-host copy of a per-layer save what makes lmc cold 1.6x the engine
# alone?). 16,384 tokens of the 8B KV shape (2 GiB), L1 + disk, three cold prefills each:
#   1. the engine alone and lmc cold with the calibrated copy paths (printed);
#   2. lmc cold with every gather forced direct (the kernel writes pinned host memory);
#   3. lmc cold with every gather forced staged.
# About 3 minutes on an H200.   bash benchmarks/device_gather_modes.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
RES=${OUT:-$(mktemp -d -t lmc-gather.XXXXXX)}
B=($PY benchmarks/bench_ttft.py --device cuda --model 8b-kv --tokens 16384 --cold-only)
FAIL=0
echo "== calibrated paths"
timeout -k 5 90 "${B[@]}" --cold-reps 3 --json "$RES/calibrated.json" 2>&1 \
    | tee "$RES/calibrated.txt" || FAIL=1
for mode in direct staged; do
    echo "== gather forced $mode"
    LMC_CUDA_GATHER_MODE=$mode timeout -k 5 60 "${B[@]}" --cold-reps 3 --no-baseline \
        --json "$RES/$mode.json" 2>&1 | tee "$RES/$mode.txt" || FAIL=1
done
exit $FAIL
