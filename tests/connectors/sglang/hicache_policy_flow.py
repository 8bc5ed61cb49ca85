"""LMCHiCacheStorage's hit count under lmc's load policy, through SGLang 0.5.23's own HiCache
controller on CPU (run in the SGLang venv by ``test_hicache_policy.py``).

A producer engine stores three prompts' pages through SGLang's backup path into lmc's disk
tier: ``A`` (6 pages), ``B`` (A's first 2 pages + 1 of its own) and ``C`` (3 pages of its
own). Each scenario then starts a consumer (a restarted engine: fresh tree, pools, backend,
empty L1) over the same directory and:

1. requests ``B`` from SGLang (prefetch -> ``batch_exists`` -> ``batch_get_v1`` -> load-back):
   the disk has not been read yet, so its speed is the prior (1 GiB/s) and every page is
   loaded, bit-exact on every layer; the storage manager times that read (a slow disk is
   now known to be slow) and the pages are promoted into lmc's L1;
2. asks the backend directly for ``A``'s pages (``batch_exists`` and ``batch_exists_v2``):
   pages 0-1 are in L1, 2-5 on disk;
3. requests ``C`` (all on disk) from SGLang and checks what was loaded, bit-exact.

The slow disk is a real disk tier behind lmc's ``rate_limit`` wrapper (64 KiB/s: a read
takes at least its bytes / 64 KiB, so the measured speed can only be that slow or slower);
the fast one is the plain disk. The engine's prefill rate is the ``load_policy_priors``
prior (SGLang's storage backend sees no forward).

    slow     auto, prefill 100k tok/s, disk 64 KiB/s:  B 3 pages, A 2 (L1 only), C 0
    fast     auto, prefill 10 tok/s, plain disk:        B 3, A 6, C 3
    noprior  auto, no prefill prior, disk 64 KiB/s:     B 3, A 6, C 3, one INFO line
    loadall  load_all, prefill 100k tok/s, 64 KiB/s:    B 3, A 6, C 3

Also: a prefill prior of 0, a negative one, NaN, infinity or a boolean is refused when the
backend is constructed, with an error naming ``load_policy_priors.prefill``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "sglang_scripts"))
import sglang_env  # noqa: E402

sglang_env.apply_cpu_shim()
import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    CacheRequestHandle,
    InitLoadBackParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import (  # noqa: E402
    build_fixture,
    match_prefix,
    write_backup,
)
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402
from sglang_hicache_flow import init_hicache, lmc_backend, path  # noqa: E402

from lmc.config import ConfigError  # noqa: E402
from lmc.connectors.sglang import LMCHiCacheStorage  # noqa: E402
from lmc.connectors.sglang.pages import sglang_page_hashes  # noqa: E402
from lmc.connectors.sglang.policy import NO_PRIOR  # noqa: E402

PAGE, LAYERS, HEADS, DIM = 4, 4, 2, 8
DEADLINE = 30.0
SLOW = "64KiB"
V1 = argparse.Namespace(layout="layer_first", generic=False)
A = list(range(7000, 7000 + 6 * PAGE))
B = A[: 2 * PAGE] + list(range(8000, 8000 + PAGE))
C = list(range(9000, 9000 + 3 * PAGE))


Records = sglang_env.LogLines


def cfg() -> CacheConfig:
    return CacheConfig(page_size=PAGE, components=(ComponentType.FULL,), num_layers=LAYERS,
                       head_num=HEADS, head_dim=DIM, kv_size=256)


def produce(disk: str) -> dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Store A, B and C through SGLang's backup path; the K/V each prompt's tokens hold."""
    kit = UnifiedRadixCacheFixtures()
    kit.cfg = cfg()
    prod, alloc, rtp = build_fixture(kit.cfg)
    cc = init_hicache(prod, V1, {"lmc.local_disk": disk})
    kv = alloc.get_kvcache()
    for seq in (A, B, C):
        kit._insert(prod, alloc, rtp, seq)
    g = torch.Generator().manual_seed(23)
    for layer in range(LAYERS):  # arbitrary bits, NaNs included, in every slot
        for buf in (kv.k_buffer[layer], kv.v_buffer[layer]):
            buf.view(torch.int16).copy_(torch.randint(-32768, 32767, buf.shape, generator=g,
                                                      dtype=torch.int16))
    expected, nodes = {}, []
    for seq in (A, B, C):
        m = match_prefix(prod, seq)
        assert m.device_prefix_len == len(seq), m
        slots = prod.path_device_indices(m.last_device_node)
        expected[tuple(seq)] = [(kv.k_buffer[la][slots].clone(), kv.v_buffer[la][slots].clone())
                                for la in range(LAYERS)]
        nodes += [n for n in path(prod, m.last_device_node) if n not in nodes]
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
    assert not prod.ongoing_backup, "backup hung"
    stored = lmc_backend(cc).stats_counts.get("pages_stored", 0)
    cc.detach_storage_backend()  # close(): every page reaches the disk
    assert stored >= 10, stored  # A's 6, B's own 1, C's 3
    print(f"producer: {stored} pages stored on disk", flush=True)
    return expected


