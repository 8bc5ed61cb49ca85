"""The copy-path calibration of this GPU, every figure (``lmc.transfer.cuda_copy``): seconds
per call of each (direction, shape, mode) alone, the slowdown each causes a concurrent
matmul forward, and the paths :func:`choose_paths` picks from them.

    python benchmarks/print_copy_paths.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lmc.transfer.cuda_copy import choose_paths, measure_paths  # noqa: E402


def main() -> int:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
