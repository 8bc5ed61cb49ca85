"""Redis tier bandwidth against its peers on the same server, in the same run.

For each value size (a KV chunk of a real model shape), every round measures, back to back:
  * ``redis-benchmark -t set,get -d SIZE -c 4 -P 1`` (C client, 4 connections): the limit.
    Without ``-r`` it SETs and GETs one key over and over, so the server's memory stays hot;
    a cache's puts create new keys, which costs the server page faults for fresh memory
    (2x slower here). So SET is also run as ``-t set -r 1000000000 --dbnum 1`` after a
    FLUSHDB: fresh keys, the same server work as the tier's put; the put ratio uses it;
  * the lmc Redis tier: ``put`` / ``get`` of a prompt's chunks (``--batch``) over
    ``connections`` (a backend option) connections, values verified, payloads landing in the pool;
  * redis-py alone (hiredis parser, one connection): SET / GET of the same value bytes;
  * the tier again with ``integrity_secret`` set (each value sealed and checked with a keyed
    tag, ``lmc.storage.integrity``), so the tag's cost shows as a ratio to the plain tier.
Before the sizes, one line gives single-thread rates on one buffer: memcpy, the xxh3 payload
checksum, the integrity tag, and keyed BLAKE2b / HMAC-SHA256 (the alternatives not taken).
Throughput counts payload bytes (the 72-byte header is not counted for the tier). Ratios are
medians over rounds of the per-round ratio, so that load from other processes cancels out.
Keys are deleted before each tier put, so every put really transfers (the tier skips keys
the server already has). One warm-up round runs first (server memory, connections).

    python benchmarks/bench_redis.py            # 1, 7 and 32 MiB values, 5 rounds
    python benchmarks/bench_redis.py --quick    # smaller, 2 rounds (smoke)
    python benchmarks/bench_redis.py --url redis://host:6379/0 --bench-port 6379
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import hmac
import io
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import redis
import torch
import xxhash

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.integrity import Integrity
from lmc.storage.serde import encode_header, tensor_bytes
from lmc.storage.tier import create_backend

GiB = 2**30
MiB = 2**20
# name -> chunk shape [layers, K|V, tokens, kv_heads * head_dim], bf16, 256 tokens
SHAPES = {
    "1MiB (Llama-3.2-1B, 32 tok)": (16, 2, 32, 512),
    "7MiB (Qwen2.5-1.5B, 256 tok)": (28, 2, 256, 256),
    "32MiB (Llama-3.1-8B, 256 tok)": (32, 2, 256, 1024),
}
QUICK = {"1MiB (Llama-3.2-1B, 32 tok)": (16, 2, 32, 512),
         "7MiB (Qwen2.5-1.5B, 256 tok)": (28, 2, 256, 256)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A loopback redis-server for the run, persistence off, stopped by its pid."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="lmc-bench-redis-")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--proto-max-bulk-len", "1gb",
             "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with redis.Redis(port=self.port, socket_connect_timeout=1) as c:
                    c.ping()
                return
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def _bench_cmd(port: int, tests: str, size: int, n: int, clients: int, *extra: str
               ) -> list[str]:
    return ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", tests, "-d", str(size),
            "-n", str(n), "-c", str(clients), "-P", "1", "--csv", *extra]


def _run_bench(cmd: list[str]) -> dict[str, float]:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return {r["test"]: float(r["rps"]) for r in csv.DictReader(io.StringIO(out))}


FRESH = ("-r", "1000000000", "--dbnum", "1")


def redis_benchmark(port: int, size: int, n: int, clients: int) -> dict[str, float]:
    """GiB/s of redis-benchmark: SET/GET of one key, and SET of fresh keys (db 1)."""
    same = _run_bench(_bench_cmd(port, "set,get", size, n, clients))
    with redis.Redis(port=port, db=1) as c:
        c.flushdb()
        fresh = _run_bench(_bench_cmd(port, "set", size, n, clients, *FRESH))
        c.flushdb()
    return {"put": same["SET"] * size / GiB, "get": same["GET"] * size / GiB,
            "put_fresh": fresh["SET"] * size / GiB}


def redis_py(client: redis.Redis, values: list[bytes], payload: int) -> dict[str, float]:
    """GiB/s of one redis-py connection doing SET then GET of each value."""
    keys = [f"bench:py:{i}" for i in range(len(values))]
    t0 = time.perf_counter()
    for k, v in zip(keys, values):
        client.set(k, v)
    t1 = time.perf_counter()
    for k in keys:
        client.get(k)
    t2 = time.perf_counter()
    total = payload * len(values)
    return {"put": total / (t1 - t0) / GiB, "get": total / (t2 - t1) / GiB}


def hash_rates(nbytes: int = 64 * MiB, reps: int = 5) -> dict[str, float]:
    """Single-thread GiB/s on one buffer (best of ``reps``): what a value costs per byte."""
    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(buf)
    mv = memoryview(buf)
    secret = os.urandom(32)
    seal = Integrity(secret)
    header = bytes(72)
    fns = {
        "memcpy": lambda: np.copyto(dst, buf),
        "xxh3 checksum": lambda: xxhash.xxh3_64_intdigest(mv),
        "integrity tag": lambda: seal.seal(bytes(16), header, mv),
        "keyed BLAKE2b": lambda: hashlib.blake2b(mv, key=secret).digest(),
        "HMAC-SHA256": lambda: hmac.new(secret, mv, "sha256").digest(),
    }
    out = {}
    for name, fn in fns.items():
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / GiB
    return out


def tier_round(tier, keys, objs, check: bool) -> dict[str, float]:
    tier.delete(keys)
    t0 = time.perf_counter()
    stored = tier.put(keys, objs)
    t1 = time.perf_counter()
    got = tier.get(keys)
    t2 = time.perf_counter()
    try:
        if stored != len(keys) or any(g is None for g in got):
            raise RuntimeError(f"tier round failed: stored {stored}, "
                               f"hits {sum(g is not None for g in got)} / {len(keys)}; "
                               f"{tier.stats()}")
        if check:
            for g, o in zip(got, objs):
                if not torch.equal(g.tensor.view(torch.uint8), o.tensor.view(torch.uint8)):
                    raise RuntimeError("tier returned different bytes")
    finally:
        for g in got:
            if g is not None:
                g.release()
    total = sum(o.nbytes for o in objs)
    return {"put": total / (t1 - t0) / GiB, "get": total / (t2 - t1) / GiB}


def bench_size(label: str, shape: tuple[int, ...], url: str, port: int, batch: int,
               rounds: int, connections: int, bench_clients: int) -> dict:
    nbytes = 2 * shape[0] * shape[1] * shape[2] * shape[3]
    pool = MemoryPool(2 * batch * nbytes + 64 * MiB, pin_memory="false")
    cfg = CacheConfig(remote_url=url, remote_timeout=60, remote_key_prefix="bench",
                      remote_options={"connections": connections})
    tier = create_backend(url, cfg, pool)
    tagged = create_backend(url, cfg.replace(integrity_secret=os.urandom(32).hex(),
                                             remote_key_prefix="bench-tagged"), pool)
    keys = [os.urandom(16) for _ in range(batch)]
    objs = pool.allocate_many(shape, torch.bfloat16, batch, shape[2])
    for o in objs:
        o.tensor.view(torch.uint8).random_()
    values = []
    for k, o in zip(keys, objs):
        payload = tensor_bytes(o.tensor)
        values.append(encode_header(k, o.shape, o.dtype, o.num_tokens, payload) + bytes(payload))
    client = redis.Redis(port=port, socket_timeout=600)
    n_bench = max(8 * bench_clients, 2 * batch)
    print(f"\n{label}: shape {list(shape)} bf16 = {nbytes / MiB:.1f} MiB per value; "
          f"tier batch {batch} chunks, {connections} connections; {rounds} rounds\n"
          f"  peer: {' '.join(_bench_cmd(port, 'set,get', nbytes, n_bench, bench_clients))}\n"
          f"   and: {' '.join(_bench_cmd(port, 'set', nbytes, n_bench, bench_clients, *FRESH))}")
    series: dict[str, list[dict[str, float]]] = {"bench": [], "tier": [], "py": [],
                                                 "tagged": []}
    try:
        for r in range(rounds + 1):  # round 0 warms the server's memory and the connections
            b = redis_benchmark(port, nbytes, n_bench, bench_clients)
            t = tier_round(tier, keys, objs, check=(r == 0))
            p = redis_py(client, values, nbytes)
            g = tier_round(tagged, keys, objs, check=(r == 0))
            if r:
                series["bench"].append(b)
                series["tier"].append(t)
                series["py"].append(p)
                series["tagged"].append(g)
    finally:
        tier.delete(keys)
        tagged.delete(keys)
        client.delete(*[f"bench:py:{i}" for i in range(len(values))])
        client.close()
        tier.close()
        tagged.close()
        for o in objs:
            o.release()
        pool.close()
    out: dict = {"label": label, "shape": list(shape), "value_bytes": nbytes, "batch": batch,
                 "connections": connections}
    fresh = statistics.median(b["put_fresh"] for b in series["bench"])
    print(f"  {'GiB/s (median)':34s} {'put':>6s} {'get':>6s} | ratio: {'put':>5s} {'get':>5s}"
          f" {'put/1key':>8s}   (median of per-round ratios; put vs fresh-key SET)")
    print(f"  {'redis-benchmark -r, fresh keys':34s} {fresh:6.2f} {'-':>6s} |")
    out["bench_fresh_put"] = fresh
    for name, key in ((f"redis-benchmark -c{bench_clients}, one key", "bench"),
                      ("lmc redis tier", "tier"), ("redis-py, 1 connection", "py")):
        res = {op: statistics.median(s[op] for s in series[key]) for op in ("put", "get")}
        for op, ref in (("put", "put_fresh"), ("get", "get"), ("put_1key", "put")):
            rs = [s[op.split("_")[0]] / b[ref] for s, b in zip(series[key], series["bench"])]
            res[f"{op}_ratio"] = statistics.median(rs)
            res[f"{op}_ratio_min"], res[f"{op}_ratio_max"] = min(rs), max(rs)
        out[key] = res
        print(f"  {name:34s} {res['put']:6.2f} {res['get']:6.2f} | {res['put_ratio']:12.2f} "
              f"{res['get_ratio']:5.2f} {res['put_1key_ratio']:8.2f}")
    res = {op: statistics.median(s[op] for s in series["tagged"]) for op in ("put", "get")}
    for op in ("put", "get"):
        res[f"{op}_vs_plain"] = statistics.median(
            g[op] / t[op] for g, t in zip(series["tagged"], series["tier"]))
    out["tagged"] = res
    print(f"  {'lmc redis tier, integrity tags':34s} {res['put']:6.2f} {res['get']:6.2f} | "
          f"vs the plain tier: put {res['put_vs_plain']:.2f}, get {res['get_vs_plain']:.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, 2 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--batch-mib", type=int, default=None,
                    help="bytes per tier call (a prompt's chunks), in MiB (default 256; "
                         "64 with --quick)")
    ap.add_argument("--connections", type=int, default=4, help="the tier's connections option")
    ap.add_argument("--bench-clients", type=int, default=4, help="redis-benchmark -c")
    ap.add_argument("--url", help="use this server instead of starting one")
    ap.add_argument("--bench-port", type=int, help="its port, for redis-benchmark")
    ap.add_argument("--sizes", help="comma-separated value sizes to run, of "
                                    f"{', '.join(k.split()[0] for k in SHAPES)} (default: all; "
                                    "--quick: the first two)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None:
        print("redis-server / redis-benchmark not found (apt-get install redis-server)")
        return 1
    rounds = args.rounds or (2 if args.quick else 5)
    shapes = QUICK if args.quick else SHAPES
    if args.sizes:
        want = args.sizes.split(",")
        unknown = [w for w in want if w not in {k.split()[0] for k in SHAPES}]
        if unknown:
            ap.error(f"--sizes: unknown {', '.join(unknown)}")
        shapes = {k: v for k, v in SHAPES.items() if k.split()[0] in want}
    batch_bytes = (args.batch_mib or (64 if args.quick else 256)) * MiB
    server = None
    if args.url:
        url, port = args.url, args.bench_port or 6379
    else:
        server = Server()
        url, port = f"redis://127.0.0.1:{server.port}/0", server.port
    print(f"Redis tier benchmark: redis-server {redis_version(port)} on 127.0.0.1:{port}, "
          f"redis-py {redis.__version__}, torch {torch.__version__}")
    rates = hash_rates(8 * MiB, 2) if args.quick else hash_rates()
    print("single thread, 64 MiB buffer, GiB/s: "
          + ", ".join(f"{k} {v:.2f}" for k, v in rates.items()))
    results: list = [{"hash_rates": rates}]
    try:
        for label, shape in shapes.items():
            nbytes = 2 * shape[0] * shape[1] * shape[2] * shape[3]
            batch = max(2, batch_bytes // nbytes)
            results.append(bench_size(label, shape, url, port, batch, rounds,
                                      args.connections, args.bench_clients))
    finally:
        if server is not None:
            server.stop()
    print("\nTarget: lmc tier >= 0.70 of redis-benchmark for put and get "
          "(LMCache 0.5.6 here: 0.47 / 0.52 GiB/s against 2.8 / 2.3).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def redis_version(port: int) -> str:
    with redis.Redis(port=port) as c:
        return str(c.info("server").get("redis_version", "?"))


if __name__ == "__main__":
    sys.exit(main())