def request(kit, cons, ccc, seq, expected) -> int:
    """One request through SGLang: prefetch from lmc, match, load back layer by layer;
    the tokens loaded (bit-exact checked on every layer)."""
    handle = CacheRequestHandle(f"req-{seq[-1]}", 0)
    cons.prefetch_from_storage(handle, cons.root_node_handle(), array("q", seq), None, None)
    deadline = time.time() + DEADLINE
    while not cons.check_prefetch_progress(handle):
        cons.check_hicache_events()
        assert time.time() < deadline, "prefetch hung"
        time.sleep(0.01)
    req = kit._make_req(kit.rtp)
    mr = cons.match_prefix(MatchPrefixParams(key=RadixKey(array("q", seq)), req=req))
    kit._apply_match_to_req(req, mr)
    assert mr.device_prefix_len == 0, mr
    hit = mr.host_hit_length
    if hit:
        cons.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node,
                                               host_hit_length=hit, req=req))
        counter = ccc.layer_done_counter
        counter.set_consumer(cons.ready_to_load_host_cache())
        ckv = kit.alloc.get_kvcache()
        ckv.register_layer_transfer_counter(counter)
        for layer in range(LAYERS):
            ckv.get_key_buffer(layer)  # the attention's read: waits for this layer
        for ack in list(ccc.ack_load_queue):
            ack.finish_event.synchronize()
        cons.loading_check()
        m2 = match_prefix(cons, seq)
        assert m2.device_prefix_len == hit, m2
        idx = cons.path_device_indices(m2.last_device_node)
        exp = expected[tuple(seq)]
        bits = torch.int16
        for la in range(LAYERS):
            assert torch.equal(ckv.k_buffer[la][idx].view(bits), exp[la][0][:hit].view(bits))
            assert torch.equal(ckv.v_buffer[la][idx].view(bits), exp[la][1][:hit].view(bits))
    assert not cons.ongoing_prefetch and not cons.ongoing_load_back, "left in flight"
    assert cons.protected_size() == 0, f"{cons.protected_size()} tokens left locked"
    return hit


