"""A fresh engine behind a slow link (issue 36): TTFT against the engine alone.

Engine A computes prompts and stores them in an ``lmc server``; then engine B -- a new lmc
engine (new connector and ``CacheEngine``: empty L1, nothing measured, its compute known
only by its floor) -- is asked for each prompt through a link ``tc`` shapes (this run's own
network namespace, as ``bench_load_or_recompute.py``). Rows (median of ``--reps``, each rep
a new engine B and a prompt of its own, interleaved with the engine alone):

* **slow from the start**: the link at ``--slow`` bytes/s (default 3 MiB/s: the issue's
  2,048-token prompt, 32 MiB of KV, loaded whole took 5.07x the engine alone);
* **slows mid-load**: the link at ``--fast`` bytes/s until ``--slow-after`` seconds into the
  request, then ``--slow``;
* each with ``load_policy: load_all`` beside it (every load finishes: what lmc did before
  loads watched themselves).

``--tier`` picks what sits behind the link: ``server`` (an ``lmc server``, the default),
``redis`` (a ``redis-server``, the link shaped by ``tc`` alike) or ``disk`` (lmc's disk tier
behind the ``rate_limit`` wrapper: the link is the wrapper's, so no namespace, root or ``tc``;
the mid-load row lowers the wrapper's rate at ``--slow-after``).

The engine alone is a fresh engine too (a new ``LLM``, its first request), so both pay the
engine's own first-use costs (its KV cache's first touch); the warm engine's figure is
printed beside it.

Bar: lmc's TTFT <= 1.25x the engine alone, tokens identical (checked every rep).

    python benchmarks/bench_fresh_link.py                 # needs root, ip, tc
    python benchmarks/bench_fresh_link.py --tokens 512 --reps 1 --layers 2   # quick
    python benchmarks/bench_fresh_link.py --tier disk     # no root needed
    python benchmarks/bench_fresh_link.py --tier redis
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load_or_recompute import free_port, shape_link, start_redis  # noqa: E402
from bench_server import lmc_daemon  # noqa: E402
from bench_ttft import model_dir, tokens  # noqa: E402

from lmc.connectors.core import compute_floor  # noqa: E402
from lmc.connectors.reference import LMCReferenceConnector  # noqa: E402
from lmc.reference import LLM  # noqa: E402

BLOCK = 16
MiB = 1 << 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def engine(path: Path, n: int, conn: LMCReferenceConnector | None = None) -> LLM:
    return LLM(path, block_size=BLOCK, max_num_batched_tokens=n + 64, max_num_seqs=1,
               max_model_len=n + 64, kv_cache_memory=2 << 30, kv_connector=conn)


def first_token(llm: LLM, prompt: list[int]) -> tuple[float, int, int]:
    out = llm.generate([prompt], max_tokens=1)[0]
    return out.ttft_s, out.num_cached_tokens, out.token_ids[0]


TIERS = ("server", "redis", "disk")
UNSHAPED = float(1 << 40)  # the disk wrapper's rate when the link is "unshaped"


class Link:
    """What engine B reaches its prompt through: a store behind loopback shaped by ``tc``
    (``server``, ``redis``), or the disk tier behind a ``rate_limit`` wrapper (``disk``)."""

    def __init__(self, kind: str, target: str) -> None:
        self.kind, self.target = kind, target  # the store's URL, or the disk directory
        self.conn: LMCReferenceConnector | None = None  # the engine whose wrapper is set

    def cfg(self, policy: str = "auto", rate: float | None = None) -> dict[str, Any]:
        base: dict[str, Any] = {"chunk_size": 256, "local_cpu_size": "512MiB",
                                "load_policy": policy}
        if self.kind == "disk":
            return {**base, "tiers": ["memory", {
                "wrap": "rate_limit", "bytes_per_second": int(rate or UNSHAPED),
                "tier": {"backend": "disk", "path": self.target, "capacity": "8GiB"}}]}
        url = self.target + ("?ns=fresh" if self.kind == "server" else "")
        return {**base, "remote_url": url, "remote_timeout": 120}

    def shape(self, rate: float | None) -> None:
        """The link at ``rate`` bytes/s from now (``None``: unshaped)."""
        if self.kind != "disk":
            shape_link(rate)
        elif self.conn is not None:
            self.conn.cache.storage.lower[0].rate = rate or UNSHAPED


@contextlib.contextmanager
def open_store(kind: str, work: Path) -> Any:
    """The store engine A fills and engine B reads, as a :class:`Link`."""
    if kind == "server":
        with lmc_daemon(4 << 30, work) as (url, _):
            yield Link(kind, url)
    elif kind == "redis":
        port = free_port()
        proc = start_redis(port, str(work))
        try:
            yield Link(kind, f"redis://127.0.0.1:{port}")
        finally:
            proc.kill()
            proc.wait()
    else:
        yield Link(kind, str(work / "disk"))


def fresh_run(path: Path, link: Link, n: int, prompt: list[int], policy: str,
              start_rate: float, slow_at: tuple[float, float] | None) -> dict[str, Any]:
    """A new engine B asks for ``prompt`` over a link at ``start_rate``; ``slow_at``:
    (seconds, rate) the link drops to during the request."""
    compute_floor._RATES.clear()  # as a new process: the matmul rate measured again
    link.shape(start_rate)
    conn = LMCReferenceConnector(link.cfg(policy, start_rate), model_dir=path)
    link.conn = conn
    llm = engine(path, n, conn)
    timer = None
    if slow_at is not None:
        timer = threading.Timer(slow_at[0], link.shape, args=(slow_at[1],))
        timer.start()
    try:
        ttft, cached, tok = first_token(llm, prompt)
        stats = conn.stats()
    finally:
        if timer is not None:
            timer.cancel()
        link.conn = None
        llm.close()  # waits for a read a stopped load abandoned
    return {"ttft_s": ttft, "cached": cached, "token": tok,
            "stopped": stats.get("worker.loads_stopped", 0),
            "lookup_late": sum(v for k, v in stats.items()
                               if k.endswith((".lookup_late", ".lookup_busy")))}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    path = model_dir(args.hidden, args.layers, args.kv_heads, max(8192, args.tokens + 64))
    n = args.tokens
    bpt = args.layers * 2 * args.kv_heads * (args.hidden // (args.hidden // 64)) * 4
    rows = {"slow from the start": None, "slows mid-load": args.slow_after}
    res: dict[str, Any] = {"tier": args.tier, "tokens": n, "kv_bytes": n * bpt,
                           "slow": args.slow,
                           "fast": args.fast, "slow_after": args.slow_after, "rows": {}}
    plain = engine(path, n)
    for i in range(2):  # warm-up
        first_token(plain, [0] + tokens(7 + i, n - 1))
    work = Path(tempfile.mkdtemp(prefix="lmc-bench-fresh-"))
    try:
        with open_store(args.tier, work) as link:
            link.shape(None)
            a = LMCReferenceConnector(link.cfg(), model_dir=path)
            llm_a = engine(path, n, a)
            prompts = {(row, pol, r): [0] + tokens(1000 + 97 * r + 7 * k + len(pol), n - 1)
                       for k, row in enumerate(rows) for pol in ("auto", "load_all")
                       for r in range(args.reps)}
            want = {}
            for key, p in prompts.items():  # engine A computes and stores every prompt
                want[key] = first_token(llm_a, p)[2]
            assert a.cache.flush(120), "engine A's writes did not reach the store"
            llm_a.close()
            log(f"{len(prompts)} prompts of {n} tokens stored ({n * bpt / MiB:.0f} MiB of KV "
                "each)")
            for row, after in rows.items():
                got: dict[str, list[dict[str, Any]]] = {"alone": [], "warm": [], "auto": [],
                                                        "load_all": []}
                for r in range(args.reps):
                    link.shape(None)
                    # the engine alone, fresh as B is (its own first-use costs paid alike)
                    fresh = engine(path, n)
                    try:
                        got["alone"].append(
                            {"ttft_s": first_token(fresh, prompts[(row, "auto", r)])[0]})
                    finally:
                        fresh.close()
                    got["warm"].append({"ttft_s": first_token(plain, prompts[(row, "auto",
                                                                              r)])[0]})
                    for pol in ("auto", "load_all"):
                        one = fresh_run(path, link, n, prompts[(row, pol, r)], pol,
                                        args.slow if after is None else args.fast,
                                        None if after is None else (after, args.slow))
                        assert one["token"] == want[(row, pol, r)], "tokens differ"
                        got[pol].append(one)
                        log(f"{row}, {pol}, rep {r}: {json.dumps(one)}")
                med = {k: statistics.median(x["ttft_s"] for x in v) for k, v in got.items()}
                res["rows"][row] = {
                    "alone_s": med["alone"], "warm_s": med["warm"], "auto_s": med["auto"],
                    "load_all_s": med["load_all"],
                    "auto_cached": [x["cached"] for x in got["auto"]],
                    "auto_stopped": [x["stopped"] for x in got["auto"]],
                    "load_all_cached": [x["cached"] for x in got["load_all"]],
                    "auto_lookup_late": [x["lookup_late"] for x in got["auto"]]}
            link.shape(None)
    finally:
        plain.close()
        shutil.rmtree(work, ignore_errors=True)
    return res


def report(res: dict[str, Any]) -> str:
    lines = [f"Fresh engine behind a slow link to {res.get('tier', 'server')}: "
             f"{res['tokens']} tokens "
             f"({res['kv_bytes'] / MiB:.0f} MiB of KV), link {res['slow'] / MiB:.1f} MiB/s "
             f"(mid-load: {res['fast'] / MiB:.0f} MiB/s for {res['slow_after']:.2f} s first)",
             "", "| link | engine alone, fresh (warm) | lmc (tokens loaded) | ratio | "
             "load_all (tokens) | ratio | bar <= 1.25x |", "|---|---|---|---|---|---|---|"]
    for row, r in res["rows"].items():
        ratio = r["auto_s"] / r["alone_s"]
        lines.append(
            f"| {row} | {r['alone_s'] * 1e3:.0f} ms ({r['warm_s'] * 1e3:.0f} ms) | "
            f"{r['auto_s'] * 1e3:.0f} ms "
            f"({'/'.join(map(str, r['auto_cached']))}) | {ratio:.2f}x | "
            f"{r['load_all_s'] * 1e3:.0f} ms ({'/'.join(map(str, r['load_all_cached']))}) | "
            f"{r['load_all_s'] / r['alone_s']:.2f}x | {'yes' if ratio <= 1.25 else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tier", choices=TIERS, default="server",
                    help="what is behind the link (module doc)")
    ap.add_argument("--slow", type=float, default=3 * MiB, help="bytes/s of the slow link")
    ap.add_argument("--fast", type=float, default=200 * MiB,
                    help="bytes/s of the link before it slows (mid-load row)")
    ap.add_argument("--slow-after", type=float, default=0.1,
                    help="seconds into the request the mid-load link slows down")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--verbose", action="store_true", help="lmc's INFO lines (a stop's reason)")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one engine thread, as the other CPU TTFT benchmarks
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s %(message)s")
    if not args.inside and args.tier != "disk":  # the disk's link is the wrapper's
        return in_namespace(argv if argv is not None else sys.argv[1:])
    res = measure(args)
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def in_namespace(argv: list[str]) -> int:
    """This benchmark again inside a network namespace of its own (its loopback is the
    link ``tc`` shapes); needs root, ``ip`` and ``tc``."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        print("bench_fresh_link: shaping a link needs root, ip and tc", file=sys.stderr)
        return 2
    ns = f"lmc-fresh-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, __file__, *argv,
                               "--inside"]).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


if __name__ == "__main__":
    sys.exit(main())
