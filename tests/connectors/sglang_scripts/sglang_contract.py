"""Contract checks of lmc's SGLang plug-ins against SGLang 0.5.23's real classes, no patches.

Run with the SGLang venv's python; prints ``PASS <check>`` per check and exits non-zero on
the first failure. Uses SGLang's own factories (``StorageBackendFactory``,
``create_unified_cache_linker``), real device pools on ``device='cpu'``, real host pools in
every layout lmc supports, and SGLang's own page hashes (``get_hash_str``).
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_env  # noqa: E402

sglang_env.stub_missing_torchvision()  # a missing optional dependency, not a patch of SGLang
import torch  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.linker_factory import (  # noqa: E402
    create_unified_cache_linker,
)
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (  # noqa: E402
    UnifiedCacheLinker,
)
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from lmc.connectors.sglang import LMCCacheLinker, LMCHiCacheStorage  # noqa: E402
from lmc.connectors.sglang.pages import UnsupportedPool  # noqa: E402

L, H, D, PS, SIZE = 3, 2, 8, 4, 64
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
TMP = tempfile.mkdtemp(prefix="lmc-sglang-contract-")
DTYPE = torch.bfloat16


def passed(name: str) -> None:
    print(f"PASS {name}", flush=True)


def raises(exc: type[BaseException], fn, *words: str) -> None:
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [w for w in words if w not in msg]
        assert not missing, f"error {msg!r} lacks {missing}"
        return
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def mha_pool(v_head_dim=None, dtype=DTYPE) -> MHATokenToKVPool:
    return MHATokenToKVPool(size=SIZE, page_size=PS, dtype=dtype, head_num=H, head_dim=D,
                            layer_num=L, device="cpu", enable_memory_saver=False,
                            v_head_dim=v_head_dim)


def mla_pool() -> MLATokenToKVPool:
    return MLATokenToKVPool(size=SIZE, page_size=PS, dtype=DTYPE, kv_lora_rank=12,
                            qk_rope_head_dim=4, layer_num=L, device="cpu",
                            enable_memory_saver=False)


def host_pool(dev, layout: str):
    info = dev.get_device_pool_infos()[0].buffer_info
    common = dict(host_to_device_ratio=2.0, host_size=0, page_size=PS, layout=layout,
                  pin_memory=False, device="cpu", device_capacity_tokens=SIZE, start_layer=0,
                  end_layer=L - 1)
    if isinstance(dev, MLATokenToKVPool):
        return MLATokenToKVPoolHost(info, target_layer_num=L, **common)
    return MHATokenToKVPoolHost(info, **common)


def storage_config(model="tiny", tp_rank=0, tp_size=1, pp_rank=0, mla=False, **extra):
    cfg = {"backend_name": "lmc", "module_path": "lmc.connectors.sglang",
           "class_name": "LMCHiCacheStorage", "interface_v1": 1,
           "lmc.local_cpu_size": "64MiB", **extra}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=2,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                                enable_storage_metrics=False, is_page_first_layout=False,
                                model_name=model, extra_config=cfg)


def backend(host, **kw) -> LMCHiCacheStorage:
    """Built exactly as SGLang builds a dynamic backend, then registered like the controller."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(**kw), host)
    assert isinstance(b, LMCHiCacheStorage), type(b)
    b.register_mem_pool_host(host)
    b.register_mem_host_pool_v2(host, PoolName.KV)
    b.on_host_pools_registered()
    return b


def fill_random(host, n_pages: int, seed: int) -> torch.Tensor:
    """Allocate host pages and fill them with random bits through SGLang's own setter."""
    idx = host.alloc(n_pages * PS)
    g = torch.Generator().manual_seed(seed)
    for p in range(n_pages):
        n = host.get_data_page(int(idx[p * PS]), flat=True).numel()
        raw = torch.randint(-32768, 32767, (n,), dtype=torch.int16, generator=g)
        host.set_from_flat_data_page(int(idx[p * PS]), raw.view(DTYPE))
    return idx


def page_bytes(host, idx: torch.Tensor, n_pages: int) -> list[torch.Tensor]:
    return [host.get_data_page(int(idx[p * PS]), flat=True).view(torch.int16).clone()
            for p in range(n_pages)]


