"""LMCCacheLinker through SGLang 0.5.23's own external-linker wiring, on CPU.

    python sglang_linker_flow.py

The tree, wrapper, counter registration and the per-batch calls are SGLang's: startup goes
through ``registry.create_tree_cache`` (the dynamic linker factory, the counter registered
on the KV pool and on the worker through ``TpModelWorker``'s own methods), and each prefill
makes the scheduler's calls (``match_prefix`` -> ``init_load_back`` ->
``ready_to_load_host_cache`` -> ``set_hicache_consumer`` -> per-layer
``get_key_buffer`` -> ``finish_external_linker_loads``; ``insert`` -> offload ->
``check_hicache_events``). Only the model forward is simulated: each layer reads its K
(``get_key_buffer``, which waits for that layer) and then "computes" for a fixed time.

Checks, each printed as ``PASS <name>``:
* save: insert offloads every page, the offload commits; disk writes are held back so
  pages are still queued at shutdown, and ``close()`` must drain them to disk;
* load in a restarted engine: every layer's K/V is in the pool when ``wait_until(layer)``
  returns (checked before that layer computes), bit-exact, and loads overlap compute;
* a failure at one layer: the request is aborted (``FINISH_ABORT``), no wait hangs;
* a queued load cancelled by the request's release, ``reset``/``close`` under load;
* a dead remote tier (Redis, the lmc daemon): lookups and loads still served from disk,
  nothing hangs;
* after every prefill, failed or not: no tree node left locked, no load left queued.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from array import array
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_env  # noqa: E402

sglang_env.apply_cpu_shim()
import sglang_test_linkers  # noqa: E402
import torch  # noqa: E402
from sglang.srt.managers.tp_worker import TpModelWorker  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import build_fixture  # noqa: E402
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402

from lmc.connectors.sglang import LMCCacheLinker  # noqa: E402

PAGE, LAYERS, PAGES = 4, 8, 8
LAYER_S = 0.03
TMP = tempfile.mkdtemp(prefix="lmc-sglang-linker-")
CFG = CacheConfig(page_size=PAGE, components=(ComponentType.FULL,), num_layers=LAYERS,
                  head_num=2, head_dim=8, kv_size=512)
KIT = UnifiedRadixCacheFixtures()
KIT.cfg = CFG
SEQ = list(range(5000, 5000 + PAGES * PAGE))


class Worker(SimpleNamespace):
    """The scheduler-side worker: TpModelWorker's own counter methods, no model."""

    register_hicache_layer_transfer_counter = (
        TpModelWorker.register_hicache_layer_transfer_counter)
    set_hicache_consumer = TpModelWorker.set_hicache_consumer


def passed(name: str) -> None:
    print(f"PASS {name}", flush=True)


def engine(linker: str = "LMCCacheLinker", module: str = "lmc.connectors.sglang", **extra):
    """A fresh KV pool and tree wired the way the scheduler wires them at startup."""
    fixture_cache, alloc, rtp = build_fixture(CFG)
    cfg = {"lmc.local_cpu_size": "32MiB", "lmc.model_id": "tiny-sglang",
           "lmc.local_disk": os.path.join(TMP, "disk"), **extra}
    sa = ServerArgs(model_path="dummy", page_size=PAGE, enable_unified_cache_external_linker=True,
                    unified_cache_external_linker_backend="dynamic",
                    unified_cache_external_linker_config={
                        "linker": linker, "linker_module_path": module,
                        "linker_extra_config": cfg})
    set_global_server_args_for_scheduler(sa)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    worker = Worker(model_runner=SimpleNamespace(forward_stream=None),
                    hicache_layer_transfer_counter=None)
    ctx = TreeCacheBuildContext(
        server_args=sa, params=fixture_cache.cache_init_params, is_hybrid_swa=False,
        is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False,
        tp_worker=worker, model_config=None, tp_size=1, tp_rank=0, tp_group=None)
    cache = create_tree_cache(ctx)
    assert isinstance(cache.linker.cache_linker, LMCCacheLinker)
    kv = alloc.get_kvcache()
    assert kv.layer_transfer_counter is cache.linker.cache_linker.layer_done_counter
    assert worker.hicache_layer_transfer_counter is kv.layer_transfer_counter
    return cache, alloc, rtp, worker


