"""Hybrid models (issue 38): bytes stored per token and TTFT of hits on a sliding-window/full
model, lmc's per-group storage against storing every layer for every token, and against
recomputing. Reference engine, CPU.

Three ways to serve one random-weight Llama whose layers mix sliding-window and full
attention (``layer_types``; ``--full-every 2``: half of each, ``6``: Gemma 3's 5:1):

* **recompute**: the engine alone, no cache;
* **hybrid**: lmc with the model's KV groups (:mod:`lmc.hybrid`): full layers stored for
  every token, sliding layers' parts only around checkpoints (``hybrid_checkpoint_interval``,
  default) and loaded for the window only;
* **store all**: lmc told nothing of the windows -- every layer stored and loaded for every
  token (what a connector without KV groups does).

Per way (median of ``--reps``, one request at a time, ``max_tokens=1``): the KV bytes in L1
per prompt token once the prompt is stored; TTFT of the same prompt again from L1 and from
the disk tier (L1 cleared first: the file's bytes come from the page cache); TTFT of a
continuation (the prompt and ``--extra`` new tokens: the next turn of a conversation),
which hits at the prompt's last whole chunk. Loads are the connector's layer-wise loads.

    python benchmarks/bench_hybrid.py                       # half sliding, W=512, 4096 tokens
    python benchmarks/bench_hybrid.py --full-every 6 --layers 12
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ttft import log, tokens  # noqa: E402

from lmc.connectors.reference import LMCReferenceConnector  # noqa: E402
from lmc.reference import LLM  # noqa: E402
from lmc.reference.tiny import cached_checkpoint  # noqa: E402

BLOCK = 16


class StoreAll(LMCReferenceConnector):
    """lmc without KV groups: the windows are not told, every layer is stored for every
    token (the comparison's "store everything")."""

    def register_kv_windows(self, windows: dict[str, int | None]) -> None:
        pass


def model(args: argparse.Namespace) -> Path:
    name = (f"bench-swa-h{args.hidden}-l{args.layers}-kv{args.kv_heads}-w{args.window}"
            f"-f{args.full_every}-p{args.tokens + args.extra + 64}")
    return cached_checkpoint(name, progress=log, hidden=args.hidden, layers=args.layers,
                             heads=args.hidden // 64, kv_heads=args.kv_heads,
                             max_position_embeddings=args.tokens + args.extra + 64,
                             sliding_window=args.window, full_every=args.full_every)


def engine(path: Path, n: int, conn: LMCReferenceConnector | None) -> LLM:
    return LLM(path, block_size=BLOCK, max_num_batched_tokens=n + 64, max_num_seqs=1,
               max_model_len=n + 64, kv_cache_memory=4 << 30, kv_connector=conn)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    out = llm.generate([prompt], max_tokens=1)[0]
    return out.ttft_s, out.num_cached_tokens


def median_ttft(llm: LLM, prompt: list[int], reps: int, before: Any = None
                ) -> tuple[float, int]:
    got = []
    cached = 0
    for _ in range(reps):
        if before is not None:
            before()
        time.sleep(0.2)  # the last run's background work (write-behind) is done
        t, cached = ttft(llm, prompt)
        got.append(t)
    return statistics.median(got), cached


def measure(way: str, path: Path, prompt: list[int], turn: list[int], args: argparse.Namespace,
            disk: Path) -> dict[str, Any]:
    n = len(turn)
    if way == "recompute":
        llm = engine(path, n, None)
        ttft(llm, prompt)  # warm-up
        out = {"p": median_ttft(llm, prompt, args.reps), "turn": median_ttft(llm, turn, args.reps)}
        llm.close()
        return out
    cls = StoreAll if way == "store all" else LMCReferenceConnector
    shutil.rmtree(disk, ignore_errors=True)
    cfg = {"chunk_size": args.chunk, "local_cpu_size": "4GiB", "local_disk": str(disk),
           "local_disk_size": "16GiB", "load_policy": "load_all"}
    conn = cls(cfg, model_dir=path)
    llm = engine(path, n, conn)
    ttft(llm, prompt)  # stores the prompt
    conn.cache.flush(120)
    used = conn.cache.pool.used_bytes
    out: dict[str, Any] = {"bytes_per_token": used / len(prompt),
                           "groups": conn.cache.describe_groups(),
                           "priced": conn.cache.load_bytes.load(len(prompt) - 1)}
    out["p"] = median_ttft(llm, prompt, args.reps)
    out["p_disk"] = median_ttft(llm, prompt, args.reps, before=conn.cache.storage.clear_l1)
    conn.cache.storage.clear_l1()
    ttft(llm, prompt)  # back in L1 (from disk)
    out["turn"] = median_ttft(llm, turn, 1)  # stores the turn's new chunks: once
    llm.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--full-every", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--extra", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = model(args)
    prompt = tokens(1, args.tokens)
    turn = prompt + tokens(2, args.extra)
    work = Path(tempfile.mkdtemp(prefix="lmc-bench-hybrid-"))
    load0 = os.getloadavg()[0]
    rows = {}
    try:
        for way in ("recompute", "hybrid", "store all"):
            log(f"{way} ...")
            rows[way] = measure(way, path, prompt, turn, args, work / "disk")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows, args, load0)
    return 0


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace, load0: float) -> None:
    kv_heads, head = args.kv_heads, 64
    every = args.layers * 2 * kv_heads * head * 4  # fp32 K and V of every layer
    print(f"model: hidden {args.hidden}, {args.layers} layers ({rows['hybrid']['groups']}), "
          f"{args.tokens}-token prompt, turn +{args.extra}, chunk {args.chunk}; every layer "
          f"for every token = {every:,} B/token; load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    print("| way | KV bytes stored per token | load priced (B, whole prompt) | TTFT repeat, "
          "L1 | TTFT repeat, disk | TTFT next turn (hit) |")
    print("|---|---|---|---|---|---|")
    for way, r in rows.items():
        stored = f"{r['bytes_per_token']:,.0f} ({r['bytes_per_token'] / every:.2f}x)" \
            if "bytes_per_token" in r else "-"
        priced = f"{r['priced']:,.0f}" if "priced" in r else "-"
        print(f"| {way} | {stored} | {priced} | {ms(r, 'p')} | {ms(r, 'p_disk')} | "
              f"{ms(r, 'turn')} |")


def ms(r: dict[str, Any], key: str) -> str:
    """A TTFT figure and its hit, or "-" where the way has none."""
    if key not in r:
        return "-"
    t, hit = r[key]
    return f"{t * 1e3:,.0f} ms ({hit} hit)"


if __name__ == "__main__":
    sys.exit(main())