def reference_chunk(host, start: int) -> torch.Tensor:
    """lmc's chunk ``[layers, planes, page, row]`` of the page at host index ``start``, written
    from each layout's definition (``init_kv_buffer``'s dims), element by element."""
    buf, mla = host.kv_buffer, isinstance(host, MLATokenToKVPoolHost)
    planes = 1 if mla else 2
    rows = []
    for layer in range(L):
        per_plane = []
        for p in range(planes):
            toks = []
            for t in range(PS):
                i = start + t
                if host.layout == "layer_first":
                    v = buf[layer, i, 0] if mla else buf[p, layer, i]
                elif host.layout == "page_first":
                    v = buf[i, layer, 0] if mla else buf[p, i, layer]
                else:
                    v = buf[i // PS, layer, i % PS, 0] if mla else buf[p, i // PS, layer, i % PS]
                toks.append(v.reshape(-1))
            per_plane.append(torch.stack(toks))
        rows.append(torch.stack(per_plane))
    return torch.stack(rows)


def check_page_hash_twin() -> None:
    """lmc's copy of SGLang's page-hash chain equals SGLang's own (its C++ extension)."""
    from lmc.connectors.sglang.pages import sglang_page_hashes

    g = torch.Generator().manual_seed(3)
    for n, ps in ((32, 4), (37, 8), (64, 16), (3, 4)):
        toks = torch.randint(0, 150_000, (n,), generator=g).tolist()
        assert sglang_page_hashes(toks, ps) == get_hash_str(toks, None, page_size=ps)
        seed = "ab" * 32
        assert sglang_page_hashes(toks, ps, seed) == get_hash_str(toks, seed, page_size=ps)
    wide = [1, 2, 2**33, 4, 5, 6, 7, 8]
    assert sglang_page_hashes(wide, 4) == get_hash_str(wide, None, page_size=4)
    passed("page-hash twin: lmc's sglang_page_hashes equals SGLang's get_hash_str (seeded, "
           "partial tail, ids above 2**32)")


def check_storage_class() -> None:
    assert issubclass(LMCHiCacheStorage, HiCacheStorage)
    assert not inspect.isabstract(LMCHiCacheStorage), LMCHiCacheStorage.__abstractmethods__
    params = list(inspect.signature(LMCHiCacheStorage.__init__).parameters)[1:3]
    assert params == ["storage_config", "kwargs"], params
    passed("storage class: concrete subclass, constructor (storage_config, kwargs)")


def check_v1_round_trip(kind: str, layout: str, seq_base: int) -> dict:
    """A producer stores through both paths and closes (flushing to its disk tier); a fresh
    backend on a fresh host pool (a restarted engine) loads the pages bit for bit."""
    dev = mha_pool() if kind == "mha" else mla_pool()
    prod_host, cons_host = host_pool(dev, layout), host_pool(dev, layout)
    disk = {"lmc.local_disk": os.path.join(TMP, f"{kind}-{layout}")}
    b = backend(prod_host, mla=kind == "mla", model=f"m-{kind}", **disk)
    keys = get_hash_str(list(range(seq_base, seq_base + 5 * PS)), None, page_size=PS)
    assert len(keys) == 5 and all(len(k) == 64 for k in keys)
    idx = fill_random(prod_host, 5, seed=seq_base)
    want = page_bytes(prod_host, idx, 5)
    assert b.batch_exists(keys) == 0
    r = b.batch_set_v1(keys[:3], idx[: 3 * PS])
    assert r == [True] * 3, r
    assert b.batch_exists(keys) == 3, b.batch_exists(keys)
    assert b.batch_exists([keys[0], "f" * 64, keys[1]]) == 1  # a prefix count, not a total
    assert b.exists(keys[2]) is True and b.exists(keys[4]) is False
    objs = b.pages.fetch(keys[:3])  # the stored chunk against the layout's definition
    try:
        for p, o in enumerate(objs):
            ref = reference_chunk(prod_host, int(idx[p * PS]))
            assert torch.equal(o.tensor.view(torch.int16), ref.view(torch.int16)), p
    finally:
        for o in objs:
            o.release()
    # generic path: flat pages in the layout's byte order
    assert b.batch_set(keys[3:], [prod_host.get_data_page(int(idx[p * PS]), flat=True)
                                  for p in (3, 4)]) is True
    assert b.set(keys[0], prod_host.get_data_page(int(idx[0]), flat=True)) is True
    b.close()  # what SGLang's detach/shutdown calls: pending disk writes land first
    cb = backend(cons_host, mla=kind == "mla", model=f"m-{kind}", **disk)
    assert cb.batch_exists(keys + ["e" * 64]) == 5
    out_idx = cons_host.alloc(6 * PS)
    got = cb.batch_get_v1(keys[:3] + ["e" * 64, keys[4]], out_idx[: 5 * PS])
    assert got == [True, True, True, False, False], got
    have = page_bytes(cons_host, out_idx, 3)
    assert all(torch.equal(a, w) for a, w in zip(have, want[:3])), "v1 pages differ"
    targets = [cons_host.get_data_page(0, flat=True).clone().zero_() for _ in range(6)]
    pages = cb.batch_get(keys + ["0" * 64], targets)
    assert all(isinstance(t, torch.Tensor) for t in pages[:5]) and pages[5] is None, pages
    for p in range(5):
        assert torch.equal(pages[p].view(torch.int16), want[p]), f"generic page {p}"
    one = cb.get(keys[1], targets[0])
    assert one is not None and torch.equal(one.view(torch.int16), want[1])
    assert cb.get("1" * 64) is None
    passed(f"{kind} {layout}: batch_set_v1/batch_exists/batch_get_v1 and generic get/set "
           "bit-exact with SGLang page hashes across a restart (close flushes to disk); "
           "stored chunks match the layout definition")
    return {"backend": cb, "keys": keys, "dev": dev, "host": cons_host, "idx": out_idx}


def check_cross_layout(runs: dict) -> None:
    """A page stored from one host layout loads into another (lmc's chunk is layout-free)."""
    from lmc.connectors.sglang.pages import PageStore, host_pool_spec_and_views

    for kind in ("mha", "mla"):
        src = runs[(kind, "layer_first")]
        b = src["backend"]
        for layout in ("page_first", "page_first_direct"):
            host = host_pool(src["dev"], layout)
            _, views = host_pool_spec_and_views(host)
            pages = PageStore(b.engine, b.pages.namespace, PS, views)
            idx = host.alloc(3 * PS)
            assert pages.load(src["keys"][:3], idx) == [True] * 3
            for p in range(3):
                a = reference_chunk(host, int(idx[p * PS]))
                w = reference_chunk(src["host"], int(src["idx"][p * PS]))
                assert torch.equal(a.view(torch.int16), w.view(torch.int16)), (kind, layout, p)
    passed("cross-layout: pages stored from layer_first load bit-exact into page_first and "
           "page_first_direct host pools (MHA and MLA)")


def check_namespaces() -> None:
    dev = mha_pool()
    host = host_pool(dev, "layer_first")
    a = backend(host, model="A", tp_rank=0, tp_size=2, pp_rank=0)
    keys = get_hash_str(list(range(900, 900 + 2 * PS)), None, page_size=PS)
    idx = fill_random(host, 2, seed=7)
    assert a.batch_set_v1(keys, idx) == [True, True]
    same = a.pages.keys(keys)
    for kw in ({"model": "B", "tp_rank": 0, "tp_size": 2}, {"model": "A", "tp_rank": 1, "tp_size": 2},
               {"model": "A", "tp_rank": 0, "tp_size": 2, "pp_rank": 1}):
        other = backend(host_pool(dev, "layer_first"), **kw)
        assert not set(other.pages.keys(keys)) & set(same), kw
        other.close()
    # another page size is another namespace too
    from lmc.connectors.sglang.pages import page_namespace
    ns4 = page_namespace("A", a.pages.spec, page_size=4, tp_rank=0, tp_size=2)
    ns8 = page_namespace("A", a.pages.spec, page_size=8, tp_rank=0, tp_size=2)
    assert ns4 != ns8
    # MLA: rank-replicated KV has one writer; every rank reads its copy
    mdev = mla_pool()
    r0 = backend(host_pool(mdev, "page_first"), model="M", tp_rank=0, tp_size=2, mla=True)
    r1 = backend(host_pool(mdev, "page_first"), model="M", tp_rank=1, tp_size=2, mla=True)
    assert r0.is_writer and not r1.is_writer
    assert r0.pages.namespace == r1.pages.namespace
    h1 = r1.mem_pool_host
    i1 = fill_random(h1, 2, seed=9)
    assert r1.batch_set_v1(keys, i1) == [True, True]  # acknowledged, not written
    assert r1.pages.prefix_hits(keys) == 0 and r1.stats_counts["pages_skipped_not_writer"] == 2
    a.close()
    r0.close()
    r1.close()
    passed("namespaces: model, TP rank, PP rank and page size separate keys; MLA replicas "
           "share one namespace and only the storage writer writes")


def check_identity() -> None:
    """Issue 33: SGLang names the model (its served name or path); lmc keys by the weights
    that name means. A copy of the checkpoint elsewhere (same folder name) shares every page;
    the same path after 256 KiB at 30% of model.safetensors changed shares none (the name
    alone kept serving the old weights' pages)."""
    import shutil
    from pathlib import Path

    from lmc.reference import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="lmc-identity-"))
    os.environ["XDG_CACHE_HOME"] = str(work / "xdg")
    try:
        orig = make_tiny_checkpoint(work / "a" / "m")
        copy = Path(shutil.copytree(orig, work / "b" / "m"))
        dev = mha_pool()
        keys = get_hash_str(list(range(700, 700 + 2 * PS)), None, page_size=PS)

        def pages(model: Path) -> set:
            b = backend(host_pool(dev, "layer_first"), model=str(model))
            try:
                return set(b.pages.keys(keys))
            finally:
                b.close()

        before = pages(orig)
        assert pages(copy) == before, "a copy of the same weights elsewhere shares no page"
        weights = orig / "model.safetensors"
        with open(weights, "r+b") as f:
            f.seek(int(weights.stat().st_size * 0.3))
            f.write(os.urandom(256 << 10))
        assert pages(orig).isdisjoint(before), "changed weights under one name share pages"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    passed("identity: pages are keyed by the bytes of the weights SGLang names, not the name")


