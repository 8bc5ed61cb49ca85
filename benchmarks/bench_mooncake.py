"""The ``mooncake://`` tier against Mooncake's own calls and a raw socket, in one run on loopback.

Set-up: a ``mooncake_master`` and a holder process contributing the segment (a storage node);
this process is a pure client (``segment: 0``), so every byte crosses a TCP connection
between two processes, as between two nodes. For each chunk size (a KV chunk of a real model
shape, bf16), every round moves the same ``--total`` bytes, back to back:

  * **mooncake**: the library alone -- ``batch_put_from`` / ``batch_get_into`` of the chunks'
    bytes from and into registered pool memory, one call for the batch (the fastest calls
    measured in ``shared/MOONCAKE.md``): the limit;
  * **lmc tier**: ``put`` / ``get`` of the same chunks through the tier (head with the
    payload checksum written with each value; heads read, checked, objects allocated, payloads
    read into them and verified);
  * **lmc tier, keyed**: the same with ``integrity_secret`` (a keyed tag over every value);
  * **socket**: a Python ``sendall`` of each chunk to a sink process (a 1-byte ack each) and
    ``recv_into`` pool memory of each chunk from it: what a plain loopback socket moves.

Keys are removed before every put, so every put transfers. Ratios are medians over rounds of
the per-round ratio (load from other processes cancels). ``--engine`` adds an engine-level
TTFT: the reference engine with ``tiers: [memory, disk, mooncake://...]``, a prompt stored
cold, then served from Mooncake after L1 was emptied and the disk's copies deleted, through
the connector's layer-wise path (the tier answers whole chunks: it declares no layered
reads), against the same prompt's full prefill and its L1 hit.

    python benchmarks/bench_mooncake.py                 # 1 and 8 MiB chunks, 256 MiB, 5 rounds
    python benchmarks/bench_mooncake.py --quick         # 64 MiB, 2 rounds (smoke)
    python benchmarks/bench_mooncake.py --engine        # also the engine TTFT (4k tokens)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lmc.config import CacheConfig  # noqa: E402
from lmc.memory.pool import MemoryObj, MemoryPool  # noqa: E402
from lmc.storage.tier import create_backend  # noqa: E402
from tests.storage.backends.mooncake.mooncake_cluster import (  # noqa: E402
    MooncakeMaster,
    Peer,
    quiet_env,
)

GiB, MiB = 2**30, 2**20
SHAPES = {  # [layers, K|V, tokens, kv_heads * head_dim], bf16
    "1MiB (Llama-3.2-1B, 32 tok)": (16, 2, 32, 512),
    "8MiB (Llama-3.1-8B, 32 tok)": (32, 2, 32, 1024),
}
SECRET = "bench-mooncake-secret-0123456789"

SINK = r"""
import socket, sys
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
c, _ = srv.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(64 << 20); mv = memoryview(buf)
while True:
    op = c.recv(9)
    if not op:
        break
    n = int.from_bytes(op[1:], "little")
    if op[:1] == b"P":
        got = 0
        while got < n:
            got += c.recv_into(mv[got:n])
        c.sendall(b"k")
    else:
        c.sendall(mv[:n])
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GiB


class Timed:
    """Wall and CPU time of one operation (this process: the library's threads included)."""

    def __init__(self, out: dict[str, float], name: str, nbytes: int) -> None:
        self.out, self.name, self.nbytes = out, name, nbytes

    def __enter__(self) -> Timed:
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.out[self.name] = rate(self.nbytes, time.perf_counter() - self.t0)
        self.out[f"{self.name}_cpu"] = (time.process_time() - self.c0) / (self.nbytes / GiB)


