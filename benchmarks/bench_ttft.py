"""TTFT of a long prompt on the reference engine: full prefill vs an lmc hit (L1, disk), and
the layer-wise overlap of loads with compute.

Figures (all one request at a time, ``max_tokens=1``, so TTFT is the request's own):

* **full prefill**: the engine alone (no connector), the physical cost lmc removes, measured
  after one unmeasured prefill of the same length;
* **lmc cold**: the same with lmc on and an empty cache (the prefill plus lmc's saves);
* **L1 hit**: the prompt again, served from the CPU tier (the last token is computed);
* **disk hit**: the prompt again after L1 was emptied: read from the disk tier (O_DIRECT);
  every hit here loads all of itself (``load_policy: load_all``): these figures are what a
  tier's load costs, ``bench_load_or_recompute.py`` what lmc's choice makes of them;
* **overlap**: prompts whose first ``tokens - suffix`` tokens are cached. Each is run with
  loads done before the forward (``layerwise=False``: TTFT = load + compute, and the load
  is timed on its own) and layer-wise (layer i+1's copy during layer i's compute). The table
  shows load, compute, their sum and the layer-wise TTFT against the ideal
  ``max(load, compute) + min(load, compute) / layers`` (the first layer's copy is never
  hidden). "Model waited" is the time the layer-wise forward spent blocked on loads: the
  rest of the load time was hidden behind compute.
* **lower-tier waits** (``--lower``, instead of the figures above): per layer, how long the
  forward waited for its load on a disk hit (L1 emptied) and on a Redis hit (L1 emptied and
  the disk copies deleted; a loopback ``redis-server`` is started). Layer 0's wait includes
  the connector's ``start_load`` (where a fetch that reads whole chunks before any layer
  loads spends its time); the forward's own steps are timed around the connector's calls.

* **link-bound ideal** (always printed): what an L1 hit cannot beat -- the prompt's KV
  bytes over the host->device copy bandwidth measured in the same run (pinned
  ``cudaMemcpyAsync`` on CUDA, a host memcpy on the CPU), plus the measured one-token step
  (the engine alone decoding one token over the whole prompt) -- and the L1 hit's ratio to
  it (target on a GPU: >= 0.9).

The model is a random-weight Llama made with ``make_tiny_checkpoint`` (default hidden 1024,
8 layers, 16 heads, 8 KV heads: 32 KiB of fp32 KV per token, so an 8k prompt is 256 MiB of
KV), cached under the user's cache directory. ``--model`` picks a shape instead:
``1b`` (Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, head 64), ``8b``
(Llama-3.1-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, head 128, MLP 14336; a
16 GB checkpoint made on first use, minutes), ``8b-kv`` (Llama-8B's KV -- 32 layers, 8 KV
heads of 128, 128 KiB of bf16 KV per token -- on a small body: hidden 1024, MLP 2816; the
same bytes per hit at a fraction of the checkpoint), or ``smollm2-135m``, the real model
(SmolLM2-135M-Instruct, converted once by ``lmc model get``: 30 layers, 3 KV heads of 64,
46,080 B of KV a token in fp32, 23,040 B in bf16; default 2,048 tokens, at most 8,128).

    python benchmarks/bench_ttft.py                 # 8k tokens, the recorded figures
    python benchmarks/bench_ttft.py --quick         # hidden 512, 4 layers, 4k tokens
    python benchmarks/bench_ttft.py --lower         # per-layer waits on disk and Redis hits
    python benchmarks/bench_ttft.py --device cuda --model 8b-kv --tokens 16384
    python benchmarks/bench_ttft.py --model smollm2-135m --threads 1   # the real model
    python benchmarks/bench_ttft.py --cold-only [--no-disk | --write-quiet-ms 50] [--gc-freeze]
        # where a cold prefill's time goes: with, without or after the disk tier's writes
    python benchmarks/bench_ttft.py --cold-only --interleave --cold-reps 9   # cold vs alone, per pair

Every cold prefill and L1 hit also records the CPU seconds of each thread (the engine's and
lmc's) and the garbage-collection passes that ran meanwhile (count and seconds per
generation): on a GPU a thread holding the GIL, or a full collection, delays the engine's
launches.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from lmc.config import CacheConfig
from lmc.connectors.reference import LMCReferenceConnector
from lmc.reference import LLM
from lmc.reference.tiny import cached_checkpoint

BLOCK, BUDGET = 16, 2048
GiB = 2**30
# name -> (hidden, layers, heads, KV heads, MLP width or None for the tiny default)
MODELS: dict[str, tuple[int, int, int, int, int | None]] = {
    "1b": (2048, 16, 32, 8, 8192),
    "8b": (4096, 32, 32, 8, 14336),
    "8b-kv": (1024, 32, 8, 8, 2816),
}
REAL_MODELS = {"smollm2-135m": "smollm2-135m-instruct"}  # --model name -> lmc model get name
REAL_TOKENS = 2048  # default prompt on a real model: ~10-20 s of fp32 prefill on one core


def real_model(name: str, dtype: str) -> tuple[Path, dict[str, Any]]:
    """A real model's checkpoint (converted on first use) and its shape from config.json."""
    from lmc.models import get_model

    short = {"float32": "fp32", "bfloat16": "bf16"}.get(dtype)
    if short is None:
        raise SystemExit(f"bench_ttft --model {name}: --dtype must be float32 or bfloat16")
    path = get_model(REAL_MODELS[name], short, progress=log).path
    cfg = json.loads((path / "config.json").read_text())
    return path, {"hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
                  "heads": cfg["num_attention_heads"], "kv_heads": cfg["num_key_value_heads"],
                  "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg[
                      "num_attention_heads"], "max_len": cfg["max_position_embeddings"]}


