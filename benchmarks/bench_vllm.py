"""TTFT of a long prompt on real vLLM (CPU): cold prefill vs lmc hits (L1, and disk in a
fresh process), with vLLM's bundled ``ExampleConnector`` on the same workload, same run.

Each configuration runs in its own vLLM process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` by
default, so TTFT is not blurred by inter-process polling; ``--multiprocess`` for the default
engine), one request at a time, ``max_tokens=1``, so TTFT = the ``generate`` call:

* **vLLM cold**: no connector: the prefill lmc removes;
* **lmc cold**: lmc on, empty cache: the prefill plus lmc's layer-wise saves;
* **lmc L1 hit**: the same prompt again in the same process (the last token is computed);
* **lmc disk hit**: a fresh vLLM process on the disk tier the previous one wrote (O_DIRECT
  reads, so the page cache does not help);
* **Example cold / hit**: ``ExampleConnector`` (safetensors file per layer per prompt). Its hit
  reads files written seconds earlier through the page cache; lmc's disk hit reads with
  O_DIRECT in a new process, i.e. from the device.

Every configuration first runs an unmeasured short request (kernel warm-up), then for each of
``--reps`` distinct prompts: cold (stores), an in-process full prefill of the same prompt
(``skip_reading_prefix_cache``: no load, and no save since the chunks are present), then the
hit. On a shared machine absolute times drift with other load, so the speed-up column is the
median of each hit against its adjacent in-process prefill; "vs vLLM cold" divides by the
connector-less process's median. Every run is checked to produce the reference first token. The model is a random-weight Llama made by ``make_tiny_checkpoint``
(hidden 1024, 8 layers, 16 heads, 8 KV heads: 32 KiB of fp32 KV per token, an 8k prompt is
256 MiB of KV), shared with ``bench_ttft.py`` under the user's cache directory.

    python benchmarks/bench_vllm.py                  # 8k tokens, 3 prompts (~4 minutes here)
    python benchmarks/bench_vllm.py --tokens 4096 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_PYTHON = "/work/venv-vllm/bin/python"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(2, 2048) for _ in range(n - 1)]


# --------------------------------------------------------------------------- child
def child(args: argparse.Namespace) -> None:
    """One vLLM process: measure and print one JSON line."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    ktc = None
    if args.config.startswith("lmc"):
        ktc = {"kv_connector": "LMCConnector", "kv_connector_module_path": "lmc.connectors.vllm",
               "kv_role": "kv_both",
               "kv_connector_extra_config": {"lmc.chunk_size": 256,
                                             "lmc.local_cpu_size": "2GiB",
                                             "lmc.local_disk": args.store,
                                             "lmc.local_disk_size": "8GiB"}}
    elif args.config == "example":
        ktc = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": args.store}}
    t0 = time.perf_counter()
    llm = LLM(model=args.model, enforce_eager=True, dtype="float32",
              enable_prefix_caching=False, max_model_len=args.tokens + 64,
              max_num_batched_tokens=args.tokens + 64, max_num_seqs=4,
              kv_cache_memory_bytes=2 << 30, kv_transfer_config=ktc, seed=0)
    init = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sp_nohit = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                              skip_reading_prefix_cache=True)

    def run(prompt: list[int], params: SamplingParams = sp) -> tuple[float, int, int]:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return time.perf_counter() - t, out.num_cached_tokens, out.outputs[0].token_ids[0]

    run(tokens(999, 64))  # warm-up
    prompts = [tokens(args.seed + i, args.tokens) for i in range(args.reps)]
    res: dict[str, Any] = {"config": args.config, "init_s": init}
    # per prompt, adjacent in time: the hit and an in-process full prefill of the same prompt
    # (no load, and nothing saved: its chunks are in L1 already), so load drift on a shared
    # machine cancels in the ratio
    phases = {"plain": ["cold"], "lmc": ["cold", "prefill", "hit"],
              "lmc-disk": ["hit", "prefill"], "example": ["cold", "prefill", "hit"]}
    for p in prompts:
        for phase in phases[args.config]:
            res.setdefault(phase, []).append(run(p, sp_nohit if phase == "prefill" else sp))
    if args.config == "lmc":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        res["flushed"] = get_kv_transfer_group()._worker.engine.flush(timeout=300)
    print("RESULT " + json.dumps(res), flush=True)