class Sink:
    """A loopback socket peer: stores what is sent (acking each), sends back on request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, objs: list[MemoryObj]) -> None:
        for o in objs:
            self.sock.sendall(b"P" + o.nbytes.to_bytes(8, "little"))
            self.sock.sendall(o.byte_view())
            self.sock.recv(1)

    def get(self, objs: list[MemoryObj]) -> None:
        for o in objs:
            self.sock.sendall(b"G" + o.nbytes.to_bytes(8, "little"))
            mv, got = o.byte_view(), 0
            while got < o.nbytes:
                got += self.sock.recv_into(mv[got:])

    def stop(self) -> None:
        self.sock.close()
        self.proc.wait(timeout=10)


def raw_client(master: MooncakeMaster, pool: MemoryPool) -> Any:
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master.address)
    assert rc == 0, f"setup: {rc}"
    assert s.register_buffer(pool.buffer.data_ptr(), pool.buffer.numel()) == 0
    return s


def one_round(shape: tuple[int, ...], n: int, pool: MemoryPool, raw: Any, tiers: dict,
              sink: Sink, rnd: int) -> dict[str, float]:
    """GiB/s of every row for ``n`` chunks of ``shape`` (one round)."""
    src = pool.allocate_many(shape, torch.bfloat16, n, shape[2])
    dst = pool.allocate_many(shape, torch.bfloat16, n, shape[2])
    assert len(src) == len(dst) == n, "pool too small"
    for i, o in enumerate(src):
        o.tensor.view(torch.uint8).reshape(-1)[:4096].fill_((i + rnd) % 251)
    total = n * src[0].nbytes
    base = pool.buffer.data_ptr()
    out: dict[str, float] = {}
    def library() -> None:
        keys = [f"bench/{rnd}/{i}" for i in range(n)]
        raw.batch_remove(keys, True)
        with Timed(out, "mooncake_put", total):
            codes = raw.batch_put_from(keys, [base + o.offset for o in src], [o.nbytes] * n)
        assert all(c == 0 for c in codes), f"put codes {set(codes)}"
        with Timed(out, "mooncake_get", total):
            codes = raw.batch_get_into(keys, [base + o.offset for o in dst], [o.nbytes] * n)
        assert all(c == src[0].nbytes for c in codes), f"get codes {set(codes)}"
        assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(src, dst))
        raw.batch_remove(keys, True)

    def through(name: str, tier: Any) -> None:
        tkeys = [f"{name}-{rnd}-{i}".encode().ljust(16, b"_")[:16] for i in range(n)]
        tier.delete(tkeys)
        with Timed(out, f"{name}_put", total):
            stored = tier.put(tkeys, src)
        assert stored == n
        with Timed(out, f"{name}_get", total):
            got = tier.get(tkeys)
        assert all(g is not None for g in got), f"{name}: misses"
        assert all(torch.equal(a.tensor, g.tensor) for a, g in zip(src, got))
        for g in got:
            g.release()
        tier.delete(tkeys)

    def plain_socket() -> None:
        with Timed(out, "socket_put", total):
            sink.put(src)
        with Timed(out, "socket_get", total):
            sink.get(dst)

    rows = [library, *[lambda nm=nm, t=t: through(nm, t) for nm, t in tiers.items()],
            plain_socket]
    try:
        for i in range(len(rows)):  # each round starts with another row: order effects cancel
            rows[(rnd + i) % len(rows)]()
    finally:
        for o in src + dst:
            o.release()
    return out


def bench_sizes(args: argparse.Namespace, master: MooncakeMaster) -> dict[str, Any]:
    import lmc.storage.backends.mooncake  # noqa: F401  (registers mooncake://)
    pool = MemoryPool(3 * args.total + 64 * MiB, pin_memory="false", prefault="now")
    raw = raw_client(master, pool)
    tiers = {}
    for name, extra in (("lmc", {}), ("lmc_keyed", {"integrity_secret": SECRET})):
        cfg = CacheConfig(remote_timeout=30.0, remote_key_prefix=f"b{name}", **extra)
        tiers[name] = create_backend(master.url, cfg, pool, segment=0)
    sink = Sink()
    results: dict[str, Any] = {}
    try:
        for label, shape in SHAPES.items():
            nbytes = 2 * shape[0] * shape[1] * shape[2] * shape[3]
            n = max(1, args.total // nbytes)
            log(f"{label}: {n} chunks, warm-up ...")
            for w in range(3):  # the holder's segment is mapped lazily: fault it in first
                one_round(shape, n, pool, raw, tiers, sink, -1 - w)
            rounds = []
            for r in range(args.rounds):
                rounds.append(one_round(shape, n, pool, raw, tiers, sink, r + 1))
                log(f"  round {r + 1}: " + " ".join(f"{k}={v:.2f}" for k, v in rounds[-1].items()
                                                    if not k.endswith("_cpu")))
            results[label] = rounds
    finally:
        sink.stop()
        for t in tiers.values():
            t.close()
        raw.close()
    return results


def report_sizes(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nGiB/s over loopback TCP between two processes, {args.total // MiB} MiB a round, "
          f"median (min-max) of {args.rounds} rounds; ratio = median of per-round ratios\n")
    print("| chunk | op | mooncake | lmc tier | lmc / mooncake (target >= 0.9) | keyed | "
          "keyed / mooncake | socket | lmc / socket | CPU s/GiB mooncake / lmc / keyed |"
          "\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, rounds in results.items():
        for op in ("put", "get"):
            def cell(row: str, op: str = op, rounds: list = rounds) -> str:
                xs = [r[f"{row}_{op}"] for r in rounds]
                return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

            def cpu(row: str, op: str = op, rounds: list = rounds) -> str:
                return f"{statistics.median(r[f'{row}_{op}_cpu'] for r in rounds):.2f}"

            def ratio(a: str, b: str, op: str = op, rounds: list = rounds) -> str:
                return f"{statistics.median(r[f'{a}_{op}'] / r[f'{b}_{op}'] for r in rounds):.2f}"

            print(f"| {label} | {op} | {cell('mooncake')} | {cell('lmc')} | "
                  f"**{ratio('lmc', 'mooncake')}** | {cell('lmc_keyed')} | "
                  f"{ratio('lmc_keyed', 'mooncake')} | {cell('socket')} | "
                  f"{ratio('lmc', 'socket')} | {cpu('mooncake')} / {cpu('lmc')} / "
                  f"{cpu('lmc_keyed')} |")


def bench_engine(args: argparse.Namespace, master: MooncakeMaster) -> dict[str, Any]:
    """TTFT of a prompt: full prefill, L1 hit, and a hit from Mooncake (L1 emptied, the disk's
    copies deleted), medians over ``--reps``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_ttft as B  # the reference engine's helpers: engine, ttft, tokens, model_dir

    import lmc.storage.backends.mooncake  # noqa: F401
    from lmc.connectors.reference import LMCReferenceConnector

    n, layers = args.tokens, 8
    path = B.model_dir(1024, layers, 8, n + 64)
    prompt = B.tokens(7, n)
    kv_bytes = n * 2 * layers * 8 * 64 * 4  # fp32 K and V, 8 KV heads of 64
    disk = tempfile.mkdtemp(prefix="lmc-bench-mc-disk-")
    out: dict[str, Any] = {"tokens": n, "kv_mib": kv_bytes / MiB, "layers": layers}
    try:
        plain = B.engine(path, n)
        B.ttft(plain, prompt[:64])
        B.ttft(plain, prompt)
        out["prefill_s"] = statistics.median(B.ttft(plain, prompt)[0] for _ in range(args.reps))
        plain.close()
        cfg = CacheConfig(chunk_size=256, local_cpu_size=max(256 << 20, 3 * kv_bytes),
                          load_policy="load_all",
                          tiers=["memory", {"backend": "disk", "path": disk,
                                            "capacity": 4 * kv_bytes},
                                 {"backend": master.url, "segment": 0,
                                                    "remote_timeout": 30.0}])
        conn = LMCReferenceConnector(cfg, model_dir=path)
        llm = B.engine(path, n, conn)
        B.ttft(llm, prompt[:64])
        B.ttft(llm, prompt)  # cold: prefill + saves to disk and Mooncake
        storage = conn.engine.storage
        assert storage.flush(timeout=300), "write-behind did not drain"
        keys = conn.engine.db.keys(prompt)
        out["l1_hit_s"] = statistics.median(B.ttft(llm, prompt)[0] for _ in range(args.reps))
        disk_tier, mc = storage.lower[0], storage.lower[1]
        assert all(mc.contains(keys)), "the prompt is not in Mooncake"
        rows = []
        for _ in range(args.reps):
            storage.l1.clear()
            disk_tier.delete(keys)
            before = B.worker_stat(conn, f"tokens_from_{mc.name}")
            t, cached = B.ttft(llm, prompt)
            got = B.worker_stat(conn, f"tokens_from_{mc.name}") - before
            assert cached == n - 1 and got == n - 1, (cached, got)
            rows.append(t)
            B.settle_promotions(conn, keys)
            assert storage.flush(timeout=300)
        out["mooncake_hit_s"] = statistics.median(rows)
        out["mooncake_hit_reps"] = rows
        llm.close()
    finally:
        import shutil
        shutil.rmtree(disk, ignore_errors=True)
    return out