def random_kv(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)

    def one():
        return torch.randint(-32768, 32767, (n, 2, 8), generator=g,
                             dtype=torch.int16).view(CFG.dtype)

    return [(one(), one()) for _ in range(LAYERS)]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def disk_files() -> int:
    d = os.path.join(TMP, "disk")
    return sum(n.endswith(".kv") for n in os.listdir(d)) if os.path.isdir(d) else 0


def save(expected) -> None:
    """Disk writes are held until shutdown (a disk far slower than the offloads), one page in
    flight and the rest queued in lmc's write-behind: only a draining ``close()`` gets them
    all to disk, where the restarted engines below load them from."""
    from lmc.storage.backends.disk.backend import DiskBackend

    released = threading.Event()
    real_put = DiskBackend.put

    def held_put(self, keys, objs):
        released.wait(20)
        return real_put(self, keys, objs)

    DiskBackend.put = held_put
    try:
        _save(expected, released)
    finally:
        DiskBackend.put = real_put


def _save(expected, released: threading.Event) -> None:
    cache, alloc, _, _ = engine()
    for q in cache.linker.cache_linker.engine.storage.queues:
        q.batch_chunks = 1
    kv = alloc.get_kvcache()
    slots = alloc.alloc(len(SEQ))
    for layer, (k, v) in enumerate(expected):  # the prefill forward wrote these
        kv.k_buffer[layer][slots] = k
        kv.v_buffer[layer][slots] = v
    cache.insert(InsertParams(key=RadixKey(array("q", SEQ)), value=slots))
    linker = cache.linker.cache_linker
    deadline = time.time() + 20
    while cache.linker.pending_offloads and time.time() < deadline:
        cache.check_hicache_events()
        time.sleep(0.005)
    assert not cache.linker.pending_offloads, "offload never committed"
    assert linker.counts.get("offloaded_pages", 0) == PAGES, linker.counts
    assert cache.protected_size() == 0, f"{cache.protected_size()} tokens left locked"
    on_disk = disk_files()
    assert on_disk < PAGES, f"all {on_disk} pages were on disk before close()"
    released.set()
    cache.linker.close()  # what the engine's shutdown reaches: drains to the disk tier
    assert disk_files() == PAGES, f"close() left {PAGES - disk_files()} pages unwritten"
    passed(f"save: insert offloaded {PAGES} pages, committed through check_hicache_events; "
           f"{on_disk} on disk when close() began, all {PAGES} after (it drained the queue)")