def scenario(name: str, disk: str, expected, lmc_extra: dict, want: tuple[int, int, int],
             records: Records) -> None:
    print(f"=== {name}", flush=True)
    records.messages.clear()
    kit = UnifiedRadixCacheFixtures()
    kit.cfg = cfg()
    cons, kit.alloc, kit.rtp = build_fixture(kit.cfg)
    ccc = init_hicache(cons, V1, lmc_extra)
    b = lmc_backend(ccc)
    l1, disk_tier = b.engine.tier_names
    hit_b = request(kit, cons, ccc, B, expected)
    speeds = b.engine.speeds.snapshot()
    print(f"B: {hit_b // PAGE} pages loaded bit-exact; measured {disk_tier} "
          f"{speeds.tiers[1].bytes_per_s / 1024:.1f} KiB/s from {speeds.tiers[1].observed} "
          f"read(s), {l1} copy observed {speeds.tiers[0].observed}x", flush=True)
    assert speeds.tiers[1].observed >= 1 and speeds.tiers[0].observed >= 1, speeds
    if SLOW in str(lmc_extra.get("lmc.tiers")):  # a read can only be this slow or slower
        assert speeds.tiers[1].bytes_per_s <= 64 * 1024 * 1.001, speeds.tiers[1]
    hashes = sglang_page_hashes(A, PAGE)
    found = b.pages.lookup(hashes)
    assert found.tokens == len(A) and list(found.sources) == [0, 0, 1, 1, 1, 1], found
    got_a = b.batch_exists(hashes)
    got_a2 = b.batch_exists_v2(hashes)
    assert got_a2.kv_hit_pages == got_a, (got_a2, got_a)
    assert got_a2.restorable_prefix_pages == list(range(1, got_a + 1)), got_a2
    loaded_before = b.stats_counts.get("pages_loaded", 0)
    hit_c = request(kit, cons, ccc, C, expected)
    loaded_c = b.stats_counts.get("pages_loaded", 0) - loaded_before
    print(f"A: batch_exists {got_a} of 6 held pages (sources {list(found.sources)}); "
          f"C: {hit_c // PAGE} pages loaded bit-exact ({loaded_c} read from lmc)", flush=True)
    st = b.stats()
    policy = {k: v for k, v in st.items() if k.startswith("policy.")}
    print(f"{name} stats: {policy}", flush=True)
    assert (hit_b // PAGE, got_a, hit_c // PAGE) == want, (hit_b, got_a, hit_c)
    assert loaded_c == want[2], (loaded_c, want)  # a page not reported is never fetched
    assert st["policy.decisions"] == 4, policy  # B, A (v1), A (v2), C
    # tokens by what the policy did: B (3 disk pages), A twice (2 L1 + 4 disk), C (3 disk)
    recomputed = ((3 - want[0]) + 2 * (6 - got_a) + (3 - want[2])) * PAGE
    assert st["policy.recomputed_by_choice"] == recomputed, policy
    assert st[f"policy.loaded_from_{l1}"] == 2 * 2 * PAGE, policy
    assert st[f"policy.loaded_from_{disk_tier}"] == (want[0] + 2 * (got_a - 2) + want[2]) * PAGE
    unknown = [m for m in records.messages if m == NO_PRIOR]
    if name == "noprior":
        assert len(unknown) == 1, records.messages  # said once, not per query
        assert st["policy.decided_unknown"] == 4, policy
    else:
        assert not unknown, records.messages
        assert st["policy.decided_unknown"] == 0, policy
    assert st["policy.enabled"] == (name != "loadall"), policy
    ccc.detach_storage_backend()
    print(f"PASS {name}: B {hit_b // PAGE}, A {got_a}, C {hit_c // PAGE} pages", flush=True)


def refused_priors(disk: str) -> None:
    """A prefill prior that is no rate is refused at construction, naming the key."""
    sc = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                              attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                              is_page_first_layout=False, model_name="tiny-sglang")
    for bad in (0, -5, float("nan"), "nan", float("inf"), True, 1.5):
        try:
            LMCHiCacheStorage(sc, {"lmc.local_disk": disk,
                                   "lmc.load_policy_priors": {"prefill": bad}})
        except ConfigError as e:
            assert "load_policy_priors.prefill" in str(e), e
            continue
        raise AssertionError(f"prefill prior {bad!r} was accepted")
    print("PASS refused: prefill priors 0, -5, nan, 'nan', inf, True, 1.5 named "
          "load_policy_priors.prefill", flush=True)


def main() -> None:
    records = Records()
    logging.getLogger("lmc.connectors.sglang").addHandler(records)
    logging.getLogger("lmc.connectors.sglang").setLevel(logging.INFO)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="lmc-sglang-policy-")
    disk = os.path.join(tmp, "disk")
    expected = produce(disk)
    slow_disk = ["memory", {"wrap": "rate_limit", "bytes_per_second": SLOW,
                            "tier": {"backend": "disk", "path": disk}}]
    plain_disk = ["memory", {"backend": "disk", "path": disk}]
    fast_compute = {"prefill": 100_000}
    scenario("slow", disk, expected, {"lmc.tiers": slow_disk,
                                      "lmc.load_policy_priors": fast_compute},
             (3, 2, 0), records)
    scenario("fast", disk, expected, {"lmc.tiers": plain_disk,
                                      "lmc.load_policy_priors": {"prefill": 10}},
             (3, 6, 3), records)
    scenario("noprior", disk, expected, {"lmc.tiers": slow_disk}, (3, 6, 3), records)
    scenario("loadall", disk, expected, {"lmc.tiers": slow_disk, "lmc.load_policy": "load_all",
                                         "lmc.load_policy_priors": fast_compute},
             (3, 6, 3), records)
    refused_priors(os.path.join(tmp, "refused"))
    print(f"RESULT: PASS ({time.perf_counter() - t0:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
