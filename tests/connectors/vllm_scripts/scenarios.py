"""Drive one vLLM process through the connector scenarios; write what it saw as JSON.

Run by ``tests/connectors/vllm/test_vllm_integration.py`` with the vLLM venv's python (the test
asserts; this script only reports). Modes:

* ``mp0`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one process): first a plain vLLM without the
  connector computes the reference tokens of every prompt of every mode; then vLLM with the
  connector runs the scenarios on the ``m0`` prompts, storing to ``--disk``.
* ``tp2``: tensor parallelism 2 on the ``m1`` prompts, with its own disk directory.
* ``mp1`` (the default multi-process engine: EngineCore and worker are separate processes,
  lookups cross a Unix socket): reads ``m0`` prompts back from the disk tier written by the
  ``mp0`` process (one of them corrupted on disk by the test in between), then runs the
  scenarios on the ``m1`` prompts.
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

from vllm_prompts import ALL, MAX_TOKENS, MP0, MP1, PREEMPT, PREEMPT_MAX_TOKENS  # noqa: E402


def engine_kwargs(model: str) -> dict[str, Any]:
    return dict(model=model, enforce_eager=True, dtype="float32", enable_prefix_caching=False,
                max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=16,
                kv_cache_memory_bytes=256 << 20, seed=0, disable_log_stats=False)


def connector_config(disk: str) -> dict[str, Any]:
    return {"kv_connector": "LMCConnector", "kv_connector_module_path": "lmc.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmc.chunk_size": 256, "lmc.local_cpu_size": "128MiB",
                                          "lmc.local_disk": disk,
                                          "lmc.vllm.lookup_timeout": 5.0}}


def params(max_tokens: int = MAX_TOKENS, no_hits: bool = False):
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          skip_reading_prefix_cache=no_hits or None)


def generate(llm, names: list[str], prompts: dict[str, list[int]] = ALL,
             max_tokens: int = MAX_TOKENS, suffix: str = "", no_hits: bool = False
             ) -> dict[str, dict[str, Any]]:
    outs = llm.generate([{"prompt_token_ids": prompts[n]} for n in names],
                        params(max_tokens, no_hits), use_tqdm=False)
    return {n + suffix: {"tokens": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                         "cached": o.num_cached_tokens} for n, o in zip(names, outs)}


def preemptions(llm) -> int:
    return sum(int(getattr(m, "value", 0) or 0) for m in llm.llm_engine.get_metrics()
               if m.name == "vllm:num_preemptions")


def run_preemption(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """A KV cache too small for the batch: vLLM preempts and resumes requests; lmc's loads
    of the resumed ones must stay correct. A second round loads every prompt from lmc."""
    from vllm import LLM
    kw = engine_kwargs(args.model) | {"num_gpu_blocks_override": 11, "max_model_len": 1024}
    llm = LLM(**kw, kv_transfer_config=connector_config(args.disk + "-preempt"))
    names = list(PREEMPT)
    res = generate(llm, names, PREEMPT, PREEMPT_MAX_TOKENS)
    res |= generate(llm, names, PREEMPT, PREEMPT_MAX_TOKENS, suffix="_warm")
    out["preempt"] = {"results": res, "preemptions": preemptions(llm)}
    llm.llm_engine.engine_core.shutdown()


def abort_mid_prefill(llm, name: str, multiprocess: bool) -> None:
    """Submit a prompt needing 3 prefill steps, let one step run, abort it."""
    engine = llm.llm_engine
    engine.add_request(f"abort-{name}", {"prompt_token_ids": ALL[name]}, params())
    if multiprocess:  # EngineCore steps on its own: abort after about one step
        time.sleep(0.05)
    else:
        engine.step()  # exactly one scheduler step in-process: 512 of 1500 tokens
    engine.abort_request([f"abort-{name}"])
    while engine.has_unfinished_requests():
        engine.step()


def scenarios(llm, s: dict[str, list[int]], tag: str, multiprocess: bool
              ) -> dict[str, dict[str, Any]]:
    res: dict[str, dict[str, Any]] = {}
    res |= generate(llm, [f"{tag}_A"])             # store
    res |= generate(llm, [f"{tag}_B"])             # shared prefix: load 512
    res |= generate(llm, [f"{tag}_L"])             # chunked prefill, stored chunk by chunk
    res |= generate(llm, [f"{tag}_L2"])            # load 1280, then chunked prefill
    res |= generate(llm, [f"{tag}_C{i}" for i in range(1, 6)])  # concurrent
    abort_mid_prefill(llm, f"{tag}_E", multiprocess)
    res |= generate(llm, [f"{tag}_E"])             # after the abort
    return res


def worker_engine():
    """The worker's CacheEngine, reachable only when the worker shares this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    return get_kv_transfer_group()._worker.engine