def prefill(cache, alloc, rtp, worker, expected, compute_s: float, seq=SEQ):
    """One prefill of ``seq``: the scheduler's calls, a forward reading K per layer."""
    kv = alloc.get_kvcache()
    req = KIT._make_req(rtp)
    req.origin_input_ids = array("q", seq)
    mr = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", seq)), req=req))
    KIT._apply_match_to_req(req, mr)
    loaded, _ = cache.init_load_back(InitLoadBackParams(
        best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
    slots = cache.linker.private_load_indices.get(req.rid)
    slots = None if slots is None else slots.clone()
    sglang_test_linkers.TRACE.clear()
    landed_at_wait = []
    t0 = time.perf_counter()
    index = cache.ready_to_load_host_cache()
    worker.set_hicache_consumer(index)
    for layer in range(LAYERS):
        kv.get_key_buffer(layer)  # the attention's read: blocks in wait_until(layer)
        if slots is not None:  # this layer must already be in the pool
            landed_at_wait.append(same(kv.k_buffer[layer][slots], expected[layer][0]) and
                                  same(kv.v_buffer[layer][slots], expected[layer][1]))
        sglang_test_linkers.TRACE.append((time.perf_counter(), "compute_start", layer))
        time.sleep(compute_s)
    failed = cache.finish_external_linker_loads([req])
    dt = time.perf_counter() - t0
    # nothing left behind, failed or not: no node locked, no load in flight or queued
    assert cache.protected_size() == 0, f"{cache.protected_size()} tokens left locked"
    assert cache.linker.inflight_load_rids == [] and not cache.linker.cache_linker._queued
    return SimpleNamespace(req=req, match=mr, loaded=loaded, slots=slots, index=index,
                           failed=failed, dt=dt, landed_at_wait=landed_at_wait)


def check_load(expected) -> None:
    cache, alloc, rtp, worker = engine("SlowLayerLinker", "sglang_test_linkers",
                                       **{"test.layer_delay_s": LAYER_S})
    r = prefill(cache, alloc, rtp, worker, expected, LAYER_S)
    assert r.match.host_hit_length == len(SEQ), r.match
    assert r.loaded == len(SEQ) and r.index >= 0 and not r.failed
    assert r.landed_at_wait == [True] * LAYERS, r.landed_at_wait
    serial = 2 * LAYERS * LAYER_S
    trace = sorted(sglang_test_linkers.TRACE)
    print(f"load+forward: {r.dt * 1e3:.0f} ms for {LAYERS} layers of {LAYER_S * 1e3:.0f} ms "
          f"load + {LAYER_S * 1e3:.0f} ms compute (serial {serial * 1e3:.0f} ms, ideal "
          f"{(LAYERS + 1) * LAYER_S * 1e3:.0f} ms); trace "
          f"{[(round((t - trace[0][0]) * 1e3), e, la) for t, e, la in trace[:6]]}", flush=True)
    assert r.dt < 0.8 * serial, f"no overlap: {r.dt:.3f}s vs serial {serial:.3f}s"
    cache.linker.close()
    passed(f"load: restarted engine hit {len(SEQ)} tokens from disk; each layer in the pool "
           f"when wait_until returned, bit-exact; {r.dt * 1e3:.0f} ms vs {serial * 1e3:.0f} ms "
           "serial")


def check_failure(expected) -> None:
    cache, alloc, rtp, worker = engine("FailingLayerLinker", "sglang_test_linkers")
    t0 = time.perf_counter()
    r = prefill(cache, alloc, rtp, worker, expected, 0.0)
    assert time.perf_counter() - t0 < 10, "a wait hung after the failure"
    assert [q.rid for q in r.failed] == [r.req.rid], r.failed
    reason = getattr(r.req, "discard_output_reason", None)
    assert reason is not None and "External KV cache load failed" in str(
        getattr(reason, "message", reason)), reason
    assert r.req.skip_radix_cache_insert
    linker = cache.linker.cache_linker
    assert linker.counts.get("load_failures") == 1, linker.counts
    # the layers before the failure landed; none after it was written
    fail_at = sglang_test_linkers.FailingLayerLinker.FAIL_AT
    assert r.landed_at_wait[:fail_at] == [True] * fail_at
    assert not any(r.landed_at_wait[fail_at:]), r.landed_at_wait
    cache.linker.close()
    passed(f"failure at layer {fail_at}: request aborted with FINISH_ABORT, not inserted, no "
           "wait hung")


def check_cancel_and_reset(expected) -> None:
    cache, alloc, rtp, worker = engine()
    linker = cache.linker.cache_linker
    pool = linker.engine.pool
    req = KIT._make_req(rtp)
    mr = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", SEQ)), req=req))
    KIT._apply_match_to_req(req, mr)
    cache.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node,
                                            host_hit_length=req.host_hit_length, req=req))
    assert req.rid in linker._queued
    cache.linker.release_request(req.rid)  # the request went away before its batch ran
    assert req.rid not in linker._queued and cache.linker.inflight_load_rids == []
    assert cache.ready_to_load_host_cache() == -1
    # reset and close while a load is in flight
    r2 = KIT._make_req(rtp)
    mr = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", SEQ)), req=r2))
    KIT._apply_match_to_req(r2, mr)
    cache.init_load_back(InitLoadBackParams(best_match_node=r2.best_match_node,
                                            host_hit_length=r2.host_hit_length, req=r2))
    cache.ready_to_load_host_cache()
    cache.linker.reset()
    assert linker.num_completed_offloads() == 0
    referenced = pool.used_bytes
    cache.linker.close()
    print(f"pool bytes in use before close: {referenced}", flush=True)
    passed("cancel: a released request's queued load is dropped with its references; "
           "reset()/close() with a load in flight return")