# -------------------------------------------------------------------------- parent
def model_dir(hidden: int, layers: int, kv_heads: int, max_len: int) -> Path:
    from lmc.reference.tiny import cached_checkpoint

    return cached_checkpoint(f"bench-llama-h{hidden}-l{layers}-kv{kv_heads}-p{max_len}",
                             hidden=hidden, layers=layers, heads=hidden // 64,
                             kv_heads=kv_heads, max_position_embeddings=max_len)


def run_child(py: str, config: str, args: argparse.Namespace, model: Path, store: Path
              ) -> dict[str, Any]:
    cmd = [py, __file__, "--child", config, "--model", str(model), "--store", str(store),
           "--tokens", str(args.tokens), "--reps", str(args.reps), "--seed", str(args.seed)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    if not args.multiprocess:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    log(f"  {config}: starting vLLM ...")
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not lines:
        raise SystemExit(f"{config} failed (rc {p.returncode}):\n{p.stderr[-4000:]}")
    log(f"  {config}: done in {time.time() - t0:.0f} s")
    return json.loads(lines[-1][len("RESULT "):])


def med(rows: list[list[Any]]) -> float:
    return statistics.median(r[0] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--multiprocess", action="store_true",
                    help="vLLM's default engine (EngineCore and worker processes)")
    ap.add_argument("--vllm-python", default=os.environ.get("LMC_VLLM_PYTHON", DEFAULT_PYTHON))
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.config = args.child
        child(args)
        return 0
    model = model_dir(args.hidden, args.layers, args.kv_heads, args.tokens + 64)
    kv_mib = args.layers * 2 * args.kv_heads * 64 * 4 * args.tokens / 2**20
    log(f"vLLM TTFT, {args.tokens} tokens, {model.name}, {kv_mib:.0f} MiB of KV per prompt")
    work = Path(tempfile.mkdtemp(prefix="lmc-bench-vllm-", dir=os.environ.get("TMPDIR")))
    try:
        r = {c: run_child(args.vllm_python, c, args, model, work / d)
             for c, d in (("plain", "none"), ("lmc", "lmc"), ("lmc-disk", "lmc"),
                          ("example", "example"))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(r, args, kv_mib)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


def report(r: dict[str, Any], args: argparse.Namespace, kv_mib: float) -> None:
    plain = med(r["plain"]["cold"])
    firsts = [row[2] for row in r["plain"]["cold"]]
    rows = [("vLLM cold (no connector)", "plain", "cold"),
            ("lmc cold (prefill + save)", "lmc", "cold"),
            ("lmc L1 hit", "lmc", "hit"),
            ("lmc disk hit (fresh process)", "lmc-disk", "hit"),
            ("ExampleConnector cold (prefill + save)", "example", "cold"),
            ("ExampleConnector hit", "example", "hit")]
    mode = "multi-process engine" if args.multiprocess else "VLLM_ENABLE_V1_MULTIPROCESSING=0"
    print(f"\nvLLM {args.tokens}-token prompt, TTFT median of {args.reps} ({mode}); "
          f"KV {kv_mib:.0f} MiB per prompt")
    print("| configuration | TTFT (s) | speed-up vs in-process prefill | vs vLLM cold | "
          "cached tokens | same first token |")
    print("|---|---:|---:|---:|---:|---|")
    for name, conf, phase in rows:
        rs = r[conf][phase]
        t = med(rs)
        ref = r[conf].get("prefill")
        pair = (f"{statistics.median(p[0] / x[0] for p, x in zip(ref, rs)):.1f}x"
                if ref and phase != "prefill" else "-")
        same = all(row[2] == f for row, f in zip(rs, firsts))
        cached = statistics.median(row[1] for row in rs)
        print(f"| {name} | {t:.3f} | {pair} | {plain / t:.1f}x | {cached:.0f} | "
              f"{'yes' if same else 'NO'} |")
    pre = {c: med(v["prefill"]) for c, v in r.items() if "prefill" in v}
    print("in-process prefill (s): " + ", ".join(f"{c} {v:.2f}" for c, v in pre.items())
          + f"; vLLM cold {plain:.2f}")
    print("init (s): " + ", ".join(f"{c} {v['init_s']:.1f}" for c, v in r.items()))

if __name__ == "__main__":
    sys.exit(main())
