"""KV codecs on the CPU against the tier they read from, in one run.

For each codec (``lmc.storage.kvcodecs``), on chunks of the real model's geometry
(SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64, bf16, 256 tokens: 5.6 MiB a chunk):
bytes stored per token, encode and decode speed (raw KV bytes per second, one chunk at a
time as the tier does), and a disk hit end to end -- the same chunks read back through the
disk tier (O_DIRECT, page cache bypassed) with and without the codec -- next to a plain
O_DIRECT read of the raw chunks and a memcpy of the same bytes. A codec never slows a hit when
its decode outruns the tier's read of the raw bytes, i.e. when the coded hit is faster.

    python benchmarks/bench_codecs.py [--chunks 24] [--reps 3] [--dir /var/tmp]

Figures are medians of ``--reps``. Encode, decode and memcpy are timed in this thread's CPU
time (one core's speed, whatever else the machine runs: on a shared 2-core machine at load 15
wall time measures the queue, not the code); the disk hits in wall time, as a request waits.
Speeds are of raw KV bytes (what the engine gets).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.tier import create_backend

LAYERS, PLANES, HEADS, DIM, TOKENS = 30, 2, 3, 64, 256
SHAPE = (LAYERS, PLANES, TOKENS, HEADS * DIM)
CODECS = ["fp8-e4m3", "int8", "int4-kivi", "int4-kivi+zstd", "int4-kivi+lz4", "exact+zstd"]
GIB = float(1 << 30)
CPU = time.thread_time


def kv_chunks(n: int) -> list[torch.Tensor]:
    """KV-like bf16 chunks: keys with outlier channels, values plain."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(SHAPE, generator=g)
        x[:, 0, :, ::16] *= 12
        out.append(x.to(torch.bfloat16))
    return out


def median_rate(nbytes: int, fn, reps: int, clock=time.perf_counter) -> float:
    """GiB/s of ``nbytes`` per call of ``fn``, median of ``reps``: wall time (``perf_counter``)
    or this thread's CPU time (``thread_time``: what one core gives, whatever else runs)."""
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return nbytes / max(statistics.median(times), 1e-9) / GIB


def tier_rates(path: str, codec: str | None, chunks: list[torch.Tensor], reps: int
               ) -> tuple[float, int]:
    """GiB/s of raw KV a get of every chunk gives back (the tier's own read), and the bytes
    the tier holds."""
    raw = sum(c.numel() * c.element_size() for c in chunks)
    pool = MemoryPool(3 * raw + (64 << 20), pin_memory="false")
    cfg = CacheConfig(local_disk=path, local_disk_size="16GiB")
    tier = create_backend("disk", cfg, pool)
    if codec is not None:
        tier = create_backend("codec", cfg, pool, inner=tier, codec=codec, gate="off")
    keys = [i.to_bytes(16, "little") for i in range(len(chunks))]
    try:
        objs = pool.allocate_many(SHAPE, torch.bfloat16, len(chunks), TOKENS)
        for o, c in zip(objs, chunks):
            o.tensor.copy_(c)
        assert tier.put(keys, objs) == len(keys)
        for o in objs:
            o.release()
        stored = int(tier.stats().get("used_bytes", raw))

        def get() -> None:
            got = tier.get(keys)
            assert all(o is not None for o in got)
            for o in got:
                o.release()

        return median_rate(raw, get, reps), stored
    finally:
        tier.close()
        pool.close()


def codec_rates(name: str, chunks: list[torch.Tensor], reps: int
                ) -> tuple[float, float, float, float]:
    """Bytes per token, the share of bf16 stored, encode and decode GiB/s of raw KV."""
    from lmc.storage.kvcodecs.stage import parse_stage

    stage = parse_stage(name, head_size=DIM)
    raw = sum(c.numel() * 2 for c in chunks)
    coded = [stage.encode(c) for c in chunks]
    stored = sum(c.stored_len for c in coded)
    enc = median_rate(raw, lambda: [stage.encode(c) for c in chunks], reps, CPU)
    outs = [torch.empty_like(c) for c in chunks]

    def dec() -> None:
        for c, o in zip(coded, outs):
            stage.decode(c.method, c.lossless, c.body, c.body_len, o)

    return stored / len(chunks) / TOKENS, stored / raw, enc, median_rate(raw, dec, reps, CPU)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the disk tier writes (default: /tmp)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (the codecs' kernels use one; so does memcpy here)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    chunks = kv_chunks(args.chunks)
    one = chunks[0].numel() * 2
    raw = one * len(chunks)
    dsts = [torch.empty_like(c) for c in chunks]
    copy = median_rate(raw, lambda: [d.copy_(c) for d, c in zip(dsts, chunks)], args.reps, CPU)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        disk, _ = tier_rates(d + "/plain", None, chunks, args.reps)
        print(f"{args.chunks} chunks of {one / 2**20:.1f} MiB ({SHAPE} bf16), torch threads "
              f"{torch.get_num_threads()}")
        print(f"memcpy {copy:.2f} GiB/s (CPU time); disk tier get (O_DIRECT, wall), raw chunks "
              f"{disk:.2f} GiB/s")
        print("| codec | bytes/token | of bf16 | encode GiB/s (CPU) | decode GiB/s (CPU) | "
              "disk hit GiB/s (wall) | vs plain disk hit |")
        print("|---|---|---|---|---|---|---|")
        for name in CODECS:
            per_token, share, enc, dec = codec_rates(name, chunks, args.reps)
            hit, _ = tier_rates(f"{d}/{name}", name, chunks, args.reps)
            print(f"| {name} | {per_token:.0f} B | {share:.3f} | {enc:.2f} | {dec:.2f} | "
                  f"{hit:.2f} | {hit / disk:.2f}x |")
        print(f"(bf16: {one / TOKENS:.0f} B/token)")


if __name__ == "__main__":
    main()
