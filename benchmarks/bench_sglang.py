"""SGLang connector benchmarks, run with the SGLang venv's python (``LMC_SGLANG_PYTHON``).

    $LMC_SGLANG_PYTHON benchmarks/bench_sglang.py [--layers 16] [--pages 128] [--page 32]

1. HiCache backend: ``batch_set_v1`` / ``batch_get_v1`` GiB/s between SGLang's real host pool
   (``layer_first`` and ``page_first``) and lmc's L1, next to lmc's own ``CacheEngine``
   store/retrieve of the same bytes from a paged (``vllm_flash``) cache: the cost of SGLang's
   page layout on lmc's data path.
2. Linker overlap: a batch loaded through ``LMCCacheLinker`` (built by SGLang's factory on a
   real ``MHATokenToKVPool``) while a forward "computes" each layer for a fixed time; per
   layer, how long the forward waited in ``wait_until`` against how long the layer took to
   load, and the total against the serial sum.

No patches: everything here runs on SGLang's unmodified classes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "connectors", "sglang_scripts"))
import sglang_env  # noqa: E402

sglang_env.stub_missing_torchvision()
import torch  # noqa: E402
from lmc.connectors.sglang import LMCHiCacheStorage  # noqa: E402
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

GIB = 1 << 30


def keys_for(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def best(fn, reps: int) -> float:
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_hicache(a) -> list[tuple[str, float, float]]:
    dev = MHATokenToKVPool(size=a.pages * a.page, page_size=a.page, dtype=torch.bfloat16,
                           head_num=a.heads, head_dim=a.dim, layer_num=a.layers, device="cpu",
                           enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    rows = []
    nbytes = 2 * a.layers * a.pages * a.page * a.heads * a.dim * 2
    pool_size = f"{max(256, 3 * nbytes * (a.reps + 1) // (1 << 20))}MiB"
    for layout in ("layer_first", "page_first"):
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
        src, dst = host.alloc(a.pages * a.page), host.alloc(a.pages * a.page)
        host.kv_buffer.view(torch.int16).random_()
        t_set = best(lambda r, src=src, b=b, layout=layout: b.batch_set_v1(
            keys_for(f"{layout}{r}", a.pages), src), a.reps)
        t_get = best(lambda r, dst=dst, b=b, layout=layout: b.batch_get_v1(
            keys_for(f"{layout}{r}", a.pages), dst), a.reps)
        ok = all(torch.equal(host.get_data_page(int(src[i * a.page])).view(torch.int16),
                             host.get_data_page(int(dst[i * a.page])).view(torch.int16))
                 for i in range(a.pages))  # bit patterns: random bf16 bits include NaNs
        assert ok, "pages differ"
        rows.append((f"HiCache {layout} batch_set_v1 / batch_get_v1", nbytes / t_set / GIB,
                     nbytes / t_get / GIB))
        b.close()
    # lmc's own data path, same bytes: CacheEngine store/retrieve on a paged cache
    spec = KVSpec(a.layers, a.heads, a.dim, torch.bfloat16, a.page, "vllm_flash")
    caches = [torch.empty(2, a.pages * 2, a.page, a.heads, a.dim, dtype=torch.bfloat16)
              for _ in range(a.layers)]
    for c in caches:
        c.view(torch.int16).random_()
    n = a.pages * a.page
    with CacheEngine(CacheConfig(chunk_size=256, local_cpu_size=pool_size), spec, "bench") as e:
        slots = torch.arange(n)
        t_store = best(lambda r: e.store(list(range(r * n + 1, r * n + n + 1)), caches, slots),
                       a.reps)
        back = torch.arange(n, 2 * n)
        t_ret = best(lambda r: e.retrieve(list(range(r * n + 1, r * n + n + 1)), caches, back),
                     a.reps)
    rows.append(("lmc CacheEngine store / retrieve (vllm_flash, 256-token chunks)",
                 nbytes / t_store / GIB, nbytes / t_ret / GIB))
    return rows


def bench_linker(a) -> dict:
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
        config={"linker": "LMCCacheLinker", "linker_module_path": "lmc.connectors.sglang",
                "linker_extra_config": {"lmc.local_cpu_size": f"{3 * nbytes >> 20}MiB"}})
    for k in dev.k_buffer + dev.v_buffer:
        k.view(torch.int16).random_()
    keys = keys_for("linker", a.pages)
    src = alloc.alloc(tokens)
    linker.offload([PoolTransfer(name=PoolName.KV, keys=keys, device_indices=src)])
    while linker.num_completed_offloads() == 0:
        time.sleep(0.001)
    assert linker.pop_completed_offload()
    counter = linker.layer_done_counter
    out = {}
    for compute_ms in (0.0, 0.0, a.compute_ms):  # the first run warms the pool's pages
        dst = alloc.alloc(tokens)
        assert linker.load("r", [PoolTransfer(name=PoolName.KV, keys=keys, device_indices=dst)])
        waits = []
        t0 = time.perf_counter()
        index = linker.start_layer_wise_loading()
        counter.set_consumer(index)
        for layer in range(a.layers):
            w0 = time.perf_counter()
            dev.register_layer_transfer_counter(counter)
            dev.get_key_buffer(layer)  # waits for the layer like an attention backend
            waits.append(time.perf_counter() - w0)
            time.sleep(compute_ms / 1e3)
        assert linker.finish_layer_wise_loading(index)
        total = time.perf_counter() - t0
        assert all(torch.equal(dev.k_buffer[la][dst].view(torch.int16),
                               dev.k_buffer[la][src].view(torch.int16)) for la in range(a.layers))
        out[compute_ms] = (total, waits)
        alloc.free(dst)
    load_only, waits0 = out[0.0]
    total, waits = out[a.compute_ms]
    linker.close()
    per_layer_load = load_only / a.layers
    return {"bytes": nbytes, "load_only_s": load_only, "per_layer_load_ms": per_layer_load * 1e3,
            "load_only_waits_ms": [round(w * 1e3, 2) for w in waits0],
            "waits_ms": [round(w * 1e3, 2) for w in waits],
            "total_s": total, "compute_ms": a.compute_ms,
            "serial_s": load_only + a.layers * a.compute_ms / 1e3,
            "mean_wait_ms": statistics.mean(waits[1:]) * 1e3, "first_wait_ms": waits[0] * 1e3,
            "load_gibs": nbytes / load_only / GIB}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=32)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compute-ms", type=float, default=5.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    page_mib = 2 * a.layers * a.page * a.heads * a.dim * 2 / (1 << 20)
    print(f"geometry: {a.layers} layers, {a.heads} KV heads x {a.dim}, bf16, page {a.page} "
          f"tokens ({page_mib:.2f} MiB/page), {a.pages} pages per call; 1 torch thread")
    print("\n| path | store GiB/s | load GiB/s |\n|---|---|---|")
    for name, s, g in bench_hicache(a):
        print(f"| {name} | {s:.2f} | {g:.2f} |")
    r = bench_linker(a)
    print(f"\nlinker: {r['bytes'] / (1 << 20):.0f} MiB over {a.layers} layers; load alone "
          f"{r['load_only_s'] * 1e3:.1f} ms ({r['per_layer_load_ms']:.2f} ms/layer, "
          f"{r['load_gibs']:.2f} GiB/s); with {a.compute_ms:.1f} ms compute per layer: "
          f"{r['total_s'] * 1e3:.1f} ms vs {r['serial_s'] * 1e3:.1f} ms serial; the forward "
          f"waited {r['first_wait_ms']:.2f} ms at layer 0 and {r['mean_wait_ms']:.3f} ms per "
          "later layer on average")
    print(f"per-layer wait, load only (= load time): {r['load_only_waits_ms']}")
    print(f"per-layer wait with compute:             {r['waits_ms']}")


if __name__ == "__main__":
    main()
