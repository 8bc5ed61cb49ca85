"""LMCHiCacheStorage through SGLang 0.5.23's own HiCache control flow, on CPU.

    python sglang_hicache_flow.py --layout layer_first|page_first [--generic] [--fault F]

SGLang's real ``UnifiedRadixCache`` and ``HybridCacheController`` (its storage threads,
prefetch and backup queues, host pool, ``LayerDoneCounter``) load lmc's backend through the
``dynamic`` factory. A producer inserts a prompt, its forward "writes" random K/V on every
layer, the controller backs the pages up to host and then to lmc; SGLang's detach calls
``close()``, which must flush them to lmc's disk tier. A consumer (a fresh tree, pools and
backend: a restarted engine) prefetches from lmc, matches, loads back layer by layer, and
every layer's K/V must be bit-exact.

Faults: ``random`` (SGLang's ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE``/``_DELAY``, set
by the caller), ``dead-remote`` (a Redis remote tier nobody listens on) and ``dead-daemon``
(an lmc cache-server address nobody listens on) must give fewer hits, never a crash, a hang,
a leaked lock (no tree node stays locked, no prefetch or load-back stays in flight) or wrong
KV. ``slow-disk`` delays every disk write, so the producer's pages are still queued for the
disk when SGLang detaches the backend: the restarted engine finds them all only if
``close()`` flushed them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from array import array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_env  # noqa: E402

sglang_env.apply_cpu_shim()
import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    CacheRequestHandle,
    InitLoadBackParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import (  # noqa: E402
    build_fixture,
    match_prefix,
    node_parent,
    write_backup,
)
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402

from lmc.connectors.sglang import LMCHiCacheStorage  # noqa: E402

PAGE, LAYERS, PAGES = 4, 4, 6
DEADLINE = 30.0


SCENARIOS = [  # (layout, generic path, fault): what --all runs, in one process
    ("layer_first", False, "none"), ("page_first", False, "none"),
    ("layer_first", True, "none"), ("page_first", True, "none"),
    ("page_first", False, "random"), ("layer_first", False, "dead-remote"),
    ("page_first", False, "dead-daemon"), ("layer_first", False, "slow-disk"),
]
FAULTS = ("none", "random", "dead-remote", "dead-daemon", "slow-disk")
FULL_HITS = ("none", "dead-remote", "dead-daemon", "slow-disk")  # the disk tier has every page
DISK_RELEASED = threading.Event()  # slow-disk: disk writes may proceed (set at detach)
RANDOM_FAULTS = {"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.3",
                 "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY": "0.02"}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=("layer_first", "page_first"), default="layer_first")
    ap.add_argument("--generic", action="store_true", help="interface_v1 off: batch_get/set")
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--all", action="store_true", help="every scenario of SCENARIOS")
    return ap.parse_args()


def init_hicache(cache, args, lmc_extra: dict):
    extra = {"backend_name": "lmc", "module_path": "lmc.connectors.sglang",
             "class_name": "LMCHiCacheStorage", "prefetch_threshold": 1,
             "lmc.local_cpu_size": "32MiB", "lmc.model_id": "tiny-sglang", **lmc_extra}
    if not args.generic:
        extra["interface_v1"] = 1
    sa = ServerArgs(model_path="dummy", page_size=PAGE,
                    hicache_io_backend="direct" if args.layout == "layer_first" else "kernel",
                    hicache_mem_layout=args.layout, hicache_write_policy="write_through",
                    hicache_storage_backend="dynamic",
                    hicache_storage_backend_extra_config=json.dumps(extra),
                    hicache_storage_prefetch_policy="wait_complete")
    set_global_server_args_for_scheduler(sa)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    cache.init_hicache(sa, cache.cache_init_params)
    cache.write_through_threshold = 1 << 30  # backups are driven by hand below
    cache.load_back_threshold = 0
    cc = cache.cache_controller
    cc.prefetch_capacity_limit = max(cc.prefetch_capacity_limit, cc.mem_pool_host.size)
    return cc


def lmc_backend(cc) -> LMCHiCacheStorage:
    b = cc.storage_backend
    b = getattr(b, "_backend", b)  # SGLang's failure injector wraps it
    assert isinstance(b, LMCHiCacheStorage), type(b)
    return b


def path(cache, node) -> list:
    out = []
    while node != cache.root_node_handle():
        out.append(node)
        node = node_parent(cache, node)
    return out[::-1]


def main() -> None:
    args = parse()
    runs = SCENARIOS if args.all else [(args.layout, args.generic, args.fault)]
    for layout, generic, fault in runs:
        print(f"=== {layout} {'generic' if generic else 'v1'} fault={fault}", flush=True)
        env = RANDOM_FAULTS if fault == "random" else {}
        os.environ.update(env)  # SGLang reads them when it builds the backend
        try:
            run(argparse.Namespace(layout=layout, generic=generic, fault=fault))
        finally:
            for k in env:
                os.environ.pop(k, None)
    print("RESULT: PASS", flush=True)


def run(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="lmc-sglang-hicache-")
    lmc_extra = {"lmc.local_disk": os.path.join(tmp, "disk")}
    if args.fault == "dead-remote":
        lmc_extra.update({"lmc.remote_url": "redis://127.0.0.1:9/0", "lmc.remote_timeout": 0.5})
    if args.fault == "dead-daemon":
        lmc_extra.update({"lmc.remote_url": "lmc://127.0.0.1:9", "lmc.remote_timeout": 0.5})
    slow = slow_disk() if args.fault == "slow-disk" else contextlib.nullcontext()
    with slow:
        _run(args, t_start, tmp, lmc_extra)


def slow_disk():
    """Disk tier writes wait until the producer detaches (a disk far slower than the
    stores): the writer holds one page inside ``put`` (batches of one, set by the caller),
    the others queue in lmc's write-behind, as on a busy disk; only a draining ``close()``
    writes those."""
    from lmc.storage.backends.disk.backend import DiskBackend

    real = DiskBackend.put
    DISK_RELEASED.clear()

    def put(self, keys, objs):
        DISK_RELEASED.wait(DEADLINE)
        return real(self, keys, objs)

    @contextlib.contextmanager
    def patched():
        DiskBackend.put = put
        try:
            yield
        finally:
            DiskBackend.put = real

    return patched()


def disk_files(tmp: str) -> int:
    d = os.path.join(tmp, "disk")
    return sum(n.endswith(".kv") for n in os.listdir(d)) if os.path.isdir(d) else 0


def _run(args: argparse.Namespace, t_start: float, tmp: str, lmc_extra: dict) -> None:
    cfg = CacheConfig(page_size=PAGE, components=(ComponentType.FULL,), num_layers=LAYERS,
                      head_num=2, head_dim=8, kv_size=256)
    kit = UnifiedRadixCacheFixtures()
    kit.cfg = cfg

    # ---------------------------------------------------------------- producer
    prod, prod_alloc, prod_rtp = build_fixture(cfg)
    cc = init_hicache(prod, args, lmc_extra)
    if args.fault == "slow-disk":
        for q in lmc_backend(cc).engine.storage.queues:
            q.batch_chunks = 1  # one page in flight, the rest queued behind it
    kv = prod_alloc.get_kvcache()
    seq = list(range(7000, 7000 + PAGES * PAGE))
    kit._insert(prod, prod_alloc, prod_rtp, seq)
    m = match_prefix(prod, seq)
    slots = prod.path_device_indices(m.last_device_node)
    g = torch.Generator().manual_seed(11)
    expected = []
    for layer in range(LAYERS):  # what the forward wrote: arbitrary bits, NaNs included
        k = torch.randint(-32768, 32767, (len(slots), 2, 8), generator=g,
                          dtype=torch.int16).view(cfg.dtype)
        v = torch.randint(-32768, 32767, (len(slots), 2, 8), generator=g,
                          dtype=torch.int16).view(cfg.dtype)
        kv.k_buffer[layer][slots] = k
        kv.v_buffer[layer][slots] = v
        expected.append((k, v))
    nodes = path(prod, m.last_device_node)
    for n in nodes:
        write_backup(prod, n, write_back=True)
    prod.writing_check(write_back=True)
    for n in nodes:
        prod.write_backup_storage(n)
    deadline = time.time() + DEADLINE
    while prod.ongoing_backup and time.time() < deadline:
        prod.drain_storage_control_queues()
        time.sleep(0.01)
    prod.drain_storage_control_queues()
    assert not prod.ongoing_backup, f"backup hung: {len(prod.ongoing_backup)} in flight"
    pb = lmc_backend(cc)
    stored = pb.stats_counts.get("pages_stored", 0)
    print(f"producer: {stored} pages stored, backend calls ok, "
          f"{time.perf_counter() - t_start:.1f}s", flush=True)
    if args.fault != "random":
        assert stored >= PAGES, pb.stats_counts  # repeated backups answer True again
    assert prod.protected_size() == 0, f"producer left {prod.protected_size()} tokens locked"
    on_disk = disk_files(tmp)
    DISK_RELEASED.set()  # slow-disk: the held writes may go on, behind close()'s drain
    cc.detach_storage_backend()  # SGLang's own detach: stops the threads, calls close()
    assert pb._closed
    if args.fault == "slow-disk":  # else the restart below would not show close()'s flush
        assert on_disk < PAGES, f"all {on_disk} pages were on disk before close()"
        assert disk_files(tmp) >= PAGES, f"close() left {PAGES - disk_files(tmp)} unwritten"
        print(f"close(): {on_disk} of {PAGES} pages were on disk at detach, "
              f"{disk_files(tmp)} after", flush=True)

    # ---------------------------------------------------------------- consumer
    cons, cons_alloc, cons_rtp = build_fixture(cfg)
    ccc = init_hicache(cons, args, lmc_extra)
    handle = CacheRequestHandle("req-1", 0)
    cons.prefetch_from_storage(handle, cons.root_node_handle(), array("q", seq), None, None)
    deadline = time.time() + DEADLINE
    while time.time() < deadline:
        cons.check_hicache_events()
        if cons.check_prefetch_progress(handle):
            break
        time.sleep(0.01)
    else:
        raise SystemExit("prefetch hung")
    req = kit._make_req(cons_rtp)
    mr = cons.match_prefix(MatchPrefixParams(key=RadixKey(array("q", seq)), req=req))
    kit._apply_match_to_req(req, mr)
    hit = mr.host_hit_length
    print(f"consumer: host_hit_length={hit} of {len(seq)}", flush=True)
    assert hit % PAGE == 0 and 0 <= hit <= len(seq)
    if args.fault in FULL_HITS:
        assert hit == len(seq), hit
    ok = True
    if hit:
        cons.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node,
                                               host_hit_length=req.host_hit_length, req=req))
        producer_id = cons.ready_to_load_host_cache()
        counter = ccc.layer_done_counter
        counter.set_consumer(producer_id)
        ckv = cons_alloc.get_kvcache()
        ckv.register_layer_transfer_counter(counter)
        for layer in range(LAYERS):
            ckv.get_key_buffer(layer)  # the attention's read: waits for this layer
        for ack in list(ccc.ack_load_queue):
            ack.finish_event.synchronize()
        cons.loading_check()
        m2 = match_prefix(cons, seq)
        assert m2.device_prefix_len == hit, m2
        idx = cons.path_device_indices(m2.last_device_node)
        bits = torch.int16
        ok = all(torch.equal(ckv.k_buffer[la][idx].view(bits), expected[la][0][:hit].view(bits))
                 and torch.equal(ckv.v_buffer[la][idx].view(bits),
                                 expected[la][1][:hit].view(bits)) for la in range(LAYERS))
    print(f"bit-exact K/V on all {LAYERS} layers for the {hit} loaded tokens: {ok}", flush=True)
    assert ok
    assert not cons.ongoing_prefetch, "prefetch left in flight"
    assert not cons.ongoing_load_back, "load-back left in flight"
    assert cons.protected_size() == 0, f"consumer left {cons.protected_size()} tokens locked"
    cb = lmc_backend(ccc)
    print(f"consumer backend: {cb.stats_counts}", flush=True)
    ccc.detach_storage_backend()
    print(f"PASS {args.layout} {'generic' if args.generic else 'v1'} fault={args.fault}: "
          f"{hit} tokens loaded bit-exact, {time.perf_counter() - t_start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