def check_refusals() -> None:
    dev = mha_pool()
    b = backend(host_pool(dev, "layer_first"))
    kinds = {PoolName.MAMBA: "hybrid state-space", PoolName.SWA: "hybrid sliding-window",
             PoolName.INDEXER: "sparse-attention"}
    for side, kind in kinds.items():  # the refusal names the model kind
        raises(UnsupportedPool, lambda side=side: b.register_mem_host_pool_v2(
            b.mem_pool_host, side), side.value, kind)
    raises(UnsupportedPool, lambda: b.batch_exists_v2(
        ["a" * 64], [PoolTransfer(name=PoolName.SWA, keys=["a" * 64])]), "swa",
        "hybrid sliding-window/full-attention model")
    res = b.batch_exists_v2(["a" * 64], [PoolTransfer(name=PoolName.KV, keys=["a" * 64])])
    assert res.kv_hit_pages == 0
    b.close()
    raises(UnsupportedPool, lambda: backend(host_pool(dev, "page_head")), "page_head")
    raises(UnsupportedPool, lambda: backend(host_pool(mha_pool(v_head_dim=4), "layer_first")),
           "v_head_dim")
    from lmc.connectors.sglang.pages import device_pool_spec_and_caches
    raises(UnsupportedPool, lambda: device_pool_spec_and_caches(mha_pool(v_head_dim=4)),
           "v_head_dim")
    fp8 = mha_pool(dtype=torch.float8_e4m3fn)
    raises(UnsupportedPool, lambda: device_pool_spec_and_caches(fp8), "uint8")
    raises(UnsupportedPool, lambda: backend(host_pool(fp8, "layer_first")), "uint8")
    raises(ValueError, lambda: backend(host_pool(dev, "layer_first"), **{"lmc.chunk_sise": 8}),
           "chunk_sise")
    passed("refusals: side pools (mamba, swa, indexer), page_head layout, v_head_dim != "
           "head_dim, fp8 stored as uint8, unknown lmc config keys: each named in the error")


