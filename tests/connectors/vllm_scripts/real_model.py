"""Drive vLLM on a real model (the HF-format checkpoint ``lmc model get`` converts) with and
without lmc's connector; write what each run answered as JSON.

Run by ``tests/connectors/vllm/test_vllm_real_model.py`` with the vLLM venv's python (the test
asserts; this script only reports). Conversations come from ``--conversations`` (JSON:
``{"doc": [messages], "chat": [user turns], "system": text}``); vLLM renders them with the
checkpoint's own chat template (``LLM.chat``). Greedy, float32, stopping at the end of the
assistant's turn. A chat is played turn by turn, each answer appended before the next user
turn, so later turns extend earlier prompts (the prefix lmc serves).

* ``mp0`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a plain vLLM answers the document question
  and the chat (the reference); then vLLM with the connector: the document cold, then warm,
  then the chat, storing to ``--disk``.
* ``mp1`` (the default multi-process engine): vLLM with the connector over the disk directory
  ``mp0`` wrote: the document and the chat again, their KV read back from disk.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MAX_TOKENS = 24


def engine_kwargs(model: str) -> dict[str, Any]:
    # vLLM's CPU build sizes its KV cache from host memory unless told: 256 MiB is ~5.8k
    # tokens of this model in fp32
    return dict(model=model, enforce_eager=True, dtype="float32", enable_prefix_caching=False,
                max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=4,
                kv_cache_memory_bytes=256 << 20, seed=0, disable_log_stats=False)


def connector_config(disk: str) -> dict[str, Any]:
    return {"kv_connector": "LMCConnector", "kv_connector_module_path": "lmc.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmc.chunk_size": 256, "lmc.local_cpu_size": "128MiB",
                                          "lmc.local_disk": disk, "lmc.local_disk_size": "512MiB",
                                          "lmc.load_policy": "load_all",
                                          "lmc.vllm.lookup_timeout": 5.0}}


def answer(llm: Any, messages: list[dict[str, str]]) -> dict[str, Any]:
    from vllm import SamplingParams

    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                   use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids), "text": out.outputs[0].text,
            "finish": out.outputs[0].finish_reason, "cached": out.num_cached_tokens,
            "prompt_ids": list(out.prompt_token_ids)}


def play(llm: Any, conv: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """The document question, then the chat turn by turn (each answer kept in the chat)."""
    res = {f"{prefix}doc": answer(llm, conv["doc"])}
    messages = [{"role": "system", "content": conv["system"]}]
    for i, turn in enumerate(conv["chat"]):
        messages.append({"role": "user", "content": turn})
        res[f"{prefix}chat{i}"] = got = answer(llm, messages)
        messages.append({"role": "assistant", "content": got["text"]})
    return res


def flush_and_close(llm: Any) -> None:
    """Wait for the worker's writes (it shares this process in mp0), then shut down."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group()._worker.engine.flush(timeout=120)
    llm.llm_engine.engine_core.shutdown()


def run_mp0(args: argparse.Namespace, conv: dict[str, Any], out: dict[str, Any]) -> None:
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    t0 = time.time()
    plain = LLM(**engine_kwargs(args.model))
    out["timings"]["plain_init"] = time.time() - t0
    out["plain"] = play(plain, conv, "")
    out["timings"]["plain"] = time.time() - t0
    del plain
    gc.collect()
    cleanup_dist_env_and_memory()
    t0 = time.time()
    llm = LLM(**engine_kwargs(args.model), kv_transfer_config=connector_config(args.disk))
    res = {"cold_doc": answer(llm, conv["doc"]), "warm_doc": answer(llm, conv["doc"])}
    res |= play(llm, conv, "lmc_")
    out["lmc"] = res
    out["timings"]["lmc"] = time.time() - t0
    flush_and_close(llm)


def run_mp1(args: argparse.Namespace, conv: dict[str, Any], out: dict[str, Any]) -> None:
    from vllm import LLM

    t0 = time.time()
    llm = LLM(**engine_kwargs(args.model), kv_transfer_config=connector_config(args.disk))
    out["lmc"] = play(llm, conv, "disk_")
    out["timings"]["lmc"] = time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("mp0", "mp1"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--conversations", required=True)
    ap.add_argument("--disk", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    conv = json.loads(Path(args.conversations).read_text())
    out: dict[str, Any] = {"timings": {}}
    t0 = time.time()
    {"mp0": run_mp0, "mp1": run_mp1}[args.mode](args, conv, out)
    out["timings"]["total"] = time.time() - t0
    Path(args.out).write_text(json.dumps(out))
    print(f"real model {args.mode}: done in {out['timings']['total']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
