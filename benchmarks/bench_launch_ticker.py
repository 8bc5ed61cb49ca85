"""A GPU engine's shape on the CPU (issue 36): an engine thread that launches short
operations and waits, beside lmc's threads doing a real cold save.

A GPU engine's Python thread only launches kernels and waits for them, so whatever holds
the GIL in lmc's threads (hashing, gathering, serialising, checksums, writes) delays every
launch. Here the **ticker** is that thread: it issues one tiny torch op and then waits
(``--wait-us``, releasing the GIL, as a stream wait does), over and over, recording how
long each iteration took. It runs:

* **idle**: alone (its own rate: iterations per second);
* **plain copies**: beside a thread gathering the same bytes with ``torch.index_select``
  (which releases the GIL) layer by layer, as lmc's gathers would;
* **plain copies + writes** (``--writes``): the same, then the bytes written to a file
  with O_DIRECT on 4 threads -- what lmc's save adds, without lmc (on a VM the disk's
  writes cost the guest's cores);
* **lmc saves**: beside a thread that saves fresh prompts through ``store_layer`` --
  ``save(layer)`` per layer, ``commit()`` -- into L1 and a disk tier with write-behind: lmc's
  I/O thread gathers, the write-behind and disk threads checksum and write.

Rounds are short and interleaved (idle, plain, lmc; ``--prompts`` each): on a shared
machine the load changes between rounds more than within one. Figures: the ticker's rate
in each (median over rounds, and its ratio to idle), lmc's rate as a share of the plain
copies' in the same round (median of the rounds' ratios; bar: >= 0.9), the iterations' p50/p99/max against idle's p50 (how late a
launch runs), and the save thread's wall time for the same bytes. ``--profile`` runs
py-spy (``--gil``: samples only the thread holding the GIL) over the lmc phase and prints
the functions that held it most.

    python benchmarks/bench_launch_ticker.py             # 2,048-token prompts, 64 KiB/token
    python benchmarks/bench_launch_ticker.py --quick     # smaller, for smoke runs
"""

from __future__ import annotations

import argparse
import collections
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lmc import CacheConfig, CacheEngine, KVSpec

MiB = 1 << 20


