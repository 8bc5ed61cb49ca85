"""SGLang connector benchmarks, run with the SGLang venv's python (``LMC_SGLANG_PYTHON``).

    $LMC_SGLANG_PYTHON benchmarks/bench_sglang.py [--layers 16] [--pages 64] [--page 32]
        [--reps 5] [--json FILE]

1. HiCache backend: ``batch_set_v1`` / ``batch_get_v1`` GiB/s between SGLang's real host pool
   (``layer_first`` and ``page_first``) and lmc's L1, next to lmc's own CPU-tier figures for
   the same bytes (``CacheEngine`` store/retrieve from a paged ``vllm_flash`` cache) and the
   limit both are held to: a one-thread torch copy of those bytes. Repetitions interleave the
   paths (a load swing hits all of them), each with fresh keys into pre-faulted pools; the
   ratio is the median of the per-repetition ratios against that repetition's copy.
2. Linker overlap: a batch loaded through ``LMCCacheLinker`` (built by SGLang's factory on a
   real ``MHATokenToKVPool``) while a forward "computes" each layer for a fixed time. Per
   layer: how long the linker's load thread took to copy it, and how long the forward waited
   in ``wait_until`` for it; the total against the serial sum (all loads, then all compute).

No patches: everything here runs on SGLang's unmodified classes. The machine's load average
is printed before and after, since the figures move with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "connectors", "sglang_scripts"))
import sglang_env  # noqa: E402

sglang_env.stub_missing_torchvision()
import torch  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.linker_factory import (  # noqa: E402
    create_unified_cache_linker,
)
from sglang.srt.server_args import ServerArgs  # noqa: E402

from lmc import CacheConfig, CacheEngine, KVSpec  # noqa: E402
from lmc.connectors.sglang import LMCCacheLinker, LMCHiCacheStorage  # noqa: E402
from lmc.layerwise import LayerwiseRetrieve  # noqa: E402

GIB = 1 << 30
LAYOUTS = ("layer_first", "page_first")


def keys_for(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def prefaulted(engine: CacheEngine) -> None:
    """Wait for the pool's background pre-fault: first-touch page faults are start-up cost,
    not the data path's."""
    pf = getattr(engine.pool, "_prefault", None)
    if pf is not None:
        pf.done.wait(120)


def bench_hicache(a) -> dict[str, Any]:
    dev = MHATokenToKVPool(size=a.pages * a.page, page_size=a.page, dtype=torch.bfloat16,
                           head_num=a.heads, head_dim=a.dim, layer_num=a.layers, device="cpu",
                           enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    nbytes = 2 * a.layers * a.pages * a.page * a.heads * a.dim * 2
    pool_size = f"{nbytes * (a.reps + 1) // (1 << 20) + 64}MiB"
    backends: dict[str, tuple[LMCHiCacheStorage, Any, torch.Tensor, torch.Tensor]] = {}
    for layout in LAYOUTS:
        host = MHATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0,
                                    page_size=a.page, layout=layout, pin_memory=False,
                                    device="cpu", device_capacity_tokens=a.pages * a.page,
                                    start_layer=0, end_layer=a.layers - 1)
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
            model_name="bench", extra_config={"lmc.local_cpu_size": pool_size})
        b = LMCHiCacheStorage(cfg, {})
        b.register_mem_pool_host(host)
        prefaulted(b.engine)
        src, dst = host.alloc(a.pages * a.page), host.alloc(a.pages * a.page)
        host.kv_buffer.view(torch.int16).random_()
        backends[layout] = (b, host, src, dst)
    # lmc's own CPU tier, same bytes: CacheEngine store/retrieve on a paged cache
    spec = KVSpec(a.layers, a.heads, a.dim, torch.bfloat16, a.page, "vllm_flash")
    caches = [torch.empty(2, a.pages * 2, a.page, a.heads, a.dim, dtype=torch.bfloat16)
              for _ in range(a.layers)]
    for c in caches:
        c.view(torch.int16).random_()
    n = a.pages * a.page
    eng = CacheEngine(CacheConfig(chunk_size=256, local_cpu_size=pool_size), spec, "bench")
    prefaulted(eng)
    copy_src = torch.empty(nbytes, dtype=torch.uint8).random_()
    copy_dst = torch.zeros(nbytes, dtype=torch.uint8)
    samples: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(seconds)

    try:
        for r in range(a.reps):  # interleaved: every path sees the same load swings
            add("copy", timed(lambda: copy_dst.copy_(copy_src)))
            for layout, (b, _h, src, dst) in backends.items():
                keys = keys_for(f"{layout}{r}", a.pages)
                add(f"{layout} set", timed(lambda b=b, keys=keys, src=src: b.batch_set_v1(
                    keys, src)))
                add(f"{layout} get", timed(lambda b=b, keys=keys, dst=dst: b.batch_get_v1(
                    keys, dst)))
            toks = list(range(r * n + 1, r * n + n + 1))
            add("engine store", timed(lambda toks=toks: eng.store(toks, caches,
                                                                  torch.arange(n))))
            add("engine retrieve", timed(lambda toks=toks: eng.retrieve(
                toks, caches, torch.arange(n, 2 * n))))
        for layout, (b, host, src, dst) in backends.items():
            same = all(torch.equal(host.get_data_page(int(src[i * a.page])).view(torch.int16),
                                   host.get_data_page(int(dst[i * a.page])).view(torch.int16))
                       for i in range(a.pages))  # bit patterns: random bf16 bits hold NaNs
            assert same, f"{layout}: pages differ"
            assert b.stats_counts.get("pages_stored") == a.reps * a.pages, b.stats_counts
    finally:
        for b, *_ in backends.values():
            b.close()
        eng.close()
    copies = samples["copy"]
    out: dict[str, Any] = {"bytes": nbytes, "copy_gibs": [nbytes / t / GIB for t in copies]}
    for name, times in samples.items():
        if name == "copy":
            continue
        ratios = [c / t for c, t in zip(copies, times)]  # GiB/s over the same rep's copy
        out[name] = {"gibs": [nbytes / t / GIB for t in times],
                     "ratio_median": statistics.median(ratios),
                     "ratio_range": [min(ratios), max(ratios)]}
    return out