def packing_probes() -> dict[str, str]:
    """lmc's start-up check of vLLM's CPU packing, for kernels this machine may not pick."""
    import torch

    from lmc.connectors.vllm.layout import UnsupportedLayout, verify_cpu_packing
    out = {}
    for isa, dtype, head in (("vec", torch.float32, 64), ("vec", torch.bfloat16, 128),
                             ("vec16", torch.float32, 80), ("vec16", torch.bfloat16, 112),
                             ("amx", torch.bfloat16, 64)):
        try:
            verify_cpu_packing(isa, dtype, 128, 2, head)
            out[f"{isa}/{dtype}/{head}"] = "ok"
        except UnsupportedLayout as e:
            out[f"{isa}/{dtype}/{head}"] = f"refused: {e}"
    return out


def run_mp0(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    out["probes"] = packing_probes()
    t0 = time.time()
    plain = LLM(**engine_kwargs(args.model))
    out["baseline"] = generate(plain, list(ALL))
    out["baseline"] |= generate(plain, list(PREEMPT), PREEMPT, PREEMPT_MAX_TOKENS)
    del plain
    gc.collect()
    cleanup_dist_env_and_memory()
    out["timings"]["baseline"] = time.time() - t0
    t0 = time.time()
    llm = LLM(**engine_kwargs(args.model), kv_transfer_config=connector_config(args.disk))
    out["timings"]["init"] = time.time() - t0
    res = scenarios(llm, MP0, "m0", multiprocess=False)
    res |= generate(llm, ["m0_F"])
    engine = worker_engine()
    from lmc.token_database import key_hex
    out["F_keys"] = [key_hex(k) for k in engine.db.keys(ALL["m0_F"])]
    out["flushed"] = engine.flush(timeout=60)
    out["results"] = res
    llm.llm_engine.engine_core.shutdown()  # the connector closes its cache
    del llm, engine
    gc.collect()
    cleanup_dist_env_and_memory()
    run_preemption(args, out)


def run_mp1(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from vllm import LLM
    t0 = time.time()
    llm = LLM(**engine_kwargs(args.model), kv_transfer_config=connector_config(args.disk))
    out["timings"]["init"] = time.time() - t0
    res: dict[str, dict[str, Any]] = {}
    res |= generate(llm, ["m0_A"])      # from the disk tier a previous process wrote
    res |= generate(llm, ["m0_F"])      # its disk values are corrupt: recomputed
    first = res.pop("m0_F")
    res |= generate(llm, ["m0_F"])      # saved again by the recompute
    res["m0_F_first"] = first
    res |= scenarios(llm, MP1, "m1", multiprocess=True)
    out["results"] = res


def run_tp2(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Tensor parallelism 2 (two worker processes, a lookup socket and a disk directory
    each; the scheduler takes the minimum of their answers). References: the same engine
    with connector hits disabled per request (``skip_reading_prefix_cache``), since TP=2
    sums in a different order than TP=1."""
    from vllm import LLM
    t0 = time.time()
    llm = LLM(**engine_kwargs(args.model), tensor_parallel_size=2,
              kv_transfer_config=connector_config(args.disk))
    out["timings"]["init"] = time.time() - t0
    res: dict[str, dict[str, Any]] = {}
    for group in (["m1_A"], ["m1_B"], ["m1_L"], ["m1_L2"], [f"m1_C{i}" for i in range(1, 6)]):
        res |= generate(llm, group)
    out["results"] = res
    out["reference"] = generate(llm, list(res), no_hits=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("mp0", "mp1", "tp2"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--disk", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out: dict[str, Any] = {"timings": {}}
    t0 = time.time()
    {"mp0": run_mp0, "mp1": run_mp1, "tp2": run_tp2}[args.mode](args, out)
    out["timings"]["total"] = time.time() - t0
    Path(args.out).write_text(json.dumps(out))
    print(f"scenarios {args.mode}: done in {out['timings']['total']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
