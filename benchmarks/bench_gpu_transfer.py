"""GPU KV transfer bandwidth: paged GPU cache <-> pinned host chunks, against a plain memcpy.

Measures, for a Llama-8B-like cache (32 layers, 8 KV heads, head 128, bf16, block 16):

  * gather  (paged GPU cache -> pinned host chunk buffers), all layers in one call, and
    layer by layer (one call per layer, as the connector's save path does);
  * scatter (pinned host chunk buffers -> paged GPU cache), the same two ways;

each with both strategies of ``CudaTransfer`` ("direct": the kernel reads/writes mapped pinned
memory; "staged": kernel into a device buffer + cudaMemcpyAsync), printed next to a plain
pinned ``cudaMemcpyAsync`` of the same bytes in the same direction, measured in the same run
(torch ``copy_(non_blocking=True)`` between a contiguous device tensor and a pinned host
tensor), as a ratio. Target: ratio >= 0.90. The chunk buffers are objects of lmc's own
pinned pool (mapped by lmc, page-locked with cudaHostRegister: ``lmc.memory.prefault.Pinner``).

**Copy under compute** (``--under-compute``): how much longer a matmul-heavy forward (a chain
of bf16 4096x4096 matmuls, a prefill's kind of work) takes while each path copies on a side
stream, next to a plain memcpy's (copy engines only) -- the kernel paths take SMs from the
model. The last lines say which path wins per (direction, call shape) by
``lmc.transfer.cuda_copy.choose_paths`` (faster; within 5%, the gentler) and whether this
device's calibration (``device_paths``) agrees; ``--calibrate`` records these figures as the
device's calibration (``~/.cache/lmc/copy_paths.json``).

    python benchmarks/bench_gpu_transfer.py                  # 4096 tokens
    python benchmarks/bench_gpu_transfer.py --tokens 8192 --max-blocks 264
    python benchmarks/bench_gpu_transfer.py --under-compute --calibrate --json out.json

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
    """Seconds per ``fn()`` on the current stream (lmc's own event timing), after ``warmup``
    calls."""
    from lmc.transfer.cuda_copy import time_on_stream

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return time_on_stream(fn, iters)


def build(args):
    """Engine cache on the GPU, shuffled whole blocks for the slots, chunk views of one
    pinned pool (as lmc's allocator hands them out)."""
    from lmc.transfer.kv_spec import KVSpec

    bs, L, H, D = args.block_size, args.layers, args.heads, args.head_size
    nb = 2 * (-(-args.tokens // bs)) + 8
    spec = KVSpec(num_layers=L, num_kv_heads=H, head_size=D, dtype=torch.bfloat16,
                  block_size=bs, layout="vllm_flash", num_blocks=nb)
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = [torch.randn(spec.layer_shape(), generator=gen, device="cuda",
                          dtype=torch.bfloat16) for _ in range(L)]
    blocks = torch.randperm(nb, generator=gen, device="cuda")[: -(-args.tokens // bs)]
    slots = (blocks[:, None] * bs + torch.arange(bs, device="cuda")).flatten()[: args.tokens]
    # host slots, as lmc's connectors pass them: device slots are never read back, so a
    # staged gather must first load every chunk's staging area (any row may be a hole)
    # and moves the bytes twice (staged gather at 0.49 of memcpy on an H100)
    slots = slots.cpu()
    ranges = [(s, min(s + args.chunk, args.tokens)) for s in range(0, args.tokens, args.chunk)]
    total = sum(spec.chunk_nbytes(e - s) for s, e in ranges)
    from lmc.memory.pool import MemoryPool

    pool = MemoryPool(total + (4 << 20), "true", prefault="now")  # lmc's pinned pool
    objs = [pool.allocate(spec.chunk_shape(e - s), spec.dtype) for s, e in ranges]
    if any(o is None for o in objs):
        raise SystemExit("the chunk buffers did not fit the pool")
    bufs = [o.tensor for o in objs]
    return spec, caches, slots, ranges, (pool, objs, total), bufs


def check(spec, caches, slots, ranges, bufs, tr_factory) -> None:
    """One gather and one scatter through ``tr_factory`` equal the torch path bit for bit."""
    from lmc.transfer.torch_copy import TorchTransfer

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


def memcpy_calls(host: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The peer: one pinned cudaMemcpyAsync of all the bytes, each way."""
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host)
    return {"gather": lambda: host.copy_(dev, non_blocking=True),
            "scatter": lambda: dev.copy_(host, non_blocking=True)}


def bench_memcpy(host: torch.Tensor, iters: int, warmup: int) -> dict[str, float]:
    """GiB/s of :func:`memcpy_calls`, each way."""
    gib = host.numel() / GiB
    return {d: gib / time_per_call(fn, iters, warmup) for d, fn in memcpy_calls(host).items()}


SHAPE_NAMES = {"all_layers": "all layers", "per_layer": "per layer"}


def strategy_calls(tr, slots, ranges, bufs) -> dict[tuple[str, str], Callable[[], object]]:
    """(direction, shape) -> one pass over every layer: one all-layer call, or one call per
    layer (as the layer-wise save and load paths do)."""
    plan = tr.plan(slots, ranges)
    n_layers = tr.spec.num_layers
    return {
        ("gather", "all_layers"): lambda: tr.gather(plan, bufs),
        ("gather", "per_layer"): lambda: [tr.gather(plan, bufs, [i]) for i in range(n_layers)],
        ("scatter", "all_layers"): lambda: tr.scatter(plan, bufs),
        ("scatter", "per_layer"): lambda: [tr.scatter(plan, bufs, [i])
                                           for i in range(n_layers)],
    }


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
    ap.add_argument("--under-compute", action="store_true",
                    help="also measure each path's slowdown of a concurrent forward")
    ap.add_argument("--calibrate", action="store_true",
                    help="record the figures as this device's copy path calibration")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_gpu_transfer: no CUDA device on this machine: skipped")
        return 0
    from lmc.transfer import cuda_copy as ct

    if not ct.cuda_kernels_available():
        print("bench_gpu_transfer: CuPy is not importable (pip install lmc-kvcache[gpu]): "
              "skipped")
        return 0

    spec, caches, slots, ranges, (pool, objs, nbytes), bufs = build(args)
    props = torch.cuda.get_device_properties(0)
    pst = pool.stats()
    print(f"{props.name}, {props.multi_processor_count} SMs; {args.tokens} tokens x "
          f"{spec.num_layers} layers x {spec.num_planes} planes x {spec.row_width} bf16 = "
          f"{nbytes / GiB:.3f} GiB in {len(ranges)} chunks of {args.chunk}; lmc pinned pool "
          f"{pst['pinned_bytes'] / 2**20:.0f} MiB page-locked for {pst['pinned_asked'] / 2**20:.0f}"
          " MiB asked")

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    memcpy = bench_memcpy(host, args.iters, args.warmup)
    print(f"plain pinned cudaMemcpyAsync: D2H {memcpy['gather']:.2f} GiB/s, "
          f"H2D {memcpy['scatter']:.2f} GiB/s\n")
    mem_slow = {}
    if args.under_compute:
        for d, fn in memcpy_calls(host).items():
            secs = nbytes / GiB / memcpy[d]
            mem_slow[d] = ct.forward_slowdown(fn, secs, 0)
        print("forward slowed by a concurrent plain memcpy: "
              + ", ".join(f"{d} {v * 100:+.1f}%" for d, v in mem_slow.items()) + "\n")
    print(f"  {'direction':9s} {'strategy':8s} {'calls':12s} {'GiB/s':>8s} "
          f"{'memcpy':>8s} {'ratio':>6s}{'  forward slowed' if args.under_compute else ''}")

    rows, timings = [], {}
    gib = nbytes / GiB
    for mode in ct.MODES:
        def factory(c, mode=mode):
            return ct.CudaTransfer(spec, c, gather_mode=mode, scatter_mode=mode,
                                   max_blocks=args.max_blocks)
        check(spec, caches, slots, ranges, bufs, factory)
        for (direction, shape), fn in strategy_calls(factory(caches), slots, ranges,
                                                     bufs).items():
            secs = time_per_call(fn, args.iters, args.warmup)
            slow = ct.forward_slowdown(fn, secs, 0) if args.under_compute else None
            timings[(direction, shape, mode)] = ct.PathTiming(secs, slow)
            gibs = gib / secs
            ratio = gibs / memcpy[direction]
            extra = "" if slow is None else f"  {slow * 100:+14.1f}%"
            print(f"  {direction:9s} {mode:8s} {SHAPE_NAMES[shape]:12s} {gibs:8.2f} "
                  f"{memcpy[direction]:8.2f} {ratio:6.2f}{extra}"
                  f"{'' if ratio >= 0.9 else '  < 0.90'}")
            rows.append({"direction": direction, "strategy": mode, "calls": SHAPE_NAMES[shape],
                         "shape": shape, "gib_s": gibs, "memcpy_gib_s": memcpy[direction],
                         "ratio": ratio, "forward_slowdown": slow})
    print()
    choice = ct.choose_paths(timings)
    cached = ct.load_paths(props.name)
    for (direction, shape), mode in sorted(choice.items()):
        r = next(x for x in rows if (x["direction"], x["shape"], x["strategy"])
                 == (direction, shape, mode))
        was = (cached or ct.DEFAULT_PATHS)[(direction, shape)]
        note = "agrees" if was == mode else f"DIFFERS ({was!r})"
        print(f"best {direction} {SHAPE_NAMES[shape]}: {mode} ({r['ratio']:.2f} of memcpy); "
              f"{'calibration' if cached else 'default'} {note}")
    if args.calibrate:
        ct.save_paths(props.name, choice, timings)
        print(f"recorded as the calibration of {props.name} in {ct.paths_cache_file()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "bytes": nbytes, "rows": rows,
                       "memcpy_gib_s": memcpy, "memcpy_forward_slowdown": mem_slow,
                       "choice": {f"{d}/{s}": m for (d, s), m in choice.items()},
                       "pool_pinned_bytes": pst["pinned_bytes"],
                       "pool_asked_bytes": pst["pinned_asked"]}, f, indent=2)
    for o in objs:
        o.release()
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
