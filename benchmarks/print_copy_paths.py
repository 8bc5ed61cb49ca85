"""The copy-path calibration of this GPU, every figure (``lmc.transfer.cuda_copy``): seconds
per call of each (direction, shape, mode) alone, the slowdown each causes a concurrent
matmul forward, and the paths :func:`choose_paths` picks from them; with ``--grids``, the
per-layer gathers (a cold prefill's saves) again under each grid cap (thread blocks): how
few SMs a save needs to run at link rate, and how much less it then slows the forward.

    python benchmarks/print_copy_paths.py [--grids 16,33,66,132]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lmc.transfer.cuda_copy import choose_paths, measure_paths  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grids", default="", help="gather grid caps to sweep, comma-separated")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name())
    timings = measure_paths(0)
    print("| direction | shape | mode | ms per call | forward slowdown |")
    print("|---|---|---|---:|---:|")
    for (d, s, m), t in sorted(timings.items()):
        slow = "-" if t.slowdown is None else f"{t.slowdown * 100:+.0f}%"
        print(f"| {d} | {s} | {m} | {t.seconds * 1e3:.3f} | {slow} |")
    print("chosen:", {f"{d}.{s}": m for (d, s), m in choose_paths(timings).items()})
    if args.grids:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"\nper-layer gathers by grid cap ({sms} SMs; default cap {4 * sms})")
        print("| blocks | mode | ms per call | forward slowdown |")
        print("|---:|---|---:|---:|")
        for g in (int(x) for x in args.grids.split(",")):
            t = measure_paths(0, gather_blocks=g)
            for m in ("direct", "staged"):
                p = t[("gather", "per_layer", m)]
                slow = "-" if p.slowdown is None else f"{p.slowdown * 100:+.0f}%"
                print(f"| {g} | {m} | {p.seconds * 1e3:.3f} | {slow} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