def check_dead_remote(expected) -> None:
    """A Redis and an lmc cache-server remote tier that nobody answers: lookups and loads
    are served from the disk tier, bit-exact, without waiting on the dead address."""
    took = []
    for url in ("redis://127.0.0.1:9/0", "lmc://127.0.0.1:9"):
        cache, alloc, rtp, worker = engine(**{"lmc.remote_url": url,
                                              "lmc.remote_timeout": 0.5})
        t0 = time.perf_counter()
        r = prefill(cache, alloc, rtp, worker, expected, 0.0)
        assert r.match.host_hit_length == len(SEQ) and not r.failed, url
        assert r.landed_at_wait == [True] * LAYERS, url
        cache.linker.close()
        took.append(f"{url.split(':')[0]} {time.perf_counter() - t0:.1f}s")
    passed(f"dead remote tier (Redis, lmc daemon): served from disk, bit-exact, "
           f"{', '.join(took)}")


def check_cross_engine(expected) -> None:
    """Another lmc engine with a paged (vllm_flash, the reference engine's) cache and the
    tokens names SGLang's pages with ``sglang_page_hashes``: it loads what SGLang offloaded,
    and SGLang loads what it stored, bit for bit."""
    from lmc import CacheConfig, CacheEngine, KVSpec
    from lmc.connectors.sglang.pages import PageStore, page_namespace, sglang_page_hashes

    blocks = 2 * PAGES
    caches = [torch.zeros(2, blocks, PAGE, 2, 8, dtype=CFG.dtype) for _ in range(LAYERS)]
    spec = KVSpec.from_tensors(caches, "vllm_flash")
    ns = page_namespace("tiny-sglang", spec, page_size=PAGE, tp_rank=0, tp_size=1)
    cfg = CacheConfig(local_cpu_size="32MiB", local_disk=os.path.join(TMP, "disk"))
    with CacheEngine(cfg, spec, "tiny-sglang") as eng:
        pages = PageStore(eng, ns, PAGE, caches)
        slots = torch.arange(PAGE, PAGE + len(SEQ))  # any slots: blocks 1..PAGES
        assert pages.load(sglang_page_hashes(SEQ, PAGE), slots) == [True] * PAGES
        for layer, (k, v) in enumerate(expected):
            flat = caches[layer].flatten(1, 2)  # [2, slots, heads, dim]
            assert same(flat[0, slots], k) and same(flat[1, slots], v), layer
        # the other way: KV this engine holds for new tokens, stored under SGLang's keys
        other = [t + 100_000 for t in SEQ]
        theirs = random_kv(len(other), seed=6)
        for layer, (k, v) in enumerate(theirs):
            caches[layer].flatten(1, 2)[0, slots] = k
            caches[layer].flatten(1, 2)[1, slots] = v
        assert pages.store(sglang_page_hashes(other, PAGE), slots) == [True] * PAGES
    cache, alloc, rtp, worker = engine()  # a fresh SGLang engine on the same disk tier
    r = prefill(cache, alloc, rtp, worker, theirs, 0.0, seq=other)
    assert r.match.host_hit_length == len(other) and not r.failed
    assert r.landed_at_wait == [True] * LAYERS, r.landed_at_wait
    cache.linker.close()
    passed("cross-engine: a paged (vllm_flash) lmc engine loads SGLang's offloaded pages and "
           "SGLang loads the pages it stored, bit-exact, keyed by sglang_page_hashes(tokens)")


def main() -> None:
    expected = random_kv(len(SEQ), seed=5)
    save(expected)
    check_load(expected)
    check_failure(expected)
    check_cancel_and_reset(expected)
    check_dead_remote(expected)
    check_cross_engine(expected)
    print("RESULT: PASS", flush=True)


if __name__ == "__main__":
    main()
