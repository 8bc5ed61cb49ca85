"""GPU KV transfer bandwidth: paged GPU cache <-> pinned host chunks, against a plain memcpy.

Measures, for a Llama-8B-like cache (32 layers, 8 KV heads, head 128, bf16, block 16):

  * gather  (paged GPU cache -> pinned host chunk buffers), all layers in one call, and
    layer by layer (one call per layer, as the connector's save path does);
  * scatter (pinned host chunk buffers -> paged GPU cache), the same two ways;

each with both strategies of ``CudaTransfer`` ("direct": the kernel reads/writes mapped pinned
memory; "staged": kernel into a device buffer + cudaMemcpyAsync), printed next to a plain
pinned ``cudaMemcpyAsync`` of the same bytes in the same direction, measured in the same run
(torch ``copy_(non_blocking=True)`` between a contiguous device tensor and a pinned host
tensor), as a ratio. Target: ratio >= 0.90. The last lines say which strategy won per
direction and whether ``lmc.cuda_transfer``'s defaults agree.

    python benchmarks/bench_gpu_transfer.py                  # 4096 tokens
    python benchmarks/bench_gpu_transfer.py --tokens 8192 --max-blocks 264
    python benchmarks/bench_gpu_transfer.py --json out.json

Without a CUDA device (or without CuPy) it prints why it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch

GiB = 2**30


def time_per_call(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Seconds per ``fn()``: CUDA events around ``iters`` back-to-back calls on the current
    stream (``fn`` must queue its work there), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def build(args):
    """Engine cache on the GPU, shuffled whole blocks for the slots, chunk views of one
    pinned pool (as lmc's allocator hands them out)."""
    from lmc.kv_spec import KVSpec

    bs, L, H, D = args.block_size, args.layers, args.heads, args.head_size
    nb = 2 * (-(-args.tokens // bs)) + 8
    spec = KVSpec(num_layers=L, num_kv_heads=H, head_size=D, dtype=torch.bfloat16,
                  block_size=bs, layout="vllm_flash", num_blocks=nb)
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = [torch.randn(spec.layer_shape(), generator=gen, device="cuda",
                          dtype=torch.bfloat16) for _ in range(L)]
    blocks = torch.randperm(nb, generator=gen, device="cuda")[: -(-args.tokens // bs)]
    slots = (blocks[:, None] * bs + torch.arange(bs, device="cuda")).flatten()[: args.tokens]
    ranges = [(s, min(s + args.chunk, args.tokens)) for s in range(0, args.tokens, args.chunk)]
    total = sum(spec.chunk_nbytes(e - s) for s, e in ranges)
    pool = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    bufs, off = [], 0
    for s, e in ranges:
        n = spec.chunk_nbytes(e - s)
        bufs.append(pool[off: off + n].view(spec.dtype).view(spec.chunk_shape(e - s)))
        off += n
    return spec, caches, slots, ranges, pool, bufs


def check(spec, caches, slots, ranges, bufs, tr_factory) -> None:
    """One gather and one scatter through ``tr_factory`` equal the torch path bit for bit."""
    from lmc.transfer import TorchTransfer

    ref = TorchTransfer(spec, caches)
    want = [torch.empty_like(b, device="cuda") for b in bufs]
    ref.gather(ref.plan(slots, ranges), want)
    tr = tr_factory(caches)
    tr.gather(tr.plan(slots, ranges), bufs)
    tr.synchronize()
    for i, (b, w) in enumerate(zip(bufs, want, strict=True)):
        if not torch.equal(b.view(torch.int16), w.cpu().view(torch.int16)):
            raise SystemExit(f"gather mismatch in chunk {i}: the benchmark numbers are void")
    fresh = [torch.zeros_like(c) for c in caches]
    tr2 = tr_factory(fresh)
    tr2.scatter(tr2.plan(slots, ranges), bufs)
    tr2.synchronize()
    back = TorchTransfer(spec, fresh)
    got = [torch.empty_like(b, device="cuda") for b in bufs]
    back.gather(back.plan(slots, ranges), got)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not torch.equal(g.view(torch.int16), w.view(torch.int16)):
            raise SystemExit(f"scatter mismatch in chunk {i}: the benchmark numbers are void")


def bench_memcpy(pool: torch.Tensor, iters: int, warmup: int) -> dict[str, float]:
    """The peer: one pinned cudaMemcpyAsync of all the bytes, each way (GiB/s)."""
    dev = torch.empty_like(pool, device="cuda")
    dev.copy_(pool)
    gib = pool.numel() / GiB
    return {
        "gather": gib / time_per_call(lambda: pool.copy_(dev, non_blocking=True), iters, warmup),
        "scatter": gib / time_per_call(lambda: dev.copy_(pool, non_blocking=True), iters, warmup),
    }


def bench_strategy(tr, slots, ranges, bufs, args) -> list[tuple[str, str, float]]:
    """(direction, calls, GiB/s) for all-layer and per-layer calls of one transfer object."""
    plan = tr.plan(slots, ranges)
    gib = sum(b.numel() * b.element_size() for b in bufs) / GiB
    n_layers = tr.spec.num_layers
    cases = {
        ("gather", "all layers"): lambda: tr.gather(plan, bufs),
        ("gather", "per layer"): lambda: [tr.gather(plan, bufs, [i]) for i in range(n_layers)],
        ("scatter", "all layers"): lambda: tr.scatter(plan, bufs),
        ("scatter", "per layer"): lambda: [tr.scatter(plan, bufs, [i]) for i in range(n_layers)],
    }
    return [(d, c, gib / time_per_call(fn, args.iters, args.warmup))
            for (d, c), fn in cases.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-blocks", type=int, default=None,
                    help="grid cap for the kernels (default: 4 per SM)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    from lmc import cuda_transfer as ct

    if not ct.cuda_kernels_available():
        print("CuPy is not importable (pip install lmc-kvcache[gpu]): skipped")
        return 0

    spec, caches, slots, ranges, pool, bufs = build(args)
    nbytes = pool.numel()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; {args.tokens} tokens x "
          f"{spec.num_layers} layers x {spec.num_planes} planes x {spec.row_width} bf16 = "
          f"{nbytes / GiB:.3f} GiB in {len(ranges)} chunks of {args.chunk}")

    memcpy = bench_memcpy(pool, args.iters, args.warmup)
    print(f"plain pinned cudaMemcpyAsync: D2H {memcpy['gather']:.2f} GiB/s, "
          f"H2D {memcpy['scatter']:.2f} GiB/s\n")
    print(f"  {'direction':9s} {'strategy':8s} {'calls':12s} {'GiB/s':>8s} "
          f"{'memcpy':>8s} {'ratio':>6s}")

    rows = []
    for mode in ct.MODES:
        def factory(c, mode=mode):
            return ct.CudaTransfer(spec, c, gather_mode=mode, scatter_mode=mode,
                                   max_blocks=args.max_blocks)
        check(spec, caches, slots, ranges, bufs, factory)
        for direction, calls, gibs in bench_strategy(factory(caches), slots, ranges, bufs, args):
            ratio = gibs / memcpy[direction]
            print(f"  {direction:9s} {mode:8s} {calls:12s} {gibs:8.2f} "
                  f"{memcpy[direction]:8.2f} {ratio:6.2f}{'' if ratio >= 0.9 else '  < 0.90'}")
            rows.append({"direction": direction, "strategy": mode, "calls": calls,
                         "gib_s": gibs, "memcpy_gib_s": memcpy[direction], "ratio": ratio})
    print()
    defaults = {"gather": ct.DEFAULT_GATHER_MODE, "scatter": ct.DEFAULT_SCATTER_MODE}
    for direction in ("gather", "scatter"):
        mine = [r for r in rows if r["direction"] == direction and r["calls"] == "all layers"]
        best = max(mine, key=lambda r: r["gib_s"])
        note = ("matches the default" if best["strategy"] == defaults[direction] else
                f"DIFFERS from DEFAULT_{direction.upper()}_MODE = {defaults[direction]!r}: "
                "flip it in lmc/cuda_transfer.py")
        print(f"fastest {direction}: {best['strategy']} ({best['ratio']:.2f} of memcpy), {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "bytes": nbytes, "rows": rows,
                       "memcpy_gib_s": memcpy}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