def check_never_none() -> None:
    b = backend(host_pool(mha_pool(), "page_first"))
    b.close()  # a closed backend answers misses, never None or an exception
    idx = torch.arange(2 * PS)
    assert b.batch_exists(["a" * 64]) == 0
    assert b.batch_get_v1(["a" * 64, "b" * 64], idx) == [False, False]
    assert b.batch_set_v1(["a" * 64, "b" * 64], idx) == [False, False]
    assert b.batch_set(["a" * 64], [b.mem_pool_host.get_data_page(0)]) is False
    assert b.batch_get(["a" * 64], [b.mem_pool_host.get_dummy_flat_data_page()]) == [None]
    passed("errors on the data path are misses/False, never None or a raise")


def linker_params(dev) -> tuple[ServerArgs, CacheInitParams]:
    alloc = TokenToKVPoolAllocator(size=SIZE, dtype=dev.dtype, device="cpu", kvcache=dev,
                                   need_sort=False)
    rtp = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=rtp,
                             token_to_kv_pool_allocator=alloc, page_size=PS)
    return ServerArgs(model_path="dummy", page_size=PS), params


def make_linker(dev):
    """Built by SGLang's own factory, the way the scheduler's startup builds it."""
    sa, params = linker_params(dev)
    return create_unified_cache_linker(
        sa, params, backend="dynamic", components={ComponentType.FULL},
        config={"linker": "LMCCacheLinker", "linker_module_path": "lmc.connectors.sglang",
                "linker_extra_config": {"lmc.local_cpu_size": "32MiB", "lmc.model_id": "tiny"}})


