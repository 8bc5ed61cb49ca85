"""What watching a load costs a fast tier (issue 36): a watched read beside the plain batch.

A load that watches itself (:mod:`lmc.storage.load_watch`) reads a lower tier in pieces so
it can stop; on a fast tier it must cost what the plain read costs. Each row stores one
prompt's chunks in a tier, then, interleaved rep by rep, fetches them through the storage
manager with L1 emptied before every fetch: once plain, once watched (a load watch whose
recompute estimate is long enough that it never stops, so the whole read is measured).

Rows: an ``lmc server`` on loopback (whole chunks over its 4 connections) and the disk tier
(O_DIRECT), both through ``fetch_prefix``; the disk tier layer by layer
(``fetch_prefix_layered``, timed until every chunk verified). Figure: median ms of each, the
watched one over the plain one (bar: <= 1.05).

    python benchmarks/bench_watched_read.py                  # 8 chunks of 4 MiB, 25 reps
    python benchmarks/bench_watched_read.py --chunks 32 --reps 10
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import lmc_daemon  # noqa: E402

from lmc import CacheConfig, CacheEngine, KVSpec  # noqa: E402
from lmc.storage.load_watch import LoadWatch  # noqa: E402

MiB = 1 << 20
BLOCK = 16
CHUNK = 256  # tokens; 16 KiB a token (4 layers, 8 KV heads of 64 float32): 4 MiB a chunk


def make_engine(n_tokens: int, extra: dict[str, Any]) -> tuple[CacheEngine, list[torch.Tensor]]:
    kv = [torch.randn(2, n_tokens // BLOCK + 8, BLOCK, 8, 64) for _ in range(4)]
    spec = KVSpec.from_tensors(kv, "vllm_flash", block_size=BLOCK)
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size=(n_tokens // CHUNK + 4) * 8 * MiB,
                      **extra)
    return CacheEngine(cfg, spec, "bench-watched-read"), kv


def never_stops(n: int) -> LoadWatch:
    """A watch that reads in pieces but never finds recomputing cheaper (a fast tier)."""
    return LoadWatch(lambda pos: 3600.0, positions=[CHUNK * i for i in range(n)])


def timed(eng: CacheEngine, keys: list, fetch: Callable[[], int]) -> float:
    eng.storage.l1.delete(keys)
    t0 = time.perf_counter()
    got = fetch()
    dt = time.perf_counter() - t0
    assert got == len(keys), f"fetched {got} of {len(keys)} chunks"
    return dt


def whole(eng: CacheEngine, keys: list, watch: bool) -> int:
    objs, _ = eng.storage.fetch_prefix(keys, never_stops(len(keys)) if watch else None)
    for o in objs:
        o.release()
    return len(objs)


def layered(eng: CacheEngine, keys: list, watch: bool) -> int:
    objs, _, gate = eng.storage.fetch_prefix_layered(keys,
                                                     never_stops(len(keys)) if watch else None)
    try:
        gate.wait_verified(timeout=120)
    finally:
        for o in objs:
            o.release()
    return len(objs)


def row(name: str, eng: CacheEngine, keys: list, read: Callable[..., int], reps: int
        ) -> dict[str, Any]:
    for w in (False, True):  # warm-up: connections, threads, first pool touches
        timed(eng, keys, lambda w=w: read(eng, keys, w))
    plain, watched = [], []
    for r in range(reps):
        order = (False, True) if r % 2 == 0 else (True, False)
        for w in order:
            dt = timed(eng, keys, lambda w=w: read(eng, keys, w))
            (watched if w else plain).append(dt)
    p, w = statistics.median(plain), statistics.median(watched)
    q = statistics.quantiles
    out = {"row": name, "plain_ms": p * 1e3, "watched_ms": w * 1e3, "ratio": w / p,
           "plain_iqr_ms": [x * 1e3 for x in q(plain, n=4)[::2]],
           "watched_iqr_ms": [x * 1e3 for x in q(watched, n=4)[::2]]}
    print(f"  {name:34s} plain {p * 1e3:7.1f} ms | watched {w * 1e3:7.1f} ms | ratio "
          f"{w / p:5.2f} (bar <= 1.05)", flush=True)
    return out


def prompt(eng: CacheEngine, kv: list[torch.Tensor], n: int, seed: int) -> list:
    toks = torch.randint(2, 100_000, (n,), generator=torch.Generator().manual_seed(seed))
    eng.store(toks, kv, torch.arange(n))
    assert eng.flush(120), "the lower tier did not take the chunks"
    return eng.db.keys(toks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 4 MiB per read")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    n = args.chunks * CHUNK
    rows = []
    work = Path(tempfile.mkdtemp(prefix="lmc-bench-watched-"))
    try:
        print(f"{args.chunks} chunks of 4 MiB, {args.reps} interleaved reps, median:")
        with lmc_daemon(4 << 30, work) as (url, _):
            eng, kv = make_engine(n, {"remote_url": url + "?ns=watched"})
            keys = prompt(eng, kv, n, 1)
            rows.append(row("lmc server (loopback), whole chunks", eng, keys, whole,
                            args.reps))
            eng.close()
        eng, kv = make_engine(n, {"local_disk": str(work / "disk"),
                                  "local_disk_size": f"{args.chunks * 8 + 64}MiB"})
        keys = prompt(eng, kv, n, 2)
        rows.append(row("disk, whole chunks", eng, keys, whole, args.reps))
        rows.append(row("disk, layer by layer", eng, keys, layered, args.reps))
        eng.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
