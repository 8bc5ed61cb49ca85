"""P2P chunk pull vs raw NIXL READ of the same bytes, between the same two processes.

An owner process exports ``--chunks`` chunks from its pool through the P2P tier (advertised in
a real ``lmc server`` directory); this process is the reader. Each repetition times, in
alternating order:

* **p2p get**: ``P2PBackend.get(keys)`` as an engine calls it on a local miss -- locate in the
  directory, allocate destinations in the pool, one NIXL READ per owner, the version-slot READ
  and check;
* **raw READ**: one NIXL READ of the same spans into the same pool, descriptor lists built
  beforehand (the transport's own speed: the limit).

The first pull is checked bit for bit against the owner's data. NIXL agents crash at
interpreter exit (NIXL 1.5.1), so both processes end with ``os._exit`` after teardown.

    python benchmarks/bench_p2p.py [--chunks 32 --chunk-mib 8 --reps 7] [--json FILE]

``--pd`` measures prefill/decode instead, on the reference engine (the model of
``bench_ttft.py``; 8k tokens): the TTFT of a decode instance that pulls the prompt's KV from a
prefill instance over NIXL, against a single instance's full prefill and against loading the
KV from the daemon (stored there by another instance).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from lmc.config import CacheConfig  # noqa: E402
from lmc.memory.pool import MemoryPool  # noqa: E402
from lmc.storage.backends.p2p.backend import P2PBackend  # noqa: E402

LAYERS, TOKENS = 16, 256


def _shape(chunk_mib: int) -> tuple[int, int, int, int]:
    width = chunk_mib * 2**20 // (LAYERS * 2 * TOKENS * 2)
    return (LAYERS, 2, TOKENS, width)


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()


def _fill(t: torch.Tensor, i: int) -> None:
    g = torch.Generator().manual_seed(1000 + i)
    t.view(torch.uint8).view(-1).copy_(
        torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g))


def _tier(url: str, pool: MemoryPool, name: str) -> P2PBackend:
    cfg = CacheConfig(remote_timeout=30.0, pin_memory="false")
    return P2PBackend(url, config=cfg, pool=pool, agent_name=name, export_bytes=pool.size)


def owner(url: str, chunks: int, chunk_mib: int) -> None:
    pool = MemoryPool((chunks + 1) * chunk_mib * 2**20, pin_memory="false")
    tier = _tier(url, pool, f"bench-owner-{os.getpid()}")
    objs = pool.allocate_many(_shape(chunk_mib), torch.bfloat16, chunks, TOKENS)
    for i, o in enumerate(objs):
        _fill(o.tensor, i)
    tier.put([_key(i) for i in range(chunks)], objs)
    pool.release_many(objs)
    print(json.dumps({"ready": tier.stats()["exports"]}), flush=True)
    sys.stdin.read()  # until the reader closes our stdin
    tier.close()
    os._exit(0)


@contextlib.contextmanager
def _daemon(workdir: Path, size: str = "16MiB"):
    ready = workdir / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "lmc.server", "--port", "0", "--size",
                             size, "--ready-file", str(ready), "--log-level", "WARNING",
                             "--max-payload", "256MiB"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        end = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("lmc server did not start")
            time.sleep(0.05)
        yield f"p2p+lmc://127.0.0.1:{json.loads(ready.read_text())['port']}"
    finally:
        proc.terminate()
        proc.wait(30)


def _raw_read(tier: P2PBackend, info, pairs) -> None:
    """One NIXL READ of ``pairs``, descriptors prebuilt: initialize, post, poll, release."""
    a = tier.agent.agent
    local, remote = pairs
    h = a.initialize_xfer("READ", local, remote, info.agent)
    state = a.transfer(h)
    while state not in ("DONE", "ERR"):
        state = a.check_xfer_state(h)
    a.release_xfer_handle(h)
    if state != "DONE":
        raise RuntimeError("raw READ failed")


def measure(url: str, chunks: int, chunk_mib: int, reps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
    proc = subprocess.Popen([sys.executable, __file__, "--owner", url, "--chunks", str(chunks),
                             "--chunk-mib", str(chunk_mib)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] == chunks, ready
        pool = MemoryPool((chunks + 1) * chunk_mib * 2**20, pin_memory="false")
        tier = _tier(url, pool, f"bench-reader-{os.getpid()}")
        keys = [_key(i) for i in range(chunks)]
        nbytes = chunks * chunk_mib * 2**20
        got = tier.get(keys)  # warm-up: connection, peer metadata; checked bit for bit
        want = torch.empty(_shape(chunk_mib), dtype=torch.bfloat16)
        for i, o in enumerate(got):
            assert o is not None, f"chunk {i} missing"
            _fill(want, i)
            assert torch.equal(o.tensor.view(torch.int16), want.view(torch.int16)), i
        owner_name = tier._locate(keys[:1], fresh=True)[0][0]
        info = tier.agent.knows(owner_name)
        recs = [g[1] for g in tier._locate(keys, fresh=True)]
        a = tier.agent.agent
        base = pool.buffer.data_ptr()
        pairs = (a.get_xfer_descs([(base + o.offset, o.nbytes, 0) for o in got], "DRAM"),
                 a.get_xfer_descs([(info.pool_base + r.offset, r.nbytes, 0) for r in recs],
                                  "DRAM"))
        pool.release_many(got)
        out: dict[str, list[float]] = {"p2p": [], "raw": []}
        for rep in range(reps):
            for which in (("p2p", "raw") if rep % 2 == 0 else ("raw", "p2p")):
                if which == "p2p":
                    tier._located.clear()  # a fresh lookup: the directory is asked
                    t0 = time.perf_counter()
                    objs = tier.get(keys)
                    dt = time.perf_counter() - t0
                    assert all(o is not None for o in objs)
                    pool.release_many(objs)
                else:
                    objs = pool.allocate_many(_shape(chunk_mib), torch.bfloat16, chunks,
                                              TOKENS)
                    # the same destinations as the warm-up pull (the pool hands them out again)
                    t0 = time.perf_counter()
                    _raw_read(tier, info, pairs)
                    dt = time.perf_counter() - t0
                    pool.release_many(objs)
                out[which].append(nbytes / dt / 2**30)
        stats = tier.stats()
        tier.close()
        return {"samples": out, "stale": stats["stale"], "failures": stats["transfer_failures"]}
    finally:
        proc.stdin.close()
        proc.wait(30)


# ------------------------------------------------------------ prefill/decode TTFT
def _pd_model(a: argparse.Namespace):
    from benchmarks.bench_ttft import model_dir, tokens
    path = model_dir(a.hidden, a.layers, a.kv_heads, max(8192, a.tokens + 64))
    return path, [0] + tokens(1, a.tokens - 1), a.tokens * a.layers * 2 * a.kv_heads * 64 * 4


def _pd_config(a: argparse.Namespace, url: str, kv_bytes: int) -> CacheConfig:
    return CacheConfig(chunk_size=256, local_cpu_size=max(256 << 20, 3 * kv_bytes),
                       remote_url=url, remote_timeout=60.0, pin_memory="false",
                       load_policy="load_all")  # the pull is what is timed: load it whole


def pd_prefill(a: argparse.Namespace) -> None:
    """The prefill instance: prefill the prompt (max_tokens=1), keep serving its exports."""
    from benchmarks.bench_ttft import engine
    from lmc.connectors.reference import LMCReferenceConnector
    path, prompt, kv_bytes = _pd_model(a)
    conn = LMCReferenceConnector(_pd_config(a, a.pd_prefill, kv_bytes), model_dir=path,
                                 kv_role="kv_producer", engine_id="prefill")
    llm = engine(path, a.tokens, conn)
    out = llm.generate([prompt], max_tokens=1, kv_transfer_params={"do_remote_decode": True})[0]
    conn.engine.flush(300)
    print(json.dumps({"prefill_s": out.ttft_s, "params": out.kv_transfer_params}), flush=True)
    sys.stdin.read()
    llm.close()
    os._exit(0)


def pd(a: argparse.Namespace) -> dict:
    """TTFT of the decode instance's first token: alone (full prefill), pulling the prompt's
    KV from a prefill instance over NIXL, and loading it from the daemon."""
    from benchmarks.bench_ttft import engine, log, tokens, ttft
    from lmc.connectors.reference import LMCReferenceConnector
    path, prompt, kv_bytes = _pd_model(a)
    n, res = a.tokens, {"tokens": a.tokens, "kv_mib": kv_bytes / 2**20}
    with tempfile.TemporaryDirectory() as tmp, \
            _daemon(Path(tmp), str(max(64 << 20, 2 * kv_bytes))) as url:
        plain = url.replace("p2p+", "", 1)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
        # baselines first: a NIXL agent (the prefill instance's, ours) spins a core
        llm = engine(path, n)
        log("single instance: warm-up prefill, then the measured one ...")
        ttft(llm, [0] + tokens(2, n - 1))
        res["full_prefill_s"], _ = ttft(llm, prompt)
        llm.close()
        log("through the daemon: one instance stores, a fresh one loads ...")
        conn = LMCReferenceConnector(_pd_config(a, plain + "?ns=pd-daemon", kv_bytes),
                                     model_dir=path)
        llm = engine(path, n, conn)
        ttft(llm, prompt)
        conn.engine.flush(300)
        llm.close()
        conn = LMCReferenceConnector(_pd_config(a, plain + "?ns=pd-daemon", kv_bytes),
                                     model_dir=path)
        llm = engine(path, n, conn)
        res["daemon_s"], res["daemon_cached"] = ttft(llm, prompt)
        llm.close()
        prefill = subprocess.Popen(
            [sys.executable, __file__, "--pd-prefill", url, "--tokens", str(n), "--hidden",
             str(a.hidden), "--layers", str(a.layers), "--kv-heads", str(a.kv_heads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        try:
            log("prefill instance: prefill ...")
            answer = json.loads(prefill.stdout.readline())
            res["prefill_instance_s"] = answer["prefill_s"]
            log("decode instance: pull from the prefill instance over NIXL ...")
            conn = LMCReferenceConnector(_pd_config(a, url, kv_bytes), model_dir=path)
            llm = engine(path, n, conn)
            res["p2p_s"], res["p2p_cached"] = ttft(llm, prompt)
            res["p2p_hits"] = conn.engine.storage.tiers[-1].stats()["hits"]
            llm.close()
            log("decode instance as kv_consumer: the producer's kv_transfer_params, an "
                "asynchronous pull ...")
            conn = LMCReferenceConnector(_pd_config(a, url, kv_bytes), model_dir=path,
                                         kv_role="kv_consumer")
            llm = engine(path, n, conn)
            out = llm.generate([prompt], max_tokens=1,
                               kv_transfer_params=answer["params"])[0]
            res["async_s"], res["async_cached"] = out.ttft_s, out.num_cached_tokens
            res["async_loads"] = conn.worker.stats.async_loads
            res["async_wait_s"] = conn.worker.stats.async_wait_seconds
            res["async_load_s"] = conn.worker.stats.async_load_seconds
            llm.close()
        finally:
            prefill.stdin.close()
            prefill.wait(120)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="8 chunks of 4 MiB, 3 repetitions")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--owner", help=argparse.SUPPRESS)  # the owner process's role
    ap.add_argument("--pd", action="store_true",
                    help="prefill/decode TTFT on the reference engine instead")
    ap.add_argument("--tokens", type=int, default=8192, help="--pd: prompt length")
    ap.add_argument("--hidden", type=int, default=1024, help="--pd: model width")
    ap.add_argument("--layers", type=int, default=8, help="--pd: model depth")
    ap.add_argument("--kv-heads", type=int, default=8, help="--pd: KV heads")
    ap.add_argument("--pd-prefill", help=argparse.SUPPRESS)  # the prefill instance's role
    a = ap.parse_args(argv)
    if a.pd_prefill:
        pd_prefill(a)
    if a.pd:
        if a.quick:
            a.tokens, a.hidden, a.layers, a.kv_heads = 4096, 512, 4, 4
        r = pd(a)
        full = r["full_prefill_s"]
        print(f"{r['tokens']} tokens, {r['kv_mib']:.0f} MiB of KV; load "
              f"{os.getloadavg()[0]:.1f}")
        for name, key, cached in (("single instance, full prefill", "full_prefill_s", None),
                                  ("decode instance, P2P pull", "p2p_s", "p2p_cached"),
                                  ("kv_consumer, async P2P pull", "async_s", "async_cached"),
                                  ("decode instance, daemon load", "daemon_s",
                                   "daemon_cached")):
            extra = f"  cached {r[cached]}" if cached else ""
            print(f"{name:32s} TTFT {r[key]:8.3f} s  {full / r[key]:6.1f}x{extra}")
        print(f"  async pull: {r['async_wait_s']:.3f} s waiting for publication, "
              f"{r['async_load_s']:.3f} s fetching and copying, {r['async_loads']} load(s)")
        if a.json:
            Path(a.json).write_text(json.dumps(r, indent=1))
        sys.stdout.flush()
        os._exit(0)
    if a.quick:
        a.chunks, a.chunk_mib, a.reps = 8, 4, 3
    if a.owner:
        owner(a.owner, a.chunks, a.chunk_mib)
    with tempfile.TemporaryDirectory() as tmp, _daemon(Path(tmp)) as url:
        res = measure(url, a.chunks, a.chunk_mib, a.reps)
    s = res["samples"]
    p2p, raw = statistics.median(s["p2p"]), statistics.median(s["raw"])
    ratios = [p / r for p, r in zip(s["p2p"], s["raw"])]
    print(f"{a.chunks} chunks x {a.chunk_mib} MiB per pull, median of {a.reps}; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"p2p get   {p2p:6.2f} GiB/s")
    print(f"raw READ  {raw:6.2f} GiB/s")
    print(f"ratio     {p2p / raw:6.2f}  (per-rep {min(ratios):.2f}..{max(ratios):.2f}; "
          f"target >= 0.8)  stale={res['stale']} failures={res['failures']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"p2p_gibs": p2p, "raw_gibs": raw,
                                            "ratio": p2p / raw, **res}, indent=1))
    sys.stdout.flush()
    os._exit(0)  # NIXL's exit-time crash (see lmc.storage.backends.p2p.agent); everything is closed


if __name__ == "__main__":
    main()
