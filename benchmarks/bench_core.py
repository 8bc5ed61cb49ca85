"""Core data path benchmark: hashing, CPU-tier store/retrieve bandwidth, per-chunk overhead.

Every figure is printed next to its limit measured in the same run, as a ratio:
  * chunk keys vs a bare xxh3_128 chain over the same bytes;
  * paged store (engine cache -> pool) and retrieve (pool -> engine cache) vs a one-thread
    torch copy of the same number of bytes (torch runs with one thread throughout), each
    repetition paired with a copy taken right after it; the ratio is the median of the pairs;
  * engine overhead per chunk = (engine call - time inside its gather/scatter) / chunks,
    measured inside the same calls: hashing, lookup, allocation, planning, bookkeeping;
  * first fill: the first stores into a fresh engine's pool (pre-fault off, at start-up,
    after ready, and LMCache's way of zero-filling the pool before serving) vs a one-thread
    copy of the same bytes, and the seconds spent before serving (target >= 0.7x after ready).

    python benchmarks/bench_core.py            # full sizes (~1 minute)
    python benchmarks/bench_core.py --quick    # smaller sizes, for the demo / smoke runs
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from lmc import CacheConfig, CacheEngine, KVSpec
from lmc import token_database as tdb
from lmc.token_database import ChunkedTokenDatabase

GiB = 2**30


def median_time(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None
                ) -> float:
    times = []
    for _ in range(reps + 1):  # the first run warms caches and page tables
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def row(name: str, value: float, unit: str, limit: float, limit_name: str, target: str,
        ratio: float | None = None) -> dict:
    if ratio is None:
        ratio = value / limit if limit else float("nan")
    print(f"  {name:34s} {value:10.2f} {unit:8s} | {limit_name:28s} {limit:9.2f} | "
          f"ratio {ratio:6.2f}  (target {target})")
    return {"name": name, "value": value, "unit": unit, "limit": limit,
            "limit_name": limit_name, "ratio": ratio, "target": target}


# -------------------------------------------------------------------- lookup
def bench_lookup(n_tokens: int, reps: int) -> list[dict]:
    """A stored prompt looked up again and again (tensor input), plain and pinned (each
    pinned call replaces the last one's pins, as a scheduler re-asking does): the mean rate
    over every call, garbage collections included, against the median call (none), and
    the collections per 100 calls. lmc's calls on the engine's thread must not allocate
    enough GC-tracked objects to set collections off (issue 36: one call in five paid a
    2.6 ms collection, 687 -> 426 Mtok/s)."""
    import gc

    layers, bs = 2, 16
    kv = [torch.zeros(2, n_tokens // bs + 8, bs, 1, 8) for _ in range(layers)]
    spec = KVSpec.from_tensors(kv, "vllm_flash", block_size=bs)
    eng = CacheEngine(CacheConfig(chunk_size=256, local_cpu_size=64 << 20), spec, "bench-lookup")
    eng.pool.wait_ready()
    toks = torch.randint(2, 100_000, (n_tokens,), generator=torch.Generator().manual_seed(5))
    eng.store(toks, kv, torch.arange(n_tokens))
    collections = [0]

    def counted(phase: str, info: dict) -> None:
        collections[0] += phase == "start"

    out = []
    for label, call in (("plain", lambda: eng.lookup(toks)),
                        ("pinned", lambda: eng.lookup(toks, pin=True))):
        assert call() == n_tokens
        times = []
        gc.callbacks.append(counted)
        collections[0] = 0
        try:
            for _ in range(reps):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
        finally:
            gc.callbacks.remove(counted)
        mean = n_tokens / statistics.mean(times) / 1e6
        med = n_tokens / statistics.median(times) / 1e6
        out.append(row(f"lookup {n_tokens // 1024}k tensor, {label}", mean, "Mtok/s", med,
                       "median call", "ratio >= 0.9"))
        print(f"    {100 * collections[0] / reps:.1f} garbage collections per 100 calls")
        out[-1]["collections_per_100"] = 100 * collections[0] / reps
    eng.unpin(toks)
    eng.close()
    return out


# ------------------------------------------------------------------- hashing
def bench_hashing(n_tokens: int, reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 150_000, n_tokens, dtype=np.int64)
    db = ChunkedTokenDatabase(256, True, b"\x01" * 16)
    as_list = [int(x) for x in base]
    as_tensor = torch.from_numpy(base.copy())

    def bare_chain() -> None:
        data = base.astype("<u4").tobytes()  # fresh bytes: CPython caches hashes of bytes
        mv = memoryview(data)
        prev = b"\x01" * 16
        for off in range(0, len(data), 1024):
            prev = xxhash.xxh3_128_digest(prev + mv[off: off + 1024])

    t_bare = median_time(bare_chain, reps)
    t_tensor = median_time(lambda: db.keys(as_tensor), reps)
    t_list = median_time(lambda: db.keys(list(as_list)), reps)
    t_copy = median_time(lambda: list(as_list), reps)  # the list copy is not ours to count
    bare = n_tokens / t_bare / 1e6
    native = "C helper" if tdb._native_u32le is not None else "pure Python (C helper not built)"
    print(f"Chunk keys, {n_tokens} tokens, chunk 256 (M tokens/s; list packing: {native})")
    return [
        row(f"keys, int64 tensor, {n_tokens // 1024}k", n_tokens / t_tensor / 1e6, "Mtok/s",
            bare, "bare xxh3_128 chain", ">= 150 Mtok/s"),
        row(f"keys, Python list, {n_tokens // 1024}k", n_tokens / max(t_list - t_copy, 1e-9)
            / 1e6, "Mtok/s", bare, "bare xxh3_128 chain", "ratio >= 0.5"),
    ]


# ------------------------------------------------------------ CPU-tier paged
def _paged_cache(layers: int, heads: int, dim: int, blocks: int, bs: int, dtype) -> list:
    return [torch.randn(2, blocks, bs, heads, dim).to(dtype) for _ in range(layers)]


def _shuffled_slots(n: int, blocks: int, bs: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(blocks, generator=g)[: -(-n // bs)]
    return (perm[:, None] * bs + torch.arange(bs)).flatten()[:n]


def bench_paged(layers: int, heads: int, dim: int, n_tokens: int, reps: int, label: str,
                show_bandwidth: bool = True) -> tuple[list[dict], dict]:
    bs, dtype = 16, torch.bfloat16
    blocks = n_tokens // bs + 64
    src = _paged_cache(layers, heads, dim, blocks, bs, dtype)
    dst = _paged_cache(layers, heads, dim, blocks, bs, dtype)
    spec = KVSpec.from_tensors(src, "vllm_flash", block_size=bs)
    nbytes = spec.chunk_nbytes(n_tokens)
    cfg = CacheConfig(chunk_size=256, local_cpu_size=int(nbytes * 1.1) + (64 << 20),
                      save_unfull_chunk=True)
    eng = CacheEngine(cfg, spec, "bench-llama")
    # Steady state: a new pool's first fill is measured apart (first_fill); waiting here keeps
    # the background pre-fault (and allocations populating pages ahead of it) out of the calls.
    if eng.pool._prefault is not None:
        eng.pool._prefault.done.wait()
    s_in = _shuffled_slots(n_tokens, blocks, bs, 1)
    s_out = _shuffled_slots(n_tokens, blocks, bs, 2)
    toks = torch.randint(0, 100_000, (n_tokens,), generator=torch.Generator().manual_seed(3))

    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1)
    b.fill_(2)

    def copy_once() -> float:
        t0 = time.perf_counter()
        b.copy_(a)
        return time.perf_counter() - t0

    # Time spent moving bytes inside the engine's own calls: overhead = the rest of the call.
    moved = {"t": 0.0, "cpu": 0.0}  # wall and this thread's CPU time inside the copies
    for tr in (eng.transfer_for(src), eng.transfer_for(dst)):
        for name in ("gather", "scatter"):
            real = getattr(tr, name)

            def timed(*a, _real=real, **k):
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return _real(*a, **k)
                finally:
                    moved["t"] += time.perf_counter() - t0
                    moved["cpu"] += time.thread_time() - c0

            setattr(tr, name, timed)

    def call_and_overhead(fn: Callable[[], object], setup=None
                          ) -> tuple[float, float, float, float]:
        """Median call time, overhead, interleaved copy time, and median per-rep ratio
        (copy time / call time): each rep pairs the call with a copy taken right next to it,
        so a shared machine's changing load hits both alike."""
        calls, overs, copies, ratios, cpus = [], [], [], [], []
        for _ in range(reps + 1):
            if setup:
                setup()
            moved["t"] = moved["cpu"] = 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            tc = copy_once()
            calls.append(dt)
            cpus.append(dc - moved["cpu"])
            overs.append(dt - moved["t"])
            copies.append(tc)
            ratios.append(tc / dt)
        med = statistics.median
        spread["overs"], spread["ratios"], spread["cpu"] = overs[1:], ratios[1:], cpus[1:]
        return med(calls[1:]), med(overs[1:]), med(copies[1:]), med(ratios[1:])

    spread: dict[str, list[float]] = {}
    t_store, o_store, c_store, r_store = call_and_overhead(
        lambda: eng.store(toks, src, s_in), setup=lambda: eng.storage.l1.clear())
    os_, rs_, oc_s = spread["overs"], spread["ratios"], statistics.median(spread["cpu"])
    eng.store(toks, src, s_in)
    assert eng.lookup(toks) == n_tokens
    t_retr, o_retr, c_retr, r_retr = call_and_overhead(lambda: eng.retrieve(toks, dst, s_out))
    or_, rr_, oc_r = spread["overs"], spread["ratios"], statistics.median(spread["cpu"])
    eng.close()
    ranges = range(0, n_tokens, 256)

    chunks = len(ranges)
    print(f"CPU tier, {label}: {layers} layers x {heads} KV heads x {dim}, bf16, block {bs}, "
          f"{n_tokens} tokens = {nbytes / GiB:.2f} GiB, {chunks} chunks")
    over = {"store": o_store / chunks * 1e6, "retrieve": o_retr / chunks * 1e6,
            "store_total": t_store / chunks * 1e6, "retrieve_total": t_retr / chunks * 1e6,
            "store_min": min(os_) / chunks * 1e6, "store_max": max(os_) / chunks * 1e6,
            "retrieve_min": min(or_) / chunks * 1e6, "retrieve_max": max(or_) / chunks * 1e6,
            "store_ratios": rs_, "retrieve_ratios": rr_,
            "store_cpu": oc_s / chunks * 1e6, "retrieve_cpu": oc_r / chunks * 1e6}
    if not show_bandwidth:
        return [], over
    rows = [
        row("store (paged -> pool)", nbytes / t_store / GiB, "GiB/s", nbytes / c_store / GiB,
            "torch copy, 1 thread", ">= 0.75x copy", ratio=r_store),
        row("retrieve (pool -> paged)", nbytes / t_retr / GiB, "GiB/s", nbytes / c_retr / GiB,
            "torch copy, 1 thread", ">= 0.75x copy", ratio=r_retr),
    ]
    rows[0].update(ratio_min=min(rs_), ratio_max=max(rs_))
    rows[1].update(ratio_min=min(rr_), ratio_max=max(rr_))
    return rows, over


# ------------------------------------------------------- first fill of a new pool
@functools.lru_cache(maxsize=1)
def _first_fill_cache(n_tokens: int) -> list:
    return _paged_cache(32, 8, 128, n_tokens // 16 + 64, 16, torch.bfloat16)


STORES = 3  # the first stores of a fresh engine, each into blocks nothing touched before


def _zero_fill(eng: CacheEngine) -> float:
    """What LMCache 0.5.6 does before it serves: ``fill_(0)`` over its whole pool."""
    t0 = time.perf_counter()
    eng.pool.buffer.fill_(0)
    return time.perf_counter() - t0


def bench_first_fill(n_tokens: int, reps: int, mode: str) -> dict:
    """The first ``STORES`` stores into a new engine's pool (Llama-8B-like shape; the default
    pool size, or enough for the stores), each against a warm one-thread copy of the same
    bytes taken right after it; a fresh engine per repetition. ``mode``:

    * ``off``: pre-fault off, pages fault on the stores' first writes;
    * ``start-up``: the stores come the moment the engine exists, the pre-fault running;
    * ``ready``: they come once ``MemoryPool.wait_ready`` says ready (what the reference
      server's /health and the "stores run at full speed" log line wait for);
    * ``zero-fill``: LMCache's way, the pool zero-filled by torch before serving.

    The seconds spent before serving (pre-fault or zero-fill) are reported."""
    bs = 16
    blocks = n_tokens // bs + 64
    src = _first_fill_cache(n_tokens)
    spec = KVSpec.from_tensors(src, "vllm_flash", block_size=bs)
    nbytes = spec.chunk_nbytes(n_tokens)
    s_in = _shuffled_slots(n_tokens, blocks, bs, 1)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 100_000, (n_tokens,), generator=gen) for _ in range(STORES)]
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.full((nbytes,), 2, dtype=torch.uint8)
    pool_size = max(CacheConfig().local_cpu_size, int(nbytes * STORES * 1.1) + (64 << 20))
    ratios, firsts, copies, before = [], [], [], []
    for _ in range(reps):
        cfg = CacheConfig(chunk_size=256, local_cpu_size=pool_size, save_unfull_chunk=True,
                          pin_memory="false",
                          local_cpu_prefault="off" if mode in ("off", "zero-fill")
                          else "background")
        t0 = time.perf_counter()
        eng = CacheEngine(cfg, spec, "bench-first-fill")
        if mode == "zero-fill":
            _zero_fill(eng)
        elif mode == "ready":
            eng.pool.wait_ready()
        if mode in ("ready", "zero-fill"):
            before.append(time.perf_counter() - t0)
        for toks in prompts:
            t0 = time.perf_counter()
            eng.store(toks, src, s_in)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            b.copy_(a)
            tc = time.perf_counter() - t0
            firsts.append(first)
            copies.append(tc)
            ratios.append(tc / first)
        eng.close()
        del eng
    med = statistics.median
    return {"first": nbytes / med(firsts) / GiB, "copy": nbytes / med(copies) / GiB,
            "ratio": med(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "before_s": med(before) if before else None, "pool_gib": pool_size / GiB}


def first_fill_rows(n_tokens: int, reps: int) -> list[dict]:
    print(f"First {STORES} stores into a new engine's pool (Llama-8B-like, {n_tokens} tokens "
          "each; a fresh engine per repetition)")
    out = []
    for label, mode in (("first store, pre-fault off", "off"),
                        ("first store at start-up", "start-up"),
                        ("first store after pre-fault (ready)", "ready"),
                        ("first store, LMCache's zero-fill", "zero-fill")):
        r = bench_first_fill(n_tokens, reps, mode)
        extra = (f"; {r['before_s']:.2f} s before serving ({r['pool_gib']:.2f} GiB pool)"
                 if r["before_s"] is not None else "")
        out.append(row(label, r["first"], "GiB/s", r["copy"], "torch copy, 1 thread",
                       ">= 0.7x copy" if mode != "off" else "-", ratio=r["ratio"]))
        out[-1].update(ratio_min=r["ratio_min"], ratio_max=r["ratio_max"],
                       before_s=r["before_s"], mode=mode,
                       prefault_s=r["before_s"] if mode == "ready" else None)
        print(f"    ratios {r['ratio_min']:.2f}-{r['ratio_max']:.2f}{extra}")
    return out


def run(quick: bool = False, sections: tuple[str, ...] = ("hashing", "lookup", "paged",
                                                         "first_fill", "overhead"),
        tokens: int | None = None, reps: int | None = None) -> list[dict]:
    """Every figure of this benchmark (printed as it goes) as a list of rows. ``tokens``:
    the paged and first-fill prompt length (default 8192; 2048 quick)."""
    torch.set_num_threads(1)
    reps = reps or (3 if quick else 7)
    print(f"lmc core benchmark (torch {torch.__version__}, 1 thread)\n")
    results: list[dict] = []
    if "hashing" in sections:
        for n_tok in (4096, 32768) if quick else (4096, 32768, 131072):
            results += bench_hashing(n_tok, 20 if quick else 50)
        print()
    if "lookup" in sections:
        results += bench_lookup(32768, 200 if quick else 1000)
        print()
    n = tokens or (2048 if quick else 8192)
    over_big = None
    if "paged" in sections:
        rows, over_big = bench_paged(32, 8, 128, n, reps, "Llama-8B-like")
        results += rows
        print()
    if "first_fill" in sections:
        results += first_fill_rows(n, min(reps, 3))
        print()
    if "overhead" in sections:
        _, over_tiny = bench_paged(1, 1, 8, 8192 if quick else 32768, 3 * reps,
                                   "tiny (bookkeeping only)", show_bandwidth=False)
        print("\nEngine overhead per chunk: call time minus byte moving (us; LMCache 0.5.6 "
              "here: 37 store / 31 retrieve; target <= 5)")
        for label, over in (("Llama-8B-like", over_big), ("tiny", over_tiny)):
            if over is None:
                continue
            print(f"  {label:14s} store {over['store']:7.2f} us  retrieve "
                  f"{over['retrieve']:7.2f} us   (whole call per chunk: "
                  f"{over['store_total']:.1f} / {over['retrieve_total']:.1f} us; "
                  f"thread CPU time: {over['store_cpu']:.2f} / {over['retrieve_cpu']:.2f} us)")
            results.append({"name": f"overhead per chunk, {label}", "store_us": over["store"],
                            "retrieve_us": over["retrieve"], "store_us_min": over["store_min"],
                            "store_us_max": over["store_max"],
                            "retrieve_us_min": over["retrieve_min"],
                            "retrieve_us_max": over["retrieve_max"],
                            "store_cpu_us": over["store_cpu"],
                            "retrieve_cpu_us": over["retrieve_cpu"]})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    ap.add_argument("--only", help="comma-separated sections: hashing, lookup, paged, "
                                   "first_fill, overhead (default: all)")
    ap.add_argument("--tokens", type=int, help="paged / first-fill prompt length")
    ap.add_argument("--reps", type=int, help="repetitions (default 7; 3 with --quick)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    sections = tuple(args.only.split(",")) if args.only else (
        "hashing", "lookup", "paged", "first_fill", "overhead")
    results = run(args.quick, sections, args.tokens, args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