def real_model_missing(name: str = "smollm2-135m") -> str | None:
    """Why the real model cannot run here (its package not installed and no checkpoint
    converted yet), or None: ``lmc bench`` skips the suite with that reason."""
    from lmc.models import known_model, store
    from lmc.models.source import SourceError, SourceMissing, locate

    model = known_model(REAL_MODELS[name])
    if store.check_folder(store.checkpoint_path(model, "fp32"), model, "fp32")[1] is None:
        return None
    try:
        locate(model)
    except (SourceMissing, SourceError) as e:
        return str(e)
    return None


def model_dir(hidden: int, layers: int, kv_heads: int, max_len: int, heads: int | None = None,
              intermediate: int | None = None, dtype: str = "float32") -> Path:
    heads = heads or hidden // 64
    name = f"bench-llama-h{hidden}-l{layers}-kv{kv_heads}-p{max_len}"
    if heads != hidden // 64 or intermediate or dtype != "float32":  # the old names stay
        name += f"-q{heads}-i{intermediate or 0}-{dtype}"
    return cached_checkpoint(name, progress=log, hidden=hidden, layers=layers, heads=heads,
                             kv_heads=kv_heads, intermediate=intermediate,
                             max_position_embeddings=max_len, dtype=dtype)


def copy_bandwidth(device: str, nbytes: int, reps: int = 3) -> float:
    """Host -> ``device`` bytes per second, best of ``reps``: a pinned cudaMemcpyAsync on
    CUDA (the link), a plain memcpy on the CPU (the memory), of up to 1 GiB."""
    n = max(1 << 20, min(nbytes, GiB))
    if device == "cuda":
        src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    else:  # numpy: one thread's memcpy (torch's parallel copy stalls on a busy machine)
        src, dst = torch.ones(n, dtype=torch.uint8).numpy(), torch.ones(n, dtype=torch.uint8)
    best = float("inf")
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        if device == "cuda":
            dst.copy_(src, non_blocking=True)
        else:
            dst.numpy()[:] = src
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return n / best


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def one_token_step(llm: LLM, prompt: list[int], reps: int = 3) -> float:
    """The engine's step for one token over the whole prompt (a decode step; the last step
    of an L1 hit does the same work): a two-token request's time after its first token."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = llm.generate([prompt], max_tokens=2, ignore_eos=True)[0]
        total = time.perf_counter() - t0
        if len(out.token_ids) == 2 and out.ttft_s is not None:
            best = min(best, total - out.ttft_s)
    return best


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 2048) for _ in range(n)]


DEVICE: dict[str, str] = {"device": "cpu", "dtype": "float32"}  # set by main()


def engine(path: Path, n: int, conn: LMCReferenceConnector | None = None) -> LLM:
    """One request of up to ``n`` tokens at a time (the cache is sized for exactly that)."""
    return LLM(path, block_size=BLOCK, max_num_batched_tokens=BUDGET, max_num_seqs=1,
               max_model_len=n + 64, kv_cache_memory=8 << 30, kv_connector=conn,
               device=DEVICE["device"], dtype=DEVICE["dtype"])


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    out = llm.generate([prompt], max_tokens=1)[0]
    return out.ttft_s, out.num_cached_tokens


def worker_stat(conn: LMCReferenceConnector, key: str) -> float:
    return conn.stats().get(f"worker.{key}", 0.0)


def disk_reads(conn: LMCReferenceConnector) -> float:
    """Chunks the disk tier (the first lower tier) has served so far, as its manager counts
    them (``<tier>.get_hits``; absent until the first read)."""
    storage = conn.engine.storage
    return storage.stats().get(f"{storage.lower[0].name}.get_hits", 0.0)


def settle_promotions(conn: LMCReferenceConnector, keys: list[bytes],
                      reads_before: float | None = None, timeout: float = 30.0) -> None:
    """Wait until a lower-tier hit's read has ended and its chunks are in L1. A layer-wise
    read promotes its chunks once verified, from the read's own thread, which may be after
    the request returned: a repetition that empties L1 before that would find part of the
    prompt in L1 again. L1 holding every chunk is not enough -- the request's own save of
    its last chunk may land first, and that chunk's promotion after the next clear.
    ``reads_before``: :func:`disk_reads` before the request (None: L1 only)."""
    l1, deadline = conn.engine.storage.l1, time.monotonic() + timeout

    def read_ended() -> bool:  # the read's end counts its hits, then promotes them
        return reads_before is None or disk_reads(conn) - reads_before >= len(keys)

    while not (read_ended() and l1.prefix_hits(keys) >= len(keys)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"a lower-tier read of {len(keys)} chunks did not end and "
                               f"promote in {timeout:.0f} s")
        time.sleep(0.005)
    time.sleep(0.02)  # the promotion runs right after the count, on the read's thread


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=None,
                    help=f"prompt length (default 8192; {REAL_TOKENS} on a real model)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each hit figure")
    ap.add_argument("--cold-reps", type=int, default=3,
                    help="cold prefills of fresh prompts (the first pays lmc's first-use costs)")
    ap.add_argument("--suffixes", default="1,256", help="uncached suffix lengths for overlap")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the engine-alone prefill")
    ap.add_argument("--interleave", action="store_true",
                    help="each cold prefill follows an engine-alone prefill of another fresh "
                         "prompt (both engines live): lmc cold over the engine alone per pair, "
                         "which a slow minute of the machine moves alike")
    ap.add_argument("--cold-only", action="store_true",
                    help="stop after the cold prefills (no hits, no overlap)")
    ap.add_argument("--no-disk", action="store_true",
                    help="L1 alone: no disk tier (so no write-behind beside the cold prefills); "
                         "implies --cold-only")
    ap.add_argument("--write-quiet-ms", type=int, default=0,
                    help="lmc's write_quiet_ms: lower-tier writes wait until the engine has "
                         "not saved for this long (0: write at once)")
    ap.add_argument("--profile-first-hit", action="store_true",
                    help="cProfile the first L1 hit on the engine's thread and print the top "
                         "30 calls (that hit's figure is inflated by the profiler)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() once the engines are built (what vLLM does after start-up): "
                         "full collections no longer walk the model's and torch's objects")
    ap.add_argument("--quick", action="store_true", help="hidden 512, 4 layers, 4k tokens")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--lower", action="store_true",
                    help="only the per-layer model wait on disk and Redis hits")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the engine runs (cuda: exits 0 saying so where there is none)")
    ap.add_argument("--dtype", default=None,
                    help="model and KV dtype (default: float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--model", choices=sorted(MODELS) + sorted(REAL_MODELS), default=None,
                    help="a model shape instead of --hidden/--layers/--kv-heads, or a real "
                         "model (smollm2-135m)")
    ap.add_argument("--heads", type=int, default=None, help="query heads (default hidden/64)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_ttft --device cuda: no CUDA device on this machine: skipped")
        return 0
    if args.cold_reps < 1 or args.reps < 1:
        ap.error("--reps and --cold-reps must be >= 1")
    args.cold_only = args.cold_only or args.no_disk
    if args.quick:
        args.tokens, args.hidden, args.layers, args.kv_heads = 4096, 512, 4, 4
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    DEVICE.update(device=args.device, dtype=args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model in REAL_MODELS:
        path, shape = real_model(args.model, args.dtype)
        args.hidden, args.layers, args.heads, args.kv_heads = (
            shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"])
        head_dim = shape["head_dim"]
        n = args.tokens or REAL_TOKENS
        if not 64 <= n <= shape["max_len"] - 64:
            ap.error(f"--tokens {n}: {args.model} takes 64 to {shape['max_len'] - 64}")
    else:
        intermediate = None
        if args.model:
            args.hidden, args.layers, args.heads, args.kv_heads, intermediate = \
                MODELS[args.model]
        args.heads = args.heads or args.hidden // 64
        head_dim = args.hidden // args.heads
        n = args.tokens or 8192
        path = model_dir(args.hidden, args.layers, args.kv_heads, max(8192, n + 64),
                         args.heads, intermediate, args.dtype)
    prompt = [0] + tokens(1, n - 1)
    itemsize = getattr(torch, args.dtype).itemsize
    kv_bytes = n * args.layers * 2 * args.kv_heads * head_dim * itemsize
    res: dict[str, Any] = {"tokens": n, "hidden": args.hidden, "layers": args.layers,
                           "kv_heads": args.kv_heads, "heads": args.heads,
                           "head_dim": head_dim, "dtype": args.dtype, "device": args.device,
                           "device_name": (torch.cuda.get_device_name() if args.device == "cuda"
                                           else "CPU"),
                           "model": args.model or "custom", "kv_bytes": kv_bytes,
                           "kv_bytes_per_token": kv_bytes // n,
                           "kv_mib": kv_bytes / 2**20,
                           "threads": torch.get_num_threads(), "chunk_size": args.chunk_size}
    log(f"model {path.name}: {n} tokens, {kv_bytes / 2**20:.0f} MiB of KV, "
        f"{args.dtype} on {res['device_name']}, {torch.get_num_threads()} torch threads")

    if args.lower:
        res.update(lower_waits(path, n, prompt, kv_bytes, args))
        report_lower(res)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        return 0

    alone_llm: LLM | None = None  # --interleave: the engine alone, kept for the cold pairs
    if not args.no_baseline:
        llm = engine(path, n)
        # Warm-up at full length: the process's first long prefill also pays for page faults
        # on fresh temporaries (measured ~2x slower here), which would flatter lmc.
        log("warm-up prefill (not measured) ...")
        ttft(llm, [0] + tokens(2, n - 1))
        log("full prefill, engine alone ...")
        with CpuTimes() as cpu:
            res["prefill_s"], _ = ttft(llm, prompt)
        res["prefill_cpu"] = cpu.times
        log("one-token step over the prompt, engine alone ...")
        res["step_s"] = one_token_step(llm, prompt)
        if args.interleave:
            alone_llm = llm
        del llm
        sync(args.device)
    log("host -> device copy bandwidth ...")
    res["copy_gib_s"] = copy_bandwidth(args.device, kv_bytes) / GiB

    disk = tempfile.mkdtemp(prefix="lmc-bench-disk-")
    try:
        # the disk's write queue holds the whole prompt (the default 1 GiB dropped 8 of the
        # 64 chunks of a 16k-token Llama-8B prompt on an H100: the disk hit was partial)
        # --no-disk: L1 alone (a cold prefill without write-behind beside it: what the disk
        # tier's writes cost the engine)
        tier = {} if args.no_disk else dict(local_disk=disk,
                                             local_disk_size=(args.cold_reps + 3) * kv_bytes)
        cfg = CacheConfig(chunk_size=args.chunk_size, local_cpu_size=max(256 << 20, 3 * kv_bytes),
                          **tier, write_queue_size=max(1 << 30, kv_bytes + kv_bytes // 4),
                          load_policy="load_all",  # the whole hit: what a tier's load costs
                          write_quiet_ms=args.write_quiet_ms)
        conn = LMCReferenceConnector(cfg, model_dir=path)
        llm = engine(path, n, conn)
        pool = conn.engine.pool
        pool.wait_ready(600)  # a real engine pins while it loads its model: not timed here
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        res["pool_pinned_bytes"] = int(pool.stats().get("pinned_bytes", 0))
        res["pool_asked_bytes"] = int(cfg.local_cpu_size)
        calls = EngineThreadCalls(conn)
        ttft(llm, prompt[:64])
        # cold prefills of fresh prompts first (the last one is the prompt the hits reuse):
        # the first pays every first-use cost left after registration, the next ones do not
        cold, cold_calls, cold_threads, alone = [], [], [], []
        for r in range(args.cold_reps):
            p = prompt if r == args.cold_reps - 1 else [0] + tokens(500 + r, n - 1)
            if alone_llm is not None:  # the pair's engine-alone half, a prompt of its own
                alone.append(ttft(alone_llm, [0] + tokens(900 + r, n - 1))[0])
            log(f"lmc cold (prefill + saves), {r + 1} of {args.cold_reps} ...")
            calls.take()
            with CpuTimes() as cpu:
                cold.append(ttft(llm, p)[0])
            cold_calls.append({**calls.take(), **cpu.times})
            cold_threads.append(cpu.threads)
            conn.engine.storage.flush(timeout=120)  # the disk's queue holds one prompt
        res["lmc_cold_s"] = statistics.median(cold)
        res["lmc_cold_reps"] = cold
        res["lmc_cold_calls"] = cold_calls
        res["lmc_cold_threads"] = cold_threads
        if alone_llm is not None:
            res["alone_reps"] = alone
            alone_llm.close()
            alone_llm = None
        if args.cold_only:
            res["l1_hit_s"] = res["disk_hit_s"] = None
            res["overlap"] = []
            llm.close()
            return finish(res, args)

        log("L1 hits ...")
        l1, l1_wait, l1_load, l1_calls, l1_threads = [], [], [], [], []
        for rep in range(args.reps):  # where a hit's time goes: the forward's waits on loads
            w0, l0 = worker_stat(conn, "load_wait_seconds"), worker_stat(conn, "load_seconds")
            calls.take()
            prof = cProfile.Profile() if args.profile_first_hit and rep == 0 else None
            with CpuTimes() as cpu:
                if prof is not None:
                    prof.enable()
                l1.append(ttft(llm, prompt))
                if prof is not None:
                    prof.disable()
            if prof is not None:  # the engine thread's calls (this figure is then inflated)
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
                res["first_hit_profile"] = out.getvalue()
            l1_calls.append({**calls.take(), **cpu.times})
            l1_threads.append(cpu.threads)
            l1_wait.append(worker_stat(conn, "load_wait_seconds") - w0)
            l1_load.append(worker_stat(conn, "load_seconds") - l0)
        res["l1_hit_calls"] = l1_calls
        res["l1_hit_threads"] = l1_threads
        assert all(c == n - 1 for _, c in l1), l1
        res["l1_hit_s"] = statistics.median(t for t, _ in l1)
        res["l1_hit_reps"] = [t for t, _ in l1]
        res["l1_wait_s"] = statistics.median(l1_wait)  # the forward blocked on loads
        res["l1_load_s"] = statistics.median(l1_load)  # lmc's I/O thread on the loads
        if "step_s" in res:
            res["ideal_s"] = kv_bytes / (res["copy_gib_s"] * GiB) + res["step_s"]
            res["l1_vs_ideal"] = res["ideal_s"] / res["l1_hit_s"]
        res["copy_stats"] = {k: v for k, v in conn.engine.stats().items()
                             if k.startswith(("copy_path.", "copy_calls."))}

        log("disk hits ...")
        disk_t = []
        for _ in range(args.reps):
            conn.engine.storage.l1.clear()
            before = worker_stat(conn, "tokens_from_disk")
            reads = disk_reads(conn)
            t, c = ttft(llm, prompt)
            got = worker_stat(conn, "tokens_from_disk") - before
            assert c == n - 1 and got == n - 1, (f"disk hit: {c} tokens loaded, {got} counted "
                                                 f"from disk, of {n - 1}", conn.stats())
            disk_t.append(t)
            settle_promotions(conn, conn.engine.db.keys(prompt), reads)
        res["disk_hit_s"] = statistics.median(disk_t)
        res["disk_hit_reps"] = disk_t

        sync_conn = LMCReferenceConnector(cfg, model_dir=path, cache_engine=conn.engine,
                                          layerwise=False)
        sync_llm = engine(path, n, sync_conn)
        res["overlap"] = []
        for k, suffix in enumerate(int(s) for s in args.suffixes.split(",") if s.strip()):
            log(f"overlap, {suffix}-token suffix ...")
            row: dict[str, Any] = {"suffix": suffix}
            modes = {"sync": (sync_llm, sync_conn), "layerwise": (llm, conn)}
            times: dict[str, list[float]] = {m: [] for m in modes}
            loads: dict[str, list[float]] = {m: [] for m in modes}
            waits: list[float] = []
            for r in range(args.reps):  # modes alternate, so both see the same machine load
                for j, (mode, (m_llm, m_conn)) in enumerate(modes.items()):
                    p = prompt if suffix <= 1 else \
                        prompt[:n - suffix] + tokens(1000 + 100 * k + 10 * r + j, suffix)
                    l0 = worker_stat(m_conn, "load_seconds")
                    w0 = worker_stat(m_conn, "load_wait_seconds")
                    t, cached = ttft(m_llm, p)
                    if mode == "layerwise":
                        waits.append(worker_stat(m_conn, "load_wait_seconds") - w0)
                    assert cached >= n - suffix - args.chunk_size, (cached, suffix)
                    times[mode].append(t)
                    loads[mode].append(worker_stat(m_conn, "load_seconds") - l0)
            for mode in modes:
                row[f"{mode}_ttft_s"] = statistics.median(times[mode])
                row[f"{mode}_load_s"] = statistics.median(loads[mode])
            row["layerwise_wait_s"] = statistics.median(waits)
            row["layerwise_wait_reps"] = waits
            row["load_s"] = row["sync_load_s"]
            row["compute_s"] = row["sync_ttft_s"] - row["sync_load_s"]
            lo, hi = sorted((row["load_s"], row["compute_s"]))
            row["ideal_s"] = hi + lo / args.layers
            res["overlap"].append(row)
        llm.close()
        sync_llm.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return finish(res, args)


def finish(res: dict[str, Any], args: Any) -> int:
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each live Python thread, by name (a pool's numbered threads,
    ``lmc-disk-w_0`` ..., summed under one name)."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            secs = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, AttributeError):  # ended meanwhile; no per-thread clocks here
            continue
        name = re.sub(r"_\d+$", "", t.name)
        out[name] = out.get(name, 0.0) + secs
    return out


class GcPasses:
    """Garbage-collection passes while ``on``: count and seconds per generation, and which
    thread ran them (a pass runs on whichever thread allocated past the threshold, holding
    the GIL: on a GPU engine's thread, or beside it, it delays launches)."""

    def __init__(self) -> None:
        self.on = False
        self.passes: list[tuple[int, float, str]] = []
        self._t0: dict[int, float] = {}
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        tid = threading.get_ident()
        if phase == "start":
            self._t0[tid] = time.perf_counter()
        elif tid in self._t0:
            self.passes.append((int(info.get("generation", -1)),
                                time.perf_counter() - self._t0.pop(tid),
                                threading.current_thread().name))

    def take(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for gen, secs, _ in self.passes:
            out[f"gc.gen{gen}.n"] = out.get(f"gc.gen{gen}.n", 0) + 1
            out[f"gc.gen{gen}.s"] = out.get(f"gc.gen{gen}.s", 0.0) + secs
        self.passes = []
        return out


GC = GcPasses()


class CpuTimes:
    """CPU seconds of the engine's thread and of the whole process over a ``with`` block
    (keys ``cpu.engine_thread`` and ``cpu.process``): where the engine's thread spent less
    CPU than its wall time it waited (the device, a lock, the GIL held by another thread);
    the process's minus the engine's is what lmc's background threads ran meanwhile
    (``threads``: CPU seconds per thread name; ``gc``: the collections that ran)."""

    def __enter__(self) -> CpuTimes:
        self.threads0 = thread_cpu()
        GC.take()
        GC.on = True
        self.t0, self.p0 = time.thread_time(), time.process_time()
        self.times: dict[str, float] = {}
        self.threads: dict[str, float] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        self.times = {"cpu.engine_thread": time.thread_time() - self.t0,
                      "cpu.process": time.process_time() - self.p0}
        GC.on = False
        self.times.update(GC.take())
        now = thread_cpu()
        self.threads = {k: round(v - self.threads0.get(k, 0.0), 4) for k, v in now.items()
                        if v - self.threads0.get(k, 0.0) >= 0.0005}


class EngineThreadCalls:
    """Seconds the engine's thread spends inside each of the connector's calls, per run:
    wrapped on the connector instance. On a GPU the reference engine is bound by its host
    thread (a layer's kernels are queued faster than the device runs them only when nothing
    else holds that thread), so lmc's host time there is TTFT; this says which call it is."""

    NAMES = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
             "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
             "get_finished", "get_block_ids_with_load_errors", "request_finished")

    def __init__(self, conn: LMCReferenceConnector) -> None:
        self.cur: dict[str, float] = {}
        for name in self.NAMES:
            setattr(conn, name, self._timed(name, getattr(conn, name)))

    def _timed(self, name: str, fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cur[name] = self.cur.get(name, 0.0) + time.perf_counter() - t0
        return call

    def take(self) -> dict[str, float]:
        out, self.cur = self.cur, {}
        return out


def describe_calls(calls: dict[str, float], top: int = 3) -> str:
    """``12.3 ms (save_kv_layer 8.1, wait_for_save 3.0, ...; CPU: engine thread 40.2,
    process 51.0)``: the calls' total, the largest, and the run's CPU times."""
    own = {k: v for k, v in calls.items() if not k.startswith(("cpu.", "gc."))}
    parts = sorted(own.items(), key=lambda kv: -kv[1])[:top]
    cpu = ""
    if "cpu.engine_thread" in calls:
        cpu = (f"; CPU: engine thread {calls['cpu.engine_thread'] * 1e3:.1f}, process "
               f"{calls['cpu.process'] * 1e3:.1f}")
    return (f"{sum(own.values()) * 1e3:.1f} ms ("
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts) + cpu + ")")


class LayerWaits:
    """Times the forward's waits on lmc per layer: the connector's ``start_load`` (counted
    as layer 0's) and each ``wait_for_layer(i)``, wrapped on the worker instance."""

    def __init__(self, conn: LMCReferenceConnector, layers: int) -> None:
        worker = conn._require_worker()
        self.cur = [0.0] * layers
        start, wait = worker.start_load, worker.wait_for_layer

        def start_load() -> None:
            t0 = time.perf_counter()
            start()
            self.cur[0] += time.perf_counter() - t0

        def wait_for_layer(i: int) -> None:
            t0 = time.perf_counter()
            wait(i)
            self.cur[i] += time.perf_counter() - t0

        worker.start_load = start_load  # type: ignore[method-assign]
        worker.wait_for_layer = wait_for_layer  # type: ignore[method-assign]

    def take(self) -> list[float]:
        out, self.cur = self.cur, [0.0] * len(self.cur)
        return out


def lower_waits(path: Path, n: int, prompt: list[int], kv_bytes: int, args: Any
                ) -> dict[str, Any]:
    """Per-layer waits on disk hits and Redis hits (see the module doc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_redis import Server  # a loopback redis-server, persistence off

    server = Server()
    disk = tempfile.mkdtemp(prefix="lmc-bench-disk-")
    out: dict[str, Any] = {}
    try:
        cfg = CacheConfig(chunk_size=args.chunk_size, local_cpu_size=max(256 << 20, 3 * kv_bytes),
                          local_disk=disk, local_disk_size=4 * kv_bytes,
                          remote_url=f"redis://127.0.0.1:{server.port}", remote_timeout=30.0,
                          load_policy="load_all")
        conn = LMCReferenceConnector(cfg, model_dir=path)
        llm = engine(path, n, conn)
        ttft(llm, prompt[:64])
        log("lmc cold (prefill + saves to disk and Redis) ...")
        ttft(llm, prompt)
        storage = conn.engine.storage
        assert storage.flush(timeout=300), "write-behind did not drain"
        waits = LayerWaits(conn, args.layers)
        keys = conn.engine.db.keys(prompt)
        disk_tier = storage.lower[0]
        for tier in ("disk", "redis"):
            log(f"{tier} hits ...")
            rows = []
            for _ in range(args.reps):
                storage.l1.clear()
                if tier == "redis":
                    disk_tier.delete(keys)
                before = worker_stat(conn, f"tokens_from_{tier}")
                waits.take()
                t, c = ttft(llm, prompt)
                w = waits.take()
                got = worker_stat(conn, f"tokens_from_{tier}") - before
                assert c == n - 1 and got == n - 1, (tier, c, got)
                rows.append({"ttft_s": t, "waits_s": w})
                settle_promotions(conn, keys)
                assert storage.flush(timeout=300)  # promotions written back before the next
            out[f"{tier}_lower"] = rows
        llm.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        server.stop()
    return out


def report_lower(r: dict[str, Any]) -> None:
    print(f"\nPer-layer model wait on lower-tier hits, {r['tokens']}-token prompt "
          f"({r['kv_mib']:.0f} MiB of KV, {r['layers']} layers, chunk {r['chunk_size']}, "
          f"{r['threads']} threads), medians over repetitions\n")
    print("| hit from | TTFT | total wait | layer 0 (incl. start_load) | layers 1.. (each) | "
          "per layer |\n|---|---:|---:|---:|---:|---|")
    for tier in ("disk", "redis"):
        rows = r[f"{tier}_lower"]
        per = [statistics.median(x["waits_s"][i] for x in rows) for i in range(r["layers"])]
        total = statistics.median(sum(x["waits_s"]) for x in rows)
        rest = statistics.mean(per[1:]) if len(per) > 1 else 0.0
        ttft_s = statistics.median(x["ttft_s"] for x in rows)
        print(f"| {tier} | {ttft_s * 1e3:.1f} ms | {total * 1e3:.1f} ms | {per[0] * 1e3:.1f} ms"
              f" | {rest * 1e3:.1f} ms | {' '.join(f'{p * 1e3:.1f}' for p in per)} |")


def report(r: dict[str, Any]) -> None:
    base = r.get("prefill_s") or r["lmc_cold_s"]
    where = "CPU" if r["device"] == "cpu" else r["device_name"]
    real = f"{r['model']}: " if r.get("model") in REAL_MODELS else ""
    print(f"\nTTFT, {r['tokens']}-token prompt, reference engine on {where} "
          f"({real}hidden {r['hidden']}, {r['layers']} layers, {r['heads']} heads, "
          f"{r['kv_heads']} KV heads of {r['head_dim']}, {r['dtype']}; {r['kv_mib']:.0f} MiB "
          f"of KV, {r['kv_bytes'] // r['tokens']:,} B a token; chunk {r['chunk_size']}; "
          f"{r['threads']} threads)\n")
    print("| case | TTFT | vs full prefill |\n|---|---:|---:|")
    rows = [("full prefill (engine alone)", r.get("prefill_s")),
            ("lmc cold (prefill + save)", r["lmc_cold_s"]),
            ("lmc hit in L1 (CPU)", r["l1_hit_s"]),
            ("lmc hit on disk (L1 empty)", r["disk_hit_s"]),
            ("link-bound ideal for the hit", r.get("ideal_s"))]
    for name, t in rows:
        if t is not None:
            print(f"| {name} | {t * 1e3:,.1f} ms | {base / t:,.1f}x |")
    if r.get("ideal_s"):
        print(f"\nlink-bound ideal = {r['kv_mib']:.0f} MiB / {r['copy_gib_s']:.1f} GiB/s "
              f"(host->device copy, this run) + {r['step_s'] * 1e3:.1f} ms one-token step = "
              f"{r['ideal_s'] * 1e3:.1f} ms; L1 hit at {r['l1_vs_ideal']:.2f} of it"
              f"{'' if r['device'] == 'cpu' or r['l1_vs_ideal'] >= 0.9 else '  (< 0.90)'}")
    if r.get("l1_load_s") is not None:
        print(f"L1 hit: lmc's I/O thread {r['l1_load_s'] * 1e3:.1f} ms on the loads, the forward "
              f"waited {r['l1_wait_s'] * 1e3:.1f} ms for them; copy paths: "
              + ", ".join(f"{k.removeprefix('copy_path.')}={v}"
                          for k, v in sorted(r.get("copy_stats", {}).items())
                          if k.startswith("copy_path.")))
    if r.get("prefill_cpu"):
        print(f"engine alone, full prefill: CPU of the engine thread "
              f"{r['prefill_cpu']['cpu.engine_thread'] * 1e3:.1f} ms, of the process "
              f"{r['prefill_cpu']['cpu.process'] * 1e3:.1f} ms")
    if len(r.get("lmc_cold_reps", ())) > 1:
        first, rest = r["lmc_cold_reps"][0], statistics.median(r["lmc_cold_reps"][1:])
        print(f"lmc cold: first {first * 1e3:.1f} ms, then {rest * 1e3:.1f} ms (median of "
              f"{len(r['lmc_cold_reps']) - 1})" + ("; L1 hits: " + ", ".join(
                  f"{t * 1e3:.1f}" for t in r["l1_hit_reps"]) + " ms"
                  if r.get("l1_hit_reps") else ""))
    if r.get("alone_reps"):
        pairs = list(zip(r["alone_reps"], r["lmc_cold_reps"]))
        ratios = [c / a for a, c in pairs]
        later = ratios[1:] or ratios
        print("interleaved (engine alone, lmc cold) per pair: " + ", ".join(
            f"({a * 1e3:,.0f}, {c * 1e3:,.0f} ms)" for a, c in pairs))
        print(f"lmc cold / engine alone, per pair: {', '.join(f'{x:.2f}' for x in ratios)}; "
              f"median after the first {statistics.median(later):.2f}x (bar <= 1.05x)")
    for what, key in (("cold", "lmc_cold_calls"), ("L1 hit", "l1_hit_calls")):
        runs = r.get(key) or []
        if runs:
            print(f"engine thread inside lmc's calls, {what}: first "
                  f"{describe_calls(runs[0])}" + (f"; last {describe_calls(runs[-1])}"
                                                   if len(runs) > 1 else ""))
    for what, key in (("cold", "lmc_cold_threads"), ("L1 hit", "l1_hit_threads")):
        for i, th in enumerate(r.get(key) or []):
            top = sorted(th.items(), key=lambda kv: -kv[1])[:6]
            print(f"CPU by thread, {what} {i + 1}: " + ", ".join(
                f"{k} {v * 1e3:.1f} ms" for k, v in top))
    for what, key in (("cold", "lmc_cold_calls"), ("L1 hit", "l1_hit_calls"),
                      ("engine alone", "prefill_cpu")):
        runs = r.get(key) or []
        runs = [runs] if isinstance(runs, dict) else runs
        gcs = [", ".join(f"gen{g} {int(c[f'gc.gen{g}.n'])}x {c[f'gc.gen{g}.s'] * 1e3:.1f} ms"
                         for g in (0, 1, 2) if f"gc.gen{g}.n" in c) or "none" for c in runs]
        if gcs:
            print(f"GC passes, {what}: " + " | ".join(gcs))
    if r.get("pool_pinned_bytes"):
        print(f"pinned pool: {r['pool_pinned_bytes'] / GiB:.3f} GiB page-locked for "
              f"{r['pool_asked_bytes'] / GiB:.3f} GiB asked")
    if r.get("first_hit_profile"):
        print("\nFirst L1 hit, engine thread (cProfile):\n" + r["first_hit_profile"])
    if not r["overlap"]:
        return
    print("\nLayer-wise overlap (medians; load and compute measured apart with loads done "
          "before the forward):\n")
    print("| uncached suffix | load | compute | load + compute | layer-wise TTFT | ideal | "
          "model waited for loads |\n|---:|---:|---:|---:|---:|---:|---:|")
    for o in r["overlap"]:
        print(f"| {o['suffix']} | {o['load_s'] * 1e3:.1f} ms | {o['compute_s'] * 1e3:.1f} ms | "
              f"{o['sync_ttft_s'] * 1e3:.1f} ms | {o['layerwise_ttft_s'] * 1e3:.1f} ms | "
              f"{o['ideal_s'] * 1e3:.1f} ms | {o['layerwise_wait_s'] * 1e3:.1f} ms |")


if __name__ == "__main__":
    sys.exit(main())
