"""KV codecs on a CUDA device (``lmc/storage/kvcodecs/cuda.py``) against PCIe, in one run.

A codec pays on a GPU host when coding on the device and moving the coded bytes beats moving
the raw chunk: a save is encode + device-to-host of the codes, a hit is host-to-device of the
codes + decode, each against the plain copy of the raw chunk (pinned host memory, the same
stream). For each codec and two chunk geometries -- SmolLM2-135M (30 layers, 3 KV heads of 64)
and a Llama-8B KV shape (32 layers, 8 KV heads of 128), 256 tokens, bf16 -- it prints encode
and decode GiB/s of raw KV (device time, CUDA events), the raw copy's GiB/s each way, and the
coded save and hit as GiB/s of raw KV delivered and as a ratio to the raw copy. Each coded
chunk is first checked bit for bit against the CPU path's bytes.

    python benchmarks/bench_codecs_gpu.py [--reps 20] [--chunks 8]

Needs a CUDA device and CuPy (the kernels compile at run time through NVRTC).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmc.storage.kvcodecs import cuda as cuda_codecs  # noqa: E402
from lmc.storage.kvcodecs.stage import parse_stage  # noqa: E402

GEOMETRIES = {"smollm2-135m": (30, 2, 256, 3 * 64, 64), "8b-kv": (32, 2, 256, 8 * 128, 128)}
CODECS = ["fp8-e4m3", "int8", "int4-kivi"]
GIB = float(1 << 30)


def kv_chunk(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A KV-like bf16 chunk on the CPU: keys with outlier channels, values plain."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[:, 0, :, ::16] *= 12
    return x.to(torch.bfloat16)


def device_rate(nbytes: int, fn: Callable[[], None], reps: int) -> float:
    """GiB/s of ``nbytes`` per call of ``fn`` on the current stream, median of ``reps``
    (CUDA events; one warm-up call first: the kernels' compile is not timed)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return nbytes / max(statistics.median(times), 1e-9) / GIB


def codec_row(cname: str, head: int, host: list[torch.Tensor], dev: list[torch.Tensor],
              reps: int, d2h: float, h2d: float, geo_name: str) -> str:
    """One codec's table row on these chunks (``host`` pinned, ``dev`` their device copies)."""
    codec = parse_stage(cname, head_size=head).codec
    shape = tuple(host[0].shape)
    raw_one = host[0].numel() * host[0].element_size()
    raw = raw_one * len(host)
    n = codec.encoded_bytes(shape)
    want = torch.zeros(n, dtype=torch.uint8)
    codec.encode(host[0], want)
    codes = [torch.zeros(n, dtype=torch.uint8, device="cuda") for _ in dev]
    cuda_codecs.encode(codec, dev[0], codes[0])
    if not torch.equal(codes[0].cpu(), want):
        raise SystemExit(f"{cname} on {geo_name}: the device's codes differ from the CPU path's")
    host_codes = [torch.empty(n, dtype=torch.uint8).pin_memory() for _ in dev]
    outs = [torch.empty_like(d) for d in dev]

    def enc() -> None:
        for d, c in zip(dev, codes):
            cuda_codecs.encode(codec, d, c)

    def dec() -> None:
        for c, o in zip(codes, outs):
            cuda_codecs.decode(codec, c, o)

    def save() -> None:
        for d, c, h in zip(dev, codes, host_codes):
            cuda_codecs.encode(codec, d, c)
            h.copy_(c, non_blocking=True)

    def hit() -> None:
        for h, c, o in zip(host_codes, codes, outs):
            c.copy_(h, non_blocking=True)
            cuda_codecs.decode(codec, c, o)

    e, dcd = device_rate(raw, enc, reps), device_rate(raw, dec, reps)
    s, hi = device_rate(raw, save, reps), device_rate(raw, hit, reps)
    return (f"| {cname} | {n / raw_one:.3f} | {e:.1f} | {dcd:.1f} | {s:.1f} ({s / d2h:.2f}x) "
            f"| {hi:.1f} ({hi / h2d:.2f}x) |")


def run_geometry(name: str, geo: tuple[int, ...], chunks: int, reps: int) -> list[str]:
    *shape, head = geo
    shape_t = tuple(shape)
    host = [kv_chunk(shape_t, i).pin_memory() for i in range(chunks)]
    dev = [h.cuda() for h in host]
    raw_one = host[0].numel() * host[0].element_size()
    raw = raw_one * chunks
    back = [torch.empty_like(h).pin_memory() for h in host]
    d2h = device_rate(raw, lambda: [b.copy_(d, non_blocking=True) for b, d in zip(back, dev)],
                      reps)
    h2d = device_rate(raw, lambda: [d.copy_(h, non_blocking=True) for d, h in zip(dev, host)],
                      reps)
    rows = [f"\n{name}: {chunks} chunks of {raw_one / 2**20:.1f} MiB {shape_t} bf16; raw copy "
            f"device-to-host {d2h:.1f} GiB/s, host-to-device {h2d:.1f} GiB/s (pinned)",
            "| codec | of bf16 | encode GiB/s | decode GiB/s | save: encode + D2H codes "
            "GiB/s (vs raw D2H) | hit: H2D codes + decode GiB/s (vs raw H2D) |",
            "|---|---:|---:|---:|---:|---:|"]
    for cname in CODECS:
        rows.append(codec_row(cname, head, host, dev, reps, d2h, h2d, name))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device (and CuPy)", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__} CUDA {torch.version.cuda}")
    for name, geo in GEOMETRIES.items():
        print("\n".join(run_geometry(name, geo, args.chunks, args.reps)))
    print("(GiB/s of raw bf16 KV; the save's encode includes its non-finite check, a "
          "one-int device-to-host read per chunk)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
