"""A real vLLM (CPU, one process) with lmc's connector in a prefill/decode role, driven by
JSON lines on stdin (one ``@lmc`` JSON answer line each). Run with the vLLM venv's python:
``vllm_pd_proc.py ROLE MODEL DIRECTORY_URL REMOTE_PREFILL_WAIT``, ROLE ``kv_producer`` or
``kv_consumer``; its tiers are L1 and the P2P tier (the daemon at DIRECTORY_URL).

Commands: ``generate`` ``{prompts: {name: ids}, max_tokens, params: {name: kv_transfer_params}}``
answers per name the greedy tokens, ``num_cached_tokens`` and the output's
``kv_transfer_params``; ``stats`` the connector's worker counters; ``exit`` shuts vLLM and
the NIXL agent down and ends with ``os._exit`` (NIXL's exit-time crash).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in this process


def _answer(obj: Any) -> None:
    print("@lmc " + json.dumps(obj), flush=True)


def build(role: str, model: str, url: str, wait: float):
    from vllm import LLM
    ktc = {"kv_connector": "LMCConnector", "kv_connector_module_path": "lmc.connectors.vllm",
           "kv_role": role,
           "kv_connector_extra_config": {
               "lmc.chunk_size": 256, "lmc.local_cpu_size": "96MiB",
               "lmc.pin_memory": False, "lmc.remote_url": url, "lmc.remote_timeout": 5.0,
               "lmc.vllm.lookup_timeout": 10.0, "lmc.vllm.remote_prefill_wait": wait}}
    return LLM(model=model, enforce_eager=True, dtype="float32", enable_prefix_caching=False,
               max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=8,
               kv_cache_memory_bytes=128 << 20, seed=0, kv_transfer_config=ktc)


def generate(llm, prompts: dict[str, list[int]], max_tokens: int,
             params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from vllm import SamplingParams
    names = list(prompts)
    sps = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": params[n]} if n in params else None)
           for n in names]
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": prompts[n]} for n in names], sps, use_tqdm=False)
    seconds = time.monotonic() - t0
    return {n: {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                "kv_transfer_params": o.kv_transfer_params, "seconds": seconds}
            for n, o in zip(names, outs)}


def connector_stats() -> dict[str, Any]:
    """lmc's worker counters and its P2P tier's."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    w = get_kv_transfer_group()._worker
    return {**w.worker.stats.as_dict(), "p2p": w.engine.storage.tiers[-1].stats()}


def main() -> None:
    role, model, url, wait = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    llm = build(role, model, url, wait)
    _answer({"ready": role, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            out = generate(llm, **cmd) if op == "generate" else connector_stats()
        except Exception as e:  # answered, so the test sees it
            out = {"error": f"{type(e).__name__}: {e}"}
        _answer(out)
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    get_kv_transfer_group().shutdown()  # the engine and its NIXL agent, before os._exit
    _answer({"closed": True})
    os._exit(0)


if __name__ == "__main__":
    main()
