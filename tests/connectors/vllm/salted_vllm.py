"""Drive vLLM through salted requests with and without lmc; write what it saw as JSON. Modes:
``mp0`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one process: a plain vLLM first, for the
reference tokens, then lmc's), ``mp1`` (the default multi-process engine: lookups and their
tags cross the Unix socket; lmc only). Run by ``test_vllm_salted.py`` with the vLLM venv's
python (the test asserts; this script only reports).

vLLM's own prefix cache is off, so ``num_cached_tokens`` counts lmc's hits alone."""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = [0] + [random.Random(7).randrange(2, 2000) for _ in range(599)]  # 2 chunks + 88
MAX_TOKENS = 8
# (name, salt) in order: store under A; probes with B and with none miss (and save under
# their own keys); then each of the three hits its own
RUNS = [("A_store", "tenant-a"), ("B_probe", "tenant-b"), ("none_probe", None),
        ("A_hit", "tenant-a"), ("B_hit", "tenant-b"), ("none_hit", None)]


def engine_kwargs(model: str) -> dict[str, Any]:
    return dict(model=model, enforce_eager=True, dtype="float32", enable_prefix_caching=False,
                max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=16,
                kv_cache_memory_bytes=256 << 20, seed=0)


def generate(llm: Any, salt: str | None) -> dict[str, Any]:
    from vllm import SamplingParams
    prompt: dict[str, Any] = {"prompt_token_ids": PROMPT}
    if salt is not None:
        prompt["cache_salt"] = salt
    (o,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                 ignore_eos=True), use_tqdm=False)
    return {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("mp0", "mp1"), default="mp0")
    args = ap.parse_args()
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    out: dict[str, Any] = {}
    if args.mode == "mp0":
        plain = LLM(**engine_kwargs(args.model))
        out["baseline"] = {salt or "": generate(plain, salt)
                           for salt in ("tenant-a", "tenant-b", None)}
        del plain
        gc.collect()
        cleanup_dist_env_and_memory()
    ktc = {"kv_connector": "LMCConnector", "kv_connector_module_path": "lmc.connectors.vllm",
           "kv_role": "kv_both",
           "kv_connector_extra_config": {"lmc.chunk_size": 256, "lmc.local_cpu_size": "64MiB",
                                         "lmc.vllm.lookup_timeout": 5.0}}
    llm = LLM(**engine_kwargs(args.model), kv_transfer_config=ktc)
    out["runs"] = {name: {**generate(llm, salt), "salt": salt} for name, salt in RUNS}
    llm.llm_engine.engine_core.shutdown()
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