def check_linker_refusals() -> None:
    """The linker refuses, at construction and by name, the device pools it cannot move bit
    for bit (fp8 stored as uint8, K and V of different widths)."""
    raises(UnsupportedPool, lambda: make_linker(mha_pool(dtype=torch.float8_e4m3fn)), "uint8",
           "fp8")
    raises(UnsupportedPool, lambda: make_linker(mha_pool(v_head_dim=4)), "v_head_dim=4",
           "head_dim=8")
    passed("linker refusals: fp8 (uint8) and v_head_dim != head_dim device pools, through "
           "SGLang's factory")


def check_linker_contract() -> None:
    assert issubclass(LMCCacheLinker, UnifiedCacheLinker)
    assert not inspect.isabstract(LMCCacheLinker), LMCCacheLinker.__abstractmethods__
    for dev in (mha_pool(), mla_pool()):
        sa, params = linker_params(dev)
        linker = make_linker(dev)
        assert isinstance(linker, LMCCacheLinker)
        assert hasattr(linker.layer_done_counter, "set_consumer")
        assert hasattr(linker.layer_done_counter, "wait_until")
        assert set(linker.pools) == {PoolName.KV}
        keys = get_hash_str(list(range(50, 50 + 2 * PS)), None, page_size=PS)
        assert linker.lookup("r", [PoolTransfer(name=PoolName.KV, keys=keys)]) == []
        assert linker.load("r", [PoolTransfer(name=PoolName.KV, keys=keys,
                                              device_indices=torch.arange(2 * PS))]) is False
        assert linker.start_layer_wise_loading() == -1
        assert linker.finish_layer_wise_loading(-1) is True
        assert linker.cancel_queued_load("r") is False
        assert linker.num_completed_offloads() == 0
        linker.reset()
        linker.close()
        raises(Exception, lambda sa=sa, params=params: create_unified_cache_linker(
            sa, params, backend="dynamic", components={ComponentType.FULL, ComponentType.MAMBA},
            config={"linker": "LMCCacheLinker", "linker_module_path": "lmc.connectors.sglang",
                    "linker_extra_config": {"lmc.model_id": "tiny"}}), "MAMBA",
            "hybrid state-space")
    passed("linker: concrete UnifiedCacheLinker built by SGLang's factory for MHA and MLA "
           "device pools; empty lookups/loads answer with the documented types; side "
           "components refused")


def main() -> None:
    check_page_hash_twin()
    check_storage_class()
    runs = {}
    base = 100
    for kind in ("mha", "mla"):
        for layout in LAYOUTS:
            runs[(kind, layout)] = check_v1_round_trip(kind, layout, base)
            base += 100
    check_cross_layout(runs)
    check_namespaces()
    check_identity()
    check_refusals()
    check_never_none()
    check_linker_contract()
    check_linker_refusals()
    for run in runs.values():
        run["backend"].close()
    print("RESULT: PASS", flush=True)


if __name__ == "__main__":
    main()
