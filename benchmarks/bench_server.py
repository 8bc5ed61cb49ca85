"""Cache-server throughput: put/get GiB/s through ``lmc server`` over loopback TCP and the
Unix socket, against redis-benchmark (SET/GET, same value size, same client count) and the
Redis tier through redis-py, all measured in one run and printed as ratios.

    python benchmarks/bench_server.py                  # 1 MiB values, 256 MiB per direction
    python benchmarks/bench_server.py --quick          # smaller, for smoke runs
    python benchmarks/bench_server.py --value 4MiB --clients 4

Every daemon and redis-server is started here on loopback (ephemeral ports, persistence
off) and stopped by pid. The lmc figures go through the real client tier
(``lmc/storage/backends/server/backend.py``): values are sent from and received into a memory pool,
checksums computed on put and verified on both ends, ``--clients`` engine threads each with
its own tier (like redis-benchmark's ``-c``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lmc.config import CacheConfig, parse_size  # noqa: E402
from lmc.memory.pool import MemoryPool  # noqa: E402
from lmc.storage.tier import create_backend  # noqa: E402

GiB = 2**30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ servers
@contextlib.contextmanager
def lmc_daemon(size: int, workdir: Path):
    ready = workdir / "ready.json"
    sock_path = workdir / "lmc.sock"
    cmd = [sys.executable, "-m", "lmc.server", "--port", "0", "--unix-socket", str(sock_path),
           "--size", str(size), "--ready-file", str(ready), "--log-level", "WARNING",
           "--max-payload", "256MiB"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("lmc server did not start")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        yield f"lmc://127.0.0.1:{info['port']}", f"lmc+unix://{sock_path}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def redis_server():
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def redis_command(port: int, *args: str) -> bytes:
    cmd = b"".join(b"$%d\r\n%s\r\n" % (len(a), a.encode()) for a in args)
    with socket.create_connection(("127.0.0.1", port), 10) as s:
        s.sendall(b"*%d\r\n" % len(args) + cmd)
        return s.recv(1024)


def redis_benchmark(port: int, value: int, clients: int, total: int, distinct: bool = False
                    ) -> dict[str, float]:
    """GiB/s of redis-benchmark SET and GET with ``value``-byte values.

    By default (its usual invocation, and the reference figure) every request names the same
    key, so each SET overwrites one value in place, in memory the allocator hands straight
    back. ``distinct`` (``-r``, SET only; GETs of random keys would mostly miss) stores every
    value under its own key, as a cache does; that is the figure comparable to a tier's put.
    """
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    n = max(clients * 8, total // value)
    extra = ["-t", "set", "-r", "1000000000"] if distinct else ["-t", "set,get"]
    out = subprocess.run([exe, "-h", "127.0.0.1", "-p", str(port), "-d", str(value), "-c",
                          str(clients), "-n", str(n), "-q", *extra],
                         capture_output=True, text=True, timeout=600).stdout
    if distinct:
        redis_command(port, "FLUSHALL")
    res = {}
    for op in ("SET", "GET"):
        m = re.findall(rf"{op}: ([0-9.]+) requests per second", out.replace("\r", "\n"))
        if m:
            res["put" if op == "SET" else "get"] = float(m[-1]) * value / GiB
    return res


# ------------------------------------------------------------------- client
class TierLoad:
    """``clients`` threads, each with its own tier and pool, each moving ``total / clients``
    bytes per run in calls of ``batch`` values (distinct keys, fixed for every run)."""

    def __init__(self, url: str, value: int, clients: int, total: int, batch: int,
                 connections: int) -> None:
        self.batch = batch
        per_client = max(batch, total // value // clients)
        tokens = 64
        shape = (max(1, value // (2 * tokens * 1024 * 2)), 2, tokens, 1024)  # a bf16 chunk
        self.nbytes = shape[0] * shape[1] * shape[2] * shape[3] * 2
        self.ctx = []
        for c in range(clients):
            cfg = CacheConfig(local_cpu_size=2 * self.nbytes * per_client + (16 << 20),
                              pin_memory="false", remote_timeout=30.0)
            pool = MemoryPool(cfg.local_cpu_size, pin_memory="false")
            pool.buffer.fill_(0)  # fault the pages in now, not inside the first timed run
            tier = create_backend(url, cfg, pool, connections=connections)
            gen = torch.Generator().manual_seed(c)
            objs = []
            for _ in range(per_client):
                o = pool.allocate(shape, torch.bfloat16, tokens)
                o.tensor.view(torch.int16).copy_(torch.randint(
                    -2**15, 2**15 - 1, shape, dtype=torch.int16, generator=gen))
                objs.append(o)
            keys = [c.to_bytes(2, "little") + i.to_bytes(4, "little") + b"b" * 10
                    for i in range(per_client)]
            self.ctx.append((tier, objs, keys))
        self.bytes = clients * per_client * self.nbytes
        self.round = 0

    def _fresh_keys(self) -> None:
        """New keys for each put round: content-addressed tiers skip keys they already hold,
        which would measure a lookup, not a transfer."""
        self.round += 1
        tag = self.round.to_bytes(4, "little")
        for _, _, keys in self.ctx:
            for i, k in enumerate(keys):
                keys[i] = k[:6] + tag + k[10:]

    def _work(self, op: str, tier, objs, keys, barrier, bad: list[str]) -> None:
        barrier.wait()
        b = self.batch
        for i in range(0, len(keys), b):
            if op == "put":
                if tier.put(keys[i:i + b], objs[i:i + b]) != len(keys[i:i + b]):
                    bad.append("put incomplete")
                continue
            for g in tier.get(keys[i:i + b]):
                if g is None:
                    bad.append("get miss")
                else:
                    g.release()
        barrier.wait()

    def run(self, op: str) -> float:
        """GiB/s of one run of ``op`` (put or get) by all clients at once."""
        if op == "put":
            self._fresh_keys()
        barrier = threading.Barrier(len(self.ctx) + 1)
        bad: list[str] = []
        threads = [threading.Thread(target=self._work, args=(op, *c, barrier, bad))
                   for c in self.ctx]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        barrier.wait()
        dt = time.perf_counter() - t0
        for t in threads:
            t.join()
        if bad:
            raise RuntimeError(f"{op}: {len(bad)} failures ({bad[0]}); first client's tier: "
                               f"{self.ctx[0][0].stats()}")
        return self.bytes / GiB / dt

    def close(self) -> None:
        for tier, objs, _ in self.ctx:
            for o in objs:
                o.release()
            tier.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--value", default="1MiB", help="value size (redis-benchmark -d)")
    ap.add_argument("--clients", type=int, default=4, help="client threads (redis -c)")
    ap.add_argument("--total", default="256MiB", help="bytes moved per direction per rep")
    ap.add_argument("--batch", type=int, default=16, help="values per tier call")
    ap.add_argument("--connections", type=int, default=1, help="connections per tier (the backend option)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--daemon-size", default=None,
                    help="the daemon's pool (default: twice --total, at least 1 GiB)")
    a = ap.parse_args(argv)
    value, total = parse_size(a.value, "--value"), parse_size(a.total, "--total")
    if a.quick:
        total, a.reps = min(total, 128 << 20), 1
    torch.set_num_threads(1)
    samples: dict[str, dict[str, list[float]]] = {}

    def add(name: str, res: dict[str, float]) -> None:
        for k, v in res.items():
            samples.setdefault(name, {}).setdefault(k, []).append(v)

    with tempfile.TemporaryDirectory() as tmp, redis_server() as rport, \
            lmc_daemon(parse_size(a.daemon_size, "--daemon-size") if a.daemon_size
                       else max(2 * total, 1 << 30), Path(tmp)) as (tcp, unix):
        loads = {"lmc server, TCP": TierLoad(tcp + "?ns=bench-tcp", value, a.clients, total,
                                             a.batch, a.connections),
                 "lmc server, Unix": TierLoad(unix + "?ns=bench-unix", value, a.clients,
                                              total, a.batch, a.connections)}
        if rport is not None:
            try:
                import lmc.storage.backends.redis.backend  # noqa: F401
                loads["Redis tier (redis-py)"] = TierLoad(
                    f"redis://127.0.0.1:{rport}/0", value, a.clients, total, a.batch,
                    a.connections)
            except ImportError as e:
                print(f"(Redis tier not measured: {e})")
        for load in loads.values():  # warm up: connections, server memory, code paths
            load.run("put")
            load.run("get")
        for rep in range(a.reps):  # interleaved, so that noise hits every row alike
            if rport is not None:
                add("redis-benchmark", redis_benchmark(rport, value, a.clients, total))
                add("redis-benchmark -r", redis_benchmark(rport, value, a.clients, total,
                                                          distinct=True))
            for name, load in loads.items():
                add(name, {"put": load.run("put"), "get": load.run("get")})
            print(f"rep {rep + 1}/{a.reps} done", file=sys.stderr)
        for load in loads.values():
            load.close()
    rows = {name: {k: statistics.median(v) for k, v in d.items()}
            for name, d in samples.items()}
    ref = rows.get("redis-benchmark") or {}
    print(f"\nvalue {value / 2**20:g} MiB, {a.clients} clients, {total / 2**20:g} MiB per "
          f"direction per rep, median of {a.reps}")
    print("ratios against redis-benchmark's usual run (one key overwritten in place); "
          "'redis-benchmark -r' stores each SET under its own key, as a cache does")
    print(f"{'':24s} {'put GiB/s':>10s} {'get GiB/s':>10s} {'put/redis':>10s} "
          f"{'get/redis':>10s}")
    for name, r in rows.items():
        ratio = [f"{r[k] / ref[k]:10.2f}" if ref.get(k) and k in r else f"{'-':>10s}"
                 for k in ("put", "get")]
        cells = [f"{r[k]:10.2f}" if k in r else f"{'-':>10s}" for k in ("put", "get")]
        print(f"{name:24s} {' '.join(cells)} {' '.join(ratio)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"value": value, "clients": a.clients,
                                            "rows": rows, "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