class TimedLinker(LMCCacheLinker):
    """LMCCacheLinker with each layer's copy timed in the load thread (the copy itself is
    lmc's own: only a clock is added around it)."""

    layer_times: list[tuple[int, float, float]] = []  # (layer, start, end) perf_counter

    def _load_layer(self, retrieve: LayerwiseRetrieve, layer: int) -> None:
        t0 = time.perf_counter()
        super()._load_layer(retrieve, layer)
        TimedLinker.layer_times.append((layer, t0, time.perf_counter()))


def bench_linker(a) -> dict[str, Any]:
    tokens = a.pages * a.page
    dev = MHATokenToKVPool(size=2 * tokens, page_size=a.page, dtype=torch.bfloat16,
                           head_num=a.heads, head_dim=a.dim, layer_num=a.layers, device="cpu",
                           enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=2 * tokens, dtype=torch.bfloat16, device="cpu",
                                   kvcache=dev, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(
        size=4, max_context_len=tokens + 1, device="cpu", enable_memory_saver=False),
        token_to_kv_pool_allocator=alloc, page_size=a.page)
    nbytes = 2 * a.layers * tokens * a.heads * a.dim * 2
    linker = create_unified_cache_linker(
        ServerArgs(model_path="bench", page_size=a.page), params, backend="dynamic",
        components={ComponentType.FULL},
        config={"linker": "TimedLinker", "linker_module_path": "__main__",
                "linker_extra_config": {"lmc.local_cpu_size": f"{2 * nbytes >> 20}MiB"}})
    prefaulted(linker.engine)
    for k in dev.k_buffer + dev.v_buffer:
        k.view(torch.int16).random_()
    keys = keys_for("linker", a.pages)
    src = alloc.alloc(tokens)
    linker.offload([PoolTransfer(name=PoolName.KV, keys=keys, device_indices=src)])
    while linker.num_completed_offloads() == 0:
        time.sleep(0.001)
    assert linker.pop_completed_offload()
    counter = linker.layer_done_counter
    dev.register_layer_transfer_counter(counter)
    runs = []
    plan = [0.0] + [0.0, a.compute_ms] * a.reps  # a warm-up, then load-only / with compute
    for compute_ms in plan:
        dst = alloc.alloc(tokens)
        assert linker.load("r", [PoolTransfer(name=PoolName.KV, keys=keys, device_indices=dst)])
        TimedLinker.layer_times = []
        waits = []
        t0 = time.perf_counter()
        index = linker.start_layer_wise_loading()
        counter.set_consumer(index)
        for layer in range(a.layers):
            w0 = time.perf_counter()
            dev.get_key_buffer(layer)  # waits for the layer like an attention backend
            waits.append(time.perf_counter() - w0)
            time.sleep(compute_ms / 1e3)  # the layer's compute (sleeps: off the CPU)
        assert linker.finish_layer_wise_loading(index)
        total = time.perf_counter() - t0
        assert all(torch.equal(dev.k_buffer[la][dst].view(torch.int16),
                               dev.k_buffer[la][src].view(torch.int16))
                   and torch.equal(dev.v_buffer[la][dst].view(torch.int16),
                                   dev.v_buffer[la][src].view(torch.int16))
                   for la in range(a.layers)), "loaded KV differs"
        loads = [e - s for _, s, e in sorted(TimedLinker.layer_times)]
        runs.append({"compute_ms": compute_ms, "total_s": total, "waits_ms": [
            w * 1e3 for w in waits], "loads_ms": [x * 1e3 for x in loads]})
        alloc.free(dst)
    linker.close()
    with_compute = [r for r in runs[1:] if r["compute_ms"] > 0]
    alone = [r for r in runs[1:] if r["compute_ms"] == 0]

    def med(rs: list[dict], f) -> float:
        return statistics.median(f(r) for r in rs)

    load_ms = med(alone, lambda r: sum(r["loads_ms"]))
    serial = [sum(r["loads_ms"]) + a.layers * a.compute_ms for r in with_compute]
    return {
        "bytes": nbytes, "layers": a.layers, "compute_ms": a.compute_ms, "runs": runs,
        "load_alone_ms": load_ms, "load_gibs": nbytes / (load_ms / 1e3) / GIB,
        "per_layer_load_ms": [statistics.median(r["loads_ms"][la] for r in with_compute)
                              for la in range(a.layers)],
        "per_layer_wait_ms": [statistics.median(r["waits_ms"][la] for r in with_compute)
                              for la in range(a.layers)],
        "total_ms": [r["total_s"] * 1e3 for r in with_compute],
        "serial_ms": serial,
        "overlap_ratio": [r["total_s"] * 1e3 / s for r, s in zip(with_compute, serial)],
        "later_wait_ms": [sum(r["waits_ms"][1:]) for r in with_compute],
    }


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    return (fmt.format(statistics.median(xs)) + " (" + fmt.format(min(xs)) + "–"
            + fmt.format(max(xs)) + ")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=32)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compute-ms", type=float, default=10.0,
                    help="the forward's time per layer (default %(default)s)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    before = _load()
    page_mib = 2 * a.layers * a.page * a.heads * a.dim * 2 / (1 << 20)
    print(f"geometry: {a.layers} layers, {a.heads} KV heads x {a.dim}, bf16, page {a.page} "
          f"tokens ({page_mib:.2f} MiB/page), {a.pages} pages per call; 1 torch thread; "
          f"{a.reps} interleaved repetitions; load average {before}", flush=True)
    h = bench_hicache(a)
    print(f"\n{h['bytes'] >> 20} MiB per call. GiB/s: median (min–max) over the repetitions; "
          "ratio: median (min–max) of each repetition's figure over its torch copy")
    print(f"\n| path | GiB/s | vs torch copy, 1 thread ({_spread(h['copy_gibs'])} GiB/s) |")
    print("|---|---|---|")
    names = [(f"{lay} {op}", f"HiCache `{lay}` `batch_{op}_v1`") for lay in LAYOUTS
             for op in ("set", "get")]
    names += [("engine store", "lmc CPU tier: `CacheEngine.store` (vllm_flash, 256-token chunks)"),
              ("engine retrieve", "lmc CPU tier: `CacheEngine.retrieve` (same)")]
    for key, label in names:
        f = h[key]
        lo, hi = f["ratio_range"]
        print(f"| {label} | {_spread(f['gibs'])} | **{f['ratio_median']:.2f}** "
              f"({lo:.2f}–{hi:.2f}) |")
    r = bench_linker(a)
    print(f"\nlinker: {r['bytes'] >> 20} MiB over {a.layers} layers; load alone "
          f"{r['load_alone_ms']:.1f} ms ({r['load_gibs']:.2f} GiB/s); with "
          f"{a.compute_ms:.1f} ms compute per layer: total {_spread(r['total_ms'], '{:.1f}')} ms"
          f" vs serial {_spread(r['serial_ms'], '{:.1f}')} ms (ratio "
          f"{_spread(r['overlap_ratio'])}); the forward waited "
          f"{_spread(r['later_wait_ms'], '{:.2f}')} ms in all after layer 0")
    print("\n| layer | load (ms) | forward's wait (ms) |\n|---|---|---|")
    for la in range(a.layers):
        print(f"| {la} | {r['per_layer_load_ms'][la]:.2f} | {r['per_layer_wait_ms'][la]:.2f} |")
    after = _load()
    print(f"\nload average before {before}, after {after}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "load_before": before, "load_after": after,
                       "hicache": h, "linker": r}, f, indent=1)


if __name__ == "__main__":
    main()
