"""Drive vLLM on a hybrid sliding-window/full model with lmc; write what it saw as JSON.

Run by ``tests/connectors/vllm/test_vllm_hybrid.py`` with the vLLM venv's python (the test
asserts; this script only reports). The model is a tiny random-weight Llama whose
``layer_types`` alternate sliding-window (128 tokens) and full attention: vLLM keeps two KV
cache groups with its hybrid memory allocator. Modes:

* ``mp0`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one process): a plain vLLM computes the
  reference tokens of every prompt; then vLLM with lmc stores, hits, shares prefixes,
  prefills in chunks and batches, writing to ``--disk``.
* ``mp1`` (the default multi-process engine, lookups over the Unix socket): a new process
  reads the first one's chunks back from disk -- one prompt's sliding-window part of one
  chunk deleted by the test in between -- then runs fresh prompts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm_prompts import MAX_TOKENS, tokens  # noqa: E402

WINDOW = 128
CHUNK = 256


def prompts() -> dict[str, list[int]]:
    a, long = tokens(3001, 700), tokens(3002, 1500)

    def tail(seed: int, n: int) -> list[int]:
        return tokens(seed, n + 1)[1:]
    return {
        "A": a,                              # stored, then again: a full-prompt hit
        "B": a[:600] + tail(3010, 60),       # shares 600 tokens: hit at 512
        "L": long,                           # chunked prefill (512 a step)
        "L2": long[:1400] + tail(3011, 100),  # shares 1400: hit at 1280, its checkpoint
        "L3": long[:1100] + tail(3012, 60),  # shares 1100: the window before 1024 was not
                                             # kept (checkpoints at 1280 and 1500): a miss
        "C1": a[:650] + tail(3013, 40),      # concurrent, partial overlaps
        "C2": long[:1300] + tail(3014, 30),
        "C3": tokens(3003, 500),
        "D": tokens(3004, 800),              # the second process's own
    }


ALL = prompts()


def engine_kwargs(model: str) -> dict[str, Any]:
    return dict(model=model, enforce_eager=True, dtype="float32", enable_prefix_caching=False,
                max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=16,
                kv_cache_memory_bytes=256 << 20, seed=0, disable_log_stats=False)


def connector_config(disk: str) -> dict[str, Any]:
    return {"kv_connector": "LMCConnector", "kv_connector_module_path": "lmc.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmc.chunk_size": CHUNK, "lmc.local_cpu_size": "128MiB",
                                          "lmc.local_disk": disk,
                                          "lmc.vllm.lookup_timeout": 5.0}}


def generate(llm, names: list[str], suffix: str = "") -> dict[str, dict[str, Any]]:
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ALL[n]} for n in names], params, use_tqdm=False)
    return {n + suffix: {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}
            for n, o in zip(names, outs)}


def vllm_state(llm) -> dict[str, Any]:
    cfg = llm.llm_engine.vllm_config
    return {"hma_disabled": bool(cfg.scheduler_config.disable_hybrid_kv_cache_manager)}


def refusals() -> dict[str, str]:
    """lmc's start-up answer for KV cache groups of kinds it cannot serve, with vLLM's own
    spec classes: a state-space hybrid's Mamba group, chunked local attention."""
    from types import SimpleNamespace as NS

    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
    )

    from lmc.connectors.vllm.groups import group_kinds
    from lmc.connectors.vllm.layout import UnsupportedLayout

    full = NS(kv_cache_spec=FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64,
                                              dtype=torch.float32),
              layer_names=["model.layers.1.self_attn.attn"])
    others = {
        "mamba": MambaSpec(block_size=128, shapes=((4, 8), (2, 16)),
                           dtypes=(torch.float32, torch.float32)),
        "chunked_local": ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=2,
                                                   head_size=64, dtype=torch.float32,
                                                   attention_chunk_size=256),
    }
    out = {}
    for name, spec in others.items():
        cfg = NS(kv_cache_groups=[full, NS(kv_cache_spec=spec,
                                           layer_names=["model.layers.0.mixer"])])
        try:
            out[name] = f"accepted {group_kinds(cfg)}"
        except UnsupportedLayout as e:
            out[name] = f"refused: {e}"
    return out


def run_mp0(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from vllm import LLM
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from lmc.hybrid.rules import part_key
    from lmc.token_database import key_hex

    out["refusals"] = refusals()
    plain = LLM(**engine_kwargs(args.model))
    out["baseline"] = generate(plain, list(ALL))
    out["plain_state"] = vllm_state(plain)
    groups = plain.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    out["groups"] = [type(g.kv_cache_spec).__name__ for g in groups]
    del plain
    gc.collect()
    cleanup_dist_env_and_memory()
    llm = LLM(**engine_kwargs(args.model), kv_transfer_config=connector_config(args.disk))
    out["state"] = vllm_state(llm)
    res: dict[str, dict[str, Any]] = {}
    res |= generate(llm, ["A"])
    res |= generate(llm, ["A"], "_again")
    res |= generate(llm, ["B"])
    res |= generate(llm, ["L"])
    res |= generate(llm, ["L2"])
    res |= generate(llm, ["L3"])
    res |= generate(llm, ["C1", "C2", "C3"])
    out["results"] = res
    worker = get_kv_transfer_group()._worker
    engine = worker.engine
    spec = engine.spec
    out["lmc_groups"] = [[g.kind, list(g.layers), g.window] for g in spec.groups]
    keys = engine.db.keys(ALL["L"])
    sliding = next(i for i, g in enumerate(spec.groups) if g.kind == "sliding")
    out["L_parts"] = {str(k): [key_hex(part_key(keys[k], gi)) for gi in range(len(spec.groups))]
                      for k in range(len(keys))}
    out["sliding_group"] = sliding
    out["stats"] = {k: v for k, v in worker.stats().items()
                    if k.startswith(("worker.", "cache.l1.", "cache.pool"))}
    out["flushed"] = engine.flush(timeout=60)
    llm.llm_engine.engine_core.shutdown()


def run_mp1(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from vllm import LLM
    llm = LLM(**engine_kwargs(args.model), kv_transfer_config=connector_config(args.disk))
    out["state"] = vllm_state(llm)
    res: dict[str, dict[str, Any]] = {}
    res |= generate(llm, ["A"])          # from the disk tier the first process wrote
    res |= generate(llm, ["L"])          # one sliding part of its last windows deleted
    res |= generate(llm, ["L"], "_again")  # stored again by that recompute
    res |= generate(llm, ["D"])
    res |= generate(llm, ["D"], "_again")
    out["results"] = res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("mp0", "mp1"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--disk", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    t0 = time.time()
    {"mp0": run_mp0, "mp1": run_mp1}[args.mode](args, out)
    out["seconds"] = time.time() - t0
    Path(args.out).write_text(json.dumps(out))
    print(f"hybrid scenarios {args.mode}: done in {out['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