def report_engine(r: dict[str, Any]) -> None:
    print(f"\nReference engine TTFT, {r['tokens']}-token prompt ({r['kv_mib']:.0f} MiB of KV, "
          f"{r['layers']} layers), medians\n")
    print("| full prefill | L1 hit | Mooncake hit (L1 emptied, disk copies deleted) | "
          "Mooncake hit / prefill |\n|---:|---:|---:|---:|")
    print(f"| {r['prefill_s'] * 1e3:.1f} ms | {r['l1_hit_s'] * 1e3:.1f} ms | "
          f"{r['mooncake_hit_s'] * 1e3:.1f} ms | {r['mooncake_hit_s'] / r['prefill_s']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", type=lambda s: int(s) * MiB, default=256 * MiB,
                    help="MiB moved per row per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 rounds")
    ap.add_argument("--engine", action="store_true", help="also the engine-level TTFT")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length for --engine")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each TTFT figure")
    args = ap.parse_args(argv)
    if args.quick:
        args.total, args.rounds = 64 * MiB, 2
    os.environ.update({k: v for k, v in quiet_env().items() if k.startswith("MC_")})
    workdir = Path(tempfile.mkdtemp(prefix="lmc-bench-mooncake-"))
    master = MooncakeMaster(workdir).start()
    holder = Peer("holder", master, segment=3 * args.total + 256 * MiB)
    try:
        load = os.getloadavg()[0]
        results = bench_sizes(args, master)
        engine = bench_engine(args, master) if args.engine else None
        print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
              f"{load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        report_sizes(results, args)
        if engine is not None:
            report_engine(engine)
    finally:
        holder.stop()
        master.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