class Ticker:
    """The engine's thread: a tiny op, then a wait that releases the GIL; each iteration's
    duration recorded while ``recording``."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.durations: list[float] = []
        self.recording = threading.Event()
        self.stop = threading.Event()
        self._pause = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def _run(self) -> None:
        x = torch.ones(16)
        y = torch.empty(16)
        last = time.perf_counter()
        while not self.stop.is_set():
            torch.add(x, 1.0, out=y)  # one launch
            self._pause.wait(self.wait_s)  # the stream wait: GIL released
            now = time.perf_counter()
            if self.recording.is_set():
                self.durations.append(now - last)
            last = now

    def measure(self, work: Callable[[], None]) -> tuple[list[float], float]:
        """Iteration durations and wall seconds while ``work`` runs on this thread."""
        self.durations = []
        self.recording.set()
        t0 = time.perf_counter()
        work()
        wall = time.perf_counter() - t0
        self.recording.clear()
        return list(self.durations), wall


def paged_cache(layers: int, heads: int, dim: int, blocks: int, bs: int) -> list[torch.Tensor]:
    return [torch.randn(2, blocks, bs, heads, dim) for _ in range(layers)]


def slots_for(n: int, blocks: int, bs: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(blocks, generator=g)[: -(-n // bs)]
    return (perm[:, None] * bs + torch.arange(bs)).flatten()[:n]


def summary(durs: list[float], idle_p50: float, wall: float) -> dict[str, float]:
    durs = sorted(durs) or [float("nan")]
    return {"iterations": len(durs), "rate_per_s": len(durs) / wall if wall else 0.0,
            "p50_us": durs[len(durs) // 2] * 1e6,
            "p99_us": durs[min(len(durs) - 1, int(len(durs) * 0.99))] * 1e6,
            "max_us": durs[-1] * 1e6, "late_p99_us": (durs[int(len(durs) * 0.99) - 1]
                                                      - idle_p50) * 1e6,
            "work_s": wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    bs, n, prompts = 16, args.tokens, args.prompts
    blocks = n // bs + 64
    kv = paged_cache(args.layers, args.kv_heads, args.head_dim, blocks, bs)
    spec = KVSpec.from_tensors(kv, "vllm_flash", block_size=bs)
    nbytes = spec.chunk_nbytes(n)
    tmp = Path(tempfile.mkdtemp(prefix="lmc-bench-ticker-"))
    cfg = CacheConfig(chunk_size=256, local_cpu_size=int(nbytes * (prompts + 2)),
                      local_disk=str(tmp), local_disk_size=int(nbytes * (prompts + 2)))
    eng = CacheEngine(cfg, spec, "bench-ticker")
    eng.pool.wait_ready()
    slots = slots_for(n, blocks, bs, 1)
    tok = [torch.randint(2, 100_000, (n,), generator=torch.Generator().manual_seed(100 + i))
           for i in range(args.rounds * prompts + 1)]
    # warm: lmc's first store and the plain path's first gather (first-use costs apart)
    st = eng.store_layer(tok[-1], kv, slots)
    for i in range(args.layers):
        st.save(i)
    st.commit()
    eng.flush(60)
    idx = slots.long()
    # page-aligned buffers (O_DIRECT writes need them), one per layer
    maps = [mmap.mmap(-1, 2 * n * args.kv_heads * args.head_dim * 4)
            for _ in range(args.layers)]
    bufs = [torch.frombuffer(m, dtype=torch.float32).view(2, n, args.kv_heads, args.head_dim)
            for m in maps]
    copier = ThreadPoolExecutor(1, thread_name_prefix="plain-copy")
    writer = ThreadPoolExecutor(4, thread_name_prefix="plain-write")
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(tmp / "plain.bin", flags, 0o600)
    used = [0]

    def plain_writes() -> None:
        """The plain copies, each prompt's bytes then written to a file (O_DIRECT, 4
        threads): what lmc's save does beyond the copies, without lmc. Every prompt's bytes
        are written, as lmc's disk tier writes every prompt (until 2026-12-04 only the
        last prompt's were: half of lmc's writes at the default two prompts)."""
        plain(write=True)

    def plain(write: bool = False) -> None:
        for p in range(prompts):
            futs = [copier.submit(lambda i=i: torch.index_select(
                kv[i].view(2, -1, args.kv_heads, args.head_dim), 1, idx, out=bufs[i]))
                for i in range(args.layers)]
            for f in futs:
                f.result()
            if write:
                base = p * len(maps) * len(maps[0])
                futs = [writer.submit(os.pwrite, fd, m, base + i * len(m))
                        for i, m in enumerate(maps)]
                for f in futs:
                    f.result()

    def lmc_saves() -> None:
        for _ in range(prompts):
            t = tok[used[0]]
            used[0] += 1
            st = eng.store_layer(t, kv, slots)
            for i in range(args.layers):
                st.save(i)
            st.commit()
        eng.flush(120)  # the write-behind's disk writes are part of the save

    ticker = Ticker(args.wait_us * 1e-6)
    ticker.thread.start()
    res: dict[str, Any] = {"tokens": n, "prompts": prompts, "bytes": nbytes * prompts,
                           "layers": args.layers, "wait_us": args.wait_us, "rounds": []}
    try:
        time.sleep(0.2)
        for rnd in range(args.rounds):  # interleaved: the machine's load shared alike
            idle_d, idle_w = ticker.measure(lambda: time.sleep(args.idle_s))
            idle_p50 = statistics.median(idle_d)
            plain_d, plain_w = ticker.measure(plain)
            pw_d, pw_w = ticker.measure(plain_writes) if args.writes else ([], 0.0)
            prof = None
            if args.profile and rnd == args.rounds - 1:
                prof = start_profile()
            lmc_d, lmc_w = ticker.measure(lmc_saves)
            if prof is not None:
                res["gil_top"] = stop_profile(prof)
            r = {"idle": summary(idle_d, idle_p50, idle_w),
                 "plain": summary(plain_d, idle_p50, plain_w),
                 **({"plain_writes": summary(pw_d, idle_p50, pw_w)} if args.writes else {}),
                 "lmc": summary(lmc_d, idle_p50, lmc_w)}
            res["rounds"].append(r)
            print(f"round {rnd}: " + ", ".join(f"{k} {v['rate_per_s']:.0f}/s" for k, v in
                                               r.items()), file=sys.stderr, flush=True)
    finally:
        ticker.stop.set()
        ticker.thread.join()
        copier.shutdown()
        writer.shutdown()
        os.close(fd)
        eng.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def start_profile() -> tuple[subprocess.Popen, str] | None:
    if shutil.which("py-spy") is None:
        print("--profile: py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return None
    out = tempfile.mktemp(suffix=".txt")
    proc = subprocess.Popen(["py-spy", "record", "--gil", "--threads", "--nonblocking",
                             "-r", "1000", "--format", "raw", "-o", out, "--pid",
                             str(os.getpid())], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    return proc, out


def stop_profile(prof: tuple[subprocess.Popen, str] | None, top: int = 15) -> list[str]:
    if prof is None:
        return []
    proc, out = prof
    proc.send_signal(2)
    proc.wait(30)
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    funcs: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(out).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        tid = frames[0].split("(")[-1].rstrip(")").strip()
        name = names.get(tid, frames[0])
        tail = " < ".join(f.split(" (")[0] for f in reversed(frames[-4:]))
        funcs[f"{name}: {tail}"] += int(count)
        total += int(count)
    os.unlink(out)
    return [f"{100 * c / max(total, 1):5.1f}%  {f}" for f, c in funcs.most_common(top)]


def report(res: dict[str, Any]) -> str:
    kinds = [k for k in ("idle", "plain", "plain_writes", "lmc") if k in res["rounds"][0]]
    med = {k: {m: statistics.median(r[k][m] for r in res["rounds"])
               for m in res["rounds"][0][k]} for k in kinds}
    # each round's lmc rate over the plain copies' right before it (the machine's load
    # changes between rounds far more than within one): the median of those pairs
    pairs = sorted(r["lmc"]["rate_per_s"] / r["plain"]["rate_per_s"] for r in res["rounds"])
    idle = med["idle"]["rate_per_s"]
    lines = [f"Launch-and-wait ticker beside a cold save: {res['prompts']} prompts x "
             f"{res['tokens']} tokens, {res['bytes'] / MiB:.0f} MiB, {res['layers']} layers; "
             f"ticker waits {res['wait_us']:.0f} us per op (median of {len(res['rounds'])} "
             "interleaved rounds)", "",
             "| beside | ticker rate | of idle | p50 | p99 | max | saver's wall |",
             "|---|---|---|---|---|---|---|"]
    for k, name in (("idle", "nothing"), ("plain", "plain torch copies"),
                    ("plain_writes", "plain copies + O_DIRECT file writes"),
                    ("lmc", "lmc saves (L1 + disk, write-behind)")):
        if k not in med:
            continue
        m = med[k]
        lines.append(f"| {name} | {m['rate_per_s']:.0f}/s | {m['rate_per_s'] / idle:.2f} | "
                     f"{m['p50_us']:.0f} us | {m['p99_us']:.0f} us | {m['max_us'] / 1e3:.1f} ms "
                     f"| {m['work_s'] * 1e3:.0f} ms |")
    share = statistics.median(pairs)
    res["lmc_over_plain"] = share
    lines += ["", f"lmc saves / plain copies, per round: {share:.2f} of the ticker's rate "
              f"(median of {len(pairs)}, spread {pairs[0]:.2f}-{pairs[-1]:.2f}; bar >= 0.9: "
              f"{'yes' if share >= 0.9 else 'NO'})"]
    if "plain_writes" in med:
        pw = sorted(r["lmc"]["rate_per_s"] / r["plain_writes"]["rate_per_s"]
                    for r in res["rounds"])
        res["lmc_over_plain_writes"] = statistics.median(pw)
        lines.append(f"lmc saves / plain copies + writes, per round: {statistics.median(pw):.2f} "
                     f"(spread {pw[0]:.2f}-{pw[-1]:.2f}): lmc's own share of the slowdown")
    if res.get("gil_top"):
        lines += ["", "GIL held (py-spy --gil, lmc phase of the last round):",
                  *res["gil_top"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=2, help="prompts saved per phase")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--wait-us", type=float, default=50.0)
    ap.add_argument("--idle-s", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="1,024-token prompts, 4 layers, "
                    "4 rounds")
    ap.add_argument("--writes", action="store_true",
                    help="also plain copies followed by O_DIRECT writes of their bytes")
    ap.add_argument("--profile", action="store_true", help="py-spy --gil over the lmc phase")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.rounds, args.layers = 1024, 4, 4
    res = run(args)
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
