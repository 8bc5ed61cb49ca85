"""LMCCacheLinker's ``lookup`` under lmc's load policy, through SGLang 0.5.23's own
external-linker wiring on CPU (run in the SGLang venv by ``test_linker_policy.py``).

A first engine offloads a prompt's 8 pages to lmc's disk tier (``sglang_linker_flow.save``);
each scenario restarts an engine over that directory and prefills the prompt with the
scheduler's calls (``sglang_linker_flow.prefill``). The disk's speed is a deterministic
stand-in, its ``load_policy_priors`` entry (no read happens before the decision), and so is
the engine's prefill rate:

    slow     auto, disk 64 KiB/s, prefill 100k tok/s:   nothing looked up, loaded or read
    fast     auto, disk 1 GiB/s, prefill 10 tok/s:      every page, each layer in the pool
                                                         bit-exact when wait_until returns
    noprior  auto, disk 64 KiB/s, no prefill prior:     every page, one INFO line
    loadall  load_all, disk 64 KiB/s, prefill 100k:     every page
"""

from __future__ import annotations

import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "sglang_scripts"))
import sglang_linker_flow as flow  # noqa: E402  (applies SGLang's CPU shim)

from lmc.connectors.sglang.pages import sglang_page_hashes  # noqa: E402
from lmc.connectors.sglang.policy import NO_PRIOR  # noqa: E402

PAGES, PAGE, LAYERS = flow.PAGES, flow.PAGE, flow.LAYERS


Records = flow.sglang_env.LogLines


def scenario(name: str, expected, extra: dict, loads: bool, records: Records) -> None:
    records.messages.clear()
    tiers = ["memory", {"backend": "disk", "path": os.path.join(flow.TMP, "disk")}]
    cache, alloc, rtp, worker = flow.engine(**{"lmc.local_disk": None, "lmc.tiers": tiers,
                                               **extra})
    linker = cache.linker.cache_linker
    r = flow.prefill(cache, alloc, rtp, worker, expected, 0.0)
    st = linker.stats()
    policy = {k: v for k, v in st.items() if k.startswith("policy.")}
    in_l1 = sum(linker.engine.storage.l1_contains(
        linker.pages.keys(sglang_page_hashes(flow.SEQ, PAGE))))  # a read promotes into L1
    print(f"{name}: host_hit_length {r.match.host_hit_length}, loaded {r.loaded}, "
          f"pages read into L1 {in_l1}, {policy}", flush=True)
    want = len(flow.SEQ) if loads else 0
    assert r.match.host_hit_length == want and r.loaded == want, (r.match, r.loaded)
    assert not r.failed
    assert linker.counts.get("loaded_pages", 0) == (PAGES if loads else 0), linker.counts
    if loads:  # every layer in the pool, bit-exact, when the attention's wait returned
        assert r.landed_at_wait == [True] * LAYERS, r.landed_at_wait
    assert in_l1 == (PAGES if loads else 0), in_l1  # a page not reported is never read
    assert st["policy.recomputed_by_choice"] == (0 if loads else len(flow.SEQ)), policy
    assert st.get("policy.loaded_from_disk", 0) == want, policy
    unknown = [m for m in records.messages if m == NO_PRIOR]
    assert len(unknown) == (name == "noprior"), records.messages
    cache.linker.close()
    print(f"PASS {name}: {want // PAGE} of {PAGES} pages loaded", flush=True)


def main() -> None:
    records = Records()
    logging.getLogger("lmc.connectors.sglang").addHandler(records)
    logging.getLogger("lmc.connectors.sglang").setLevel(logging.INFO)
    expected = flow.random_kv(len(flow.SEQ), seed=7)
    flow.save(expected)
    slow, fast = {"disk": "64KiB"}, {"disk": "1GiB"}
    scenario("slow", expected, {"lmc.load_policy_priors": {**slow, "prefill": 100_000}},
             False, records)
    scenario("fast", expected, {"lmc.load_policy_priors": {**fast, "prefill": 10}}, True,
             records)
    scenario("noprior", expected, {"lmc.load_policy_priors": slow}, True, records)
    scenario("loadall", expected, {"lmc.load_policy": "load_all",
                                   "lmc.load_policy_priors": {**slow, "prefill": 100_000}},
             True, records)
    print("RESULT: PASS", flush=True)


if __name__ == "__main__":
    main()
