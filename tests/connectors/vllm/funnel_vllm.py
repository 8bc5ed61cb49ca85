"""Drive real vLLM (one process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with lmc's connector
through prompts that hit vLLM's own prefix cache, lmc's, and neither, one of them carrying
cache hints in ``kv_transfer_params``; write what vLLM reported and lmc counted as JSON. Run
by ``test_vllm_funnel.py`` with the vLLM venv's python (the test asserts; this script only
reports).

In one process the scheduler half and the worker's ``CacheEngine`` share this process's
Prometheus registry, so the funnel's stages are read from ``lmc_funnel_tokens_total``."""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

R = random.Random(11)
BASE = [0] + [R.randrange(2, 2000) for _ in range(767)]  # 3 chunks of 256
OTHER = [0] + [R.randrange(2, 2000) for _ in range(599)]
HINTS = {"lmc_session": "agent-1", "lmc_ttl": 60, "lmc_priority": 3}


def _funnel() -> dict[str, float]:
    import prometheus_client
    out: dict[str, float] = {}
    for fam in prometheus_client.REGISTRY.collect():
        if fam.name not in ("lmc_funnel_tokens", "lmc_funnel_miss_tokens"):
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                key = s.labels.get("stage") or f"miss.{s.labels.get('reason')}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    ktc = {"kv_connector": "LMCConnector", "kv_connector_module_path": "lmc.connectors.vllm",
           "kv_role": "kv_both",
           "kv_connector_extra_config": {"lmc.chunk_size": 256, "lmc.local_cpu_size": "8MiB",
                                         "lmc.vllm.lookup_timeout": 5.0}}
    llm = LLM(model=args.model, enforce_eager=True, dtype="float32", enable_prefix_caching=True,
              max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=16,
              kv_cache_memory_bytes=256 << 20, seed=0, kv_transfer_config=ktc)

    def run(prompt: list[int], hints: dict | None = None) -> int:
        extra = {"kv_transfer_params": dict(hints)} if hints else None
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, extra_args=extra)
        (o,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        return int(o.num_cached_tokens or 0)

    cached = []
    cached.append(run(BASE, HINTS))          # computed, saved, pinned for its session
    cached.append(run(BASE + [5, 6, 7]))      # vLLM's own prefix cache
    cached.append(run(OTHER))                 # neither: computed, saved, not pinned
    # other traffic: 12 chunks of 4 KiB/token KV through lmc's 8 MiB (about 8 chunks)
    for seed in range(3):
        r = random.Random(100 + seed)
        cached.append(run([0] + [r.randrange(2, 2000) for _ in range(1023)]))
    llm.reset_prefix_cache()                  # vLLM forgets: what follows is lmc's alone
    out: dict[str, Any] = {"pinned_after": run(BASE + [8, 9]),
                           "unpinned_after": run(OTHER + [3])}
    cached += [out["pinned_after"], out["unpinned_after"]]
    out.update(cached=cached, funnel=_funnel())
    llm.llm_engine.engine_core.shutdown()
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
