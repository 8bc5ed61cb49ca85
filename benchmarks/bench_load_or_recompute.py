"""Load or recompute (issue 23): TTFT of a cached prompt whose KV sits in a tier slower than
the engine's compute, in one about as fast, and in L1 -- no cache, loading everything, lmc's
chosen split, and the best split a sweep over N finds, per prompt length, in one run.

Per prompt length and tier the figures are (median of ``--reps``; one request at a time,
``max_tokens=1``, the whole prompt in one step):

* **no cache**: the engine alone (no connector);
* **load all**: lmc with ``load_policy: load_all`` (what lmc did before it decided);
* **chosen**: lmc's own split (``load_policy: auto``) from the speeds it measured itself
  while the benchmark warmed it up; the tokens it loaded are printed with it;
* **sweep best**: the fastest of loading ``N`` tokens for N on an even grid over the hit
  (the sweep forces each N through the same connector).

The lower tier is a real Redis server reached over a real slow link: on the CPU the whole
run happens inside a network namespace of its own whose loopback is shaped by ``tc`` (a
token bucket at ``--slow`` and ``--between`` times the bytes per second the engine computes,
measured first), so Redis's layer-by-layer reads overlap the compute as on any link. On a
GPU (``--device cuda``, run by ``benchmarks/gpu_check.sh``) the lower tier is the disk tier
as it is (no shaping: the device's disk is what it is), and the slow/between rows are the
disk's one row. Bars (issue 23): slower than compute, chosen <= 1.05x no cache; in between,
chosen within 10% of the sweep's best and better than both ends; L1, chosen no worse than
load all (within 5%, the runs' noise).

    python benchmarks/bench_load_or_recompute.py                # CPU, Redis over tc
    python benchmarks/bench_load_or_recompute.py --device cuda --model 8b-kv --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ttft import MODELS, model_dir, tokens  # noqa: E402

from lmc.connectors.core.load_policy import LoadPolicy  # noqa: E402
from lmc.connectors.reference import LMCReferenceConnector  # noqa: E402
from lmc.reference import LLM  # noqa: E402

BLOCK = 16
SETTLE_S = 0.3  # before each measured run: the last one's background work is done (--settle)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Forced(LoadPolicy):
    """The sweep: load exactly up to ``end`` (clamped to the hit), whatever the speeds."""

    def __init__(self, end: int) -> None:
        super().__init__(lambda: None)
        self.end = end

    def decide(self, request_id: str, found: Any, start: int, hit_end: int, total: int,
               align: int = 1) -> int:
        return max(start, min(hit_end, self.end))


def engine(path: Path, n: int, device: str, dtype: str,
           conn: LMCReferenceConnector | None = None) -> LLM:
    return LLM(path, block_size=BLOCK, max_num_batched_tokens=n + 64, max_num_seqs=1,
               max_model_len=n + 64, kv_cache_memory=8 << 30, kv_connector=conn,
               device=device, dtype=dtype)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    out = llm.generate([prompt], max_tokens=1)[0]
    return out.ttft_s, out.num_cached_tokens


def shape_link(rate: float | None) -> None:
    """This namespace's loopback at ``rate`` bytes per second (a token bucket); ``None``:
    unshaped."""
    if rate is None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False,
                       stderr=subprocess.DEVNULL)
        return
    bits = max(8_000, int(rate * 8))
    # the bucket holds a few of loopback's 64 KiB packets (one larger than the bucket is
    # never sent), and the queue 30 s of the rate: TCP is slowed, never made to drop
    burst = max(256 << 10, int(rate / 100))
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate",
                    f"{bits}bit", "burst", str(burst), "latency", "30s"], check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int, workdir: str) -> subprocess.Popen:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", workdir,
                             "--maxmemory", "0", "--protected-mode", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


class Bench:
    """One lmc engine over [L1, lower tier]; each run starts with the prompt's chunks where
    the row wants them (L1, or the lower tier only)."""

    def __init__(self, args: argparse.Namespace, path: Path, cfg: dict[str, Any]) -> None:
        self.args = args
        self.conn = LMCReferenceConnector(cfg, model_dir=path)
        self.llm = engine(path, args.max_tokens, args.device, args.dtype, self.conn)
        self.auto = self.conn.scheduler.policy

    @property
    def eng(self) -> Any:
        return self.conn.cache

    def place(self, prompt: list[int], where: str) -> None:
        """Chunks of ``prompt``: in L1 (``l1``), or only in the lower tier (``lower``)."""
        eng = self.eng
        keys = eng.db.keys(prompt)
        deadline = time.monotonic() + 120
        while not eng.flush(1) and time.monotonic() < deadline:
            pass
        while eng.prefetches_pending() and time.monotonic() < deadline:
            time.sleep(0.01)  # the last run's prefetch (cancelled at admission) has ended
        time.sleep(self.args.settle)  # a layered read promotes from its own thread at its end
        if where == "lower":
            eng.storage.l1.delete(keys)
            assert eng.storage.l1.prefix_hits(keys) == 0
        else:
            got = eng.lookup_result(prompt)
            assert got.tokens == len(prompt) and set(got.sources) == {0}, "not all in L1"

    def run(self, prompt: list[int], where: str, policy: LoadPolicy | None) -> tuple[float, int]:
        """TTFT and tokens loaded under ``policy``: lmc's own (its loads watch themselves
        and may stop early), or a forced split (load all, a sweep's N), loaded whole."""
        self.place(prompt, where)
        worker = self.conn.worker
        assert worker is not None
        self.conn.scheduler.policy = policy
        worker.watch_loads = policy is self.auto
        try:
            return ttft(self.llm, prompt)
        finally:
            self.conn.scheduler.policy = self.auto
            worker.watch_loads = True

    def close(self) -> None:
        self.llm.close()


def measure(b: Bench, plain: LLM, prompt: list[int], where: str, reps: int, sweep: list[int]
            ) -> dict[str, Any]:
    """No cache, load all, chosen and each swept N, interleaved rep by rep (the machine's
    load is shared alike)."""
    n = len(prompt)
    # the estimates the row's decisions start from (they go on learning during it)
    before = {k: v for k, v in b.eng.stats().items() if k.startswith("speed.")}
    all_ = LoadPolicy(lambda: None, enabled=False)
    times: dict[str, list[float]] = {"no_cache": [], "load_all": [], "chosen": []}
    times.update({f"n{k}": [] for k in sweep})
    chosen_tokens = []
    order = list(times)
    for rep in range(reps):
        # rotated each rep, so no figure always follows the same one (a long load's
        # promotions and the link's queue settle while the next run starts)
        for name in order[rep % len(order):] + order[: rep % len(order)]:
            if name == "no_cache":
                time.sleep(b.args.settle)
                times[name].append(ttft(plain, prompt)[0])
                continue
            policy = all_ if name == "load_all" else b.auto if name == "chosen" \
                else Forced(int(name[1:]))
            t, c = b.run(prompt, where, policy)
            if name == "load_all":
                assert c == n - 1, f"load all loaded {c} of {n - 1}"
            elif name == "chosen":
                chosen_tokens.append(c)
            else:
                assert c == min(int(name[1:]), n - 1), (name, c)
            times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    best_n = min(sweep, key=lambda k: med[f"n{k}"])
    return {"no_cache_s": med["no_cache"], "load_all_s": med["load_all"],
            "chosen_s": med["chosen"],
            "chosen_tokens": statistics.median(chosen_tokens),
            "chosen_tokens_reps": chosen_tokens,
            "sweep": {k: med[f"n{k}"] for k in sweep}, "best_n": best_n,
            "best_s": med[f"n{best_n}"], "speeds_before": before,
            "speeds_after": {k: v for k, v in b.eng.stats().items() if k.startswith("speed.")}}


def inside(args: argparse.Namespace) -> dict[str, Any]:
    """Everything measured, in the namespace when on the CPU."""
    path = model_dir(args.hidden, args.layers, args.kv_heads, max(8192, args.max_tokens + 64),
                     args.heads, args.intermediate, args.dtype)
    itemsize = getattr(torch, args.dtype).itemsize
    bpt = args.layers * 2 * args.kv_heads * (args.hidden // args.heads) * itemsize
    lengths = [int(x) for x in args.tokens.split(",")]
    res: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "hidden": args.hidden,
                           "layers": args.layers, "kv_heads": args.kv_heads,
                           "bytes_per_token": bpt, "threads": torch.get_num_threads(),
                           "device_name": (torch.cuda.get_device_name()
                                           if args.device == "cuda" else "CPU"),
                           "rows": []}
    log(f"model {path.name}: {bpt / 1024:.0f} KiB of KV per token, {args.dtype} on "
        f"{res['device_name']}")
    prompts = {n: [0] + tokens(100 + n, n - 1) for n in lengths}
    n_max = max(lengths)

    plain = engine(path, args.max_tokens, args.device, args.dtype)
    for i in range(2):  # warm-up: first-touch faults, allocator caches
        ttft(plain, [0] + tokens(7 + i, n_max - 1))
    first = statistics.median(ttft(plain, prompts[n_max])[0] for _ in range(args.reps))
    rate_c = n_max / first  # tokens per second computed: what the links are set from
    res["compute_tokens_per_s"] = rate_c
    log(f"no cache, {n_max} tokens: {first * 1e3:.1f} ms ({rate_c:.0f} tokens/s)")

    tmp = tempfile.mkdtemp(prefix="lmc-bench-lor-")
    redis = None
    try:
        total = sum(lengths) * bpt
        # every row's lookup finds the whole prompt in the lower tier: the split is what is
        # measured here, not the lookup's deadline (a loaded host can make a tier's answer
        # late by 20 ms, and a late answer is a miss; `lmc demo` measures that deadline)
        cfg: dict[str, Any] = {"chunk_size": args.chunk_size,
                               "local_cpu_size": max(512 << 20, 4 * total),
                               "lookup_min_wait": 60.0}
        if args.device == "cpu":
            port = free_port()
            redis = start_redis(port, tmp)
            cfg.update(remote_url=f"redis://127.0.0.1:{port}", remote_timeout=600,
                       remote_key_prefix="lor")
            rows = [("slower than compute", args.slow), ("in between", args.between)]
        else:
            cfg.update(local_disk=tmp, local_disk_size=4 * total)
            rows = [("disk", None)]
        b = Bench(args, path, cfg)
        try:
            # a running engine: misses of several lengths (its compute measured), every
            # prompt stored; then one load of each through the link (its speed measured)
            for i, n in enumerate(sorted({k for k in (256, 512, 1024, 2048) if k < n_max}
                                         | set(lengths))):
                ttft(b.llm, [0] + tokens(1000 + i, n - 1))
            for n in lengths:
                ttft(b.llm, prompts[n])
            b.place(prompts[lengths[-1]], "l1")  # every write reached the lower tier
            for label, factor in rows:
                if factor is not None:
                    shape_link(rate_c * bpt * factor)
                    log(f"link at {factor}x the compute: "
                        f"{rate_c * bpt * factor / 2**20:.1f} MiB/s")
                for n in lengths * 3:  # the link's speed as lmc sees it, from real loads
                    b.run(prompts[n], "lower", LoadPolicy(lambda: None, enabled=False))
                for n in lengths:
                    sweep = sorted({round(n * i / args.grid / args.chunk_size) * args.chunk_size
                                    for i in range(args.grid + 1)} | {n - 1})
                    sweep = [k for k in sweep if 0 <= k <= n - 1]
                    log(f"{label}, {n} tokens: sweep over {len(sweep)} splits ...")
                    row = measure(b, plain, prompts[n], "lower", args.reps, sweep)
                    row.update(tier=label, factor=factor, tokens=n,
                               link_bytes_per_s=None if factor is None
                               else rate_c * bpt * factor)
                    res["rows"].append(row)
                    log(json.dumps(row))
            if redis is not None:
                shape_link(None)  # L1 rows: the link idle anyway
            for n in lengths:
                b.run(prompts[n], "lower", LoadPolicy(lambda: None, enabled=False))
                sweep = sorted({round(n * i / args.grid / args.chunk_size) * args.chunk_size
                                for i in range(args.grid + 1)} | {n - 1})
                log(f"L1, {n} tokens ...")
                # fast runs, noisier: more of them
                row = measure(b, plain, prompts[n], "l1", 2 * args.reps + 1,
                              [k for k in sweep if k <= n - 1])
                row.update(tier="L1", factor=None, tokens=n, link_bytes_per_s=None)
                res["rows"].append(row)
                log(json.dumps(row))
            res["speeds"] = {k: v for k, v in b.eng.stats().items() if k.startswith("speed.")}
            res["policy"] = b.conn.scheduler.policy_stats()
        finally:
            b.close()
            plain.close()
    finally:
        if redis is not None:
            redis.kill()
            redis.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def verdicts(r: dict[str, Any]) -> tuple[str, str]:
    """(the bar, whether it holds) for one row."""
    if r["tier"] == "slower than compute" or (r["tier"] == "disk"
                                              and r["load_all_s"] > r["no_cache_s"]):
        ratio = r["chosen_s"] / r["no_cache_s"]
        return f"chosen/no cache {ratio:.2f} <= 1.05", "yes" if ratio <= 1.05 else "NO"
    if r["tier"] == "L1":
        ratio = r["chosen_s"] / r["load_all_s"]
        return f"chosen/load all {ratio:.2f} <= 1.05", "yes" if ratio <= 1.05 else "NO"
    ratio = r["chosen_s"] / r["best_s"]
    ends = r["chosen_s"] < min(r["no_cache_s"], r["load_all_s"])
    return (f"chosen/best {ratio:.2f} <= 1.10, < both ends: {'yes' if ends else 'no'}",
            "yes" if ratio <= 1.10 and ends else "NO")


def report(res: dict[str, Any]) -> str:
    lines = [f"Load or recompute, {res['device_name']} ({res['device']}, {res['dtype']}, "
             f"{res['threads']} threads): hidden {res['hidden']}, {res['layers']} layers, "
             f"{res['kv_heads']} KV heads, {res['bytes_per_token'] / 1024:.0f} KiB KV/token; "
             f"compute {res['compute_tokens_per_s']:.0f} tokens/s", "",
             "| tier | tokens | no cache | load all | chosen (tokens loaded) | sweep best (N) | "
             "bar | met |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        link = "" if not r["link_bytes_per_s"] else \
            f" ({r['link_bytes_per_s'] / 2**20:.0f} MiB/s)"
        bar, ok = verdicts(r)
        lines.append(f"| {r['tier']}{link} | {r['tokens']} | {r['no_cache_s'] * 1e3:.0f} ms | "
                     f"{r['load_all_s'] * 1e3:.0f} ms | {r['chosen_s'] * 1e3:.0f} ms "
                     f"({r['chosen_tokens']:.0f}) | {r['best_s'] * 1e3:.0f} ms ({r['best_n']}) "
                     f"| {bar} | {ok} |")
    sp = res.get("speeds", {})
    if "speed.prefill.c1_s" in sp:
        # what the rule believed the engine computes at each length, against the engine
        # alone as measured (the GPU's 3.3x came from an estimate at half the engine's speed)
        lines.append("")
        for n in sorted({r["tokens"] for r in res["rows"]}):
            est = sp["speed.prefill.c0_s"] + sp["speed.prefill.c1_s"] * n \
                + sp["speed.prefill.c2_s"] * n * n
            meas = statistics.median(r["no_cache_s"] for r in res["rows"] if r["tokens"] == n)
            lines.append(f"lmc's compute estimate, {n} tokens: {est * 1e3:.0f} ms, the engine "
                         f"alone {meas * 1e3:.0f} ms (ratio {est / meas:.2f}; saves "
                         f"{sp.get('speed.prefill.save_s_per_token', 0) * 1e6:.2f} us/token "
                         f"kept apart)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--model", choices=sorted(MODELS), default=None)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--grid", type=int, default=6, help="sweep points over the hit")
    ap.add_argument("--slow", type=float, default=0.25,
                    help="the slow link, times the bytes per second the engine computes")
    ap.add_argument("--between", type=float, default=1.0,
                    help="the in-between link, times the bytes per second computed")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 on the CPU, where the engine shares a "
                    "busy machine and spinning threads only add noise; torch's on CUDA)")
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help="seconds of quiet before each measured run (the last run's promotions "
                    "and prefetches end); the dry run's tiny model needs less")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_load_or_recompute --device cuda: no CUDA device on this machine: skipped")
        return 0
    args.intermediate = None
    if args.model:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = \
            MODELS[args.model]
    args.heads = args.heads or args.hidden // 64
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.max_tokens = max(int(x) for x in args.tokens.split(","))
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu" and not args.inside:
        return in_namespace(argv if argv is not None else sys.argv[1:])
    res = inside(args)
    text = report(res)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def in_namespace(argv: list[str]) -> int:
    """Run this benchmark again inside a network namespace made for it (its loopback is
    the link ``tc`` shapes); needs root, ``ip`` and ``tc``."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")
                                 and shutil.which("redis-server")):
        print("bench_load_or_recompute: the CPU run shapes a link with tc in a network "
              "namespace: it needs root, ip, tc and redis-server", file=sys.stderr)
        return 2
    ns = f"lmc-lor-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, __file__, *argv,
                               "--inside"]).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


if __name__ == "__main__":
    sys.exit(main())
