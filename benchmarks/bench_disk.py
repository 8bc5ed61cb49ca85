"""Disk tier throughput beside its physical limit, measured in one run on one directory.

Limit: fio (or dd when fio is absent) sequential O_DIRECT I/O in 1 MiB blocks on the same
directory. lmc: a Llama-8B-like chunk (32 layers, 8 KV heads, head 128, bf16, 256 tokens =
32 MiB), through the engine:

* durable store = ``engine.store`` of 2048-token prompts in turn + ``engine.flush()`` (the
  chunks are in files, renamed into place; with ``--fsync`` also fdatasync-ed), i.e. until
  the data is on disk; files are new each time (the previous rep's are deleted first);
* retrieve = ``engine.retrieve`` of the same prompts with L1 emptied (page cache dropped when
  permitted; reads are O_DIRECT anyway): disk -> pool -> KV cache; also with ``prefetch``
  issued for every prompt first, the connector's pattern.

The tier alone (``put``/``get`` on pool objects, no engine) is measured too, and so is the same
store into an engine without a disk tier (the gather alone) and the same retrieve served from
L1 (the scatter alone): on a small, shared machine the engine's copies can be slower than the
disk, and an engine-level figure can then only reach the lower of the two. Repetitions are
interleaved with the limit's (fio write, lmc store, fio read, lmc retrieve, ...) so that noise
on a shared machine hits both; figures are medians, printed as GiB/s and as ratios.

    python benchmarks/bench_disk.py [--dir /tmp/lmc-bench] [--gib 2] [--reps 3] [--fsync]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmc import CacheConfig, CacheEngine, KVSpec  # noqa: E402
from lmc.memory.pool import MemoryPool  # noqa: E402
from lmc.storage.backends.disk.backend import DiskBackend  # noqa: E402

LAYERS, HEADS, DIM, CHUNK = 32, 8, 128, 256
DTYPE = torch.bfloat16
CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * DIM * DTYPE.itemsize  # 32 MiB
GiB = 1 << 30


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------ the limit
def fio(d: Path, rw: str, nbytes: int) -> float:
    """GiB/s of one fio job, psync, 1 MiB blocks, O_DIRECT; a write goes to a new file (as
    lmc's do) and ends with an fsync."""
    if rw == "write":
        (d / "fio.dat").unlink(missing_ok=True)
    cmd = ["fio", "--name=lim", f"--filename={d / 'fio.dat'}", f"--rw={rw}", "--bs=1M",
           f"--size={nbytes}", "--direct=1", "--ioengine=psync", "--numjobs=1",
           "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    job = out["jobs"][0][rw]
    return job["bw_bytes"] / GiB


def dd(d: Path, rw: str, nbytes: int) -> float:
    f = d / "fio.dat"
    n = nbytes >> 20
    if rw == "write":
        f.unlink(missing_ok=True)
    cmd = (["dd", "if=/dev/zero", f"of={f}", "bs=1M",
            f"count={n}", "oflag=direct", "conv=fsync"] if rw == "write" else
           ["dd", f"if={f}", "of=/dev/null", "bs=1M", f"count={n}", "iflag=direct"])
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True)
    return nbytes / GiB / (time.perf_counter() - t0)


# ----------------------------------------------------------------------- lmc
PROMPT_CHUNKS = 8  # 2048-token prompts: 256 MiB of KV each


def make_kv(tokens: int) -> tuple[list[torch.Tensor], KVSpec]:
    """vLLM flash-attn layout, 16-token blocks, random bits (no compressible zeros)."""
    blocks = tokens // 16
    g = torch.Generator().manual_seed(0)
    caches = [torch.randint(-2**15, 2**15, (2, blocks, 16, HEADS, DIM), dtype=torch.int16,
                            generator=g).view(DTYPE) for _ in range(LAYERS)]
    return caches, KVSpec.from_tensors(caches, "vllm_flash")


def prompts(nchunks: int) -> list[list[int]]:
    """Distinct prompts (distinct keys) of PROMPT_CHUNKS chunks each."""
    n = PROMPT_CHUNKS * CHUNK
    return [[p * n + t for t in range(n)] for p in range(max(1, nchunks // PROMPT_CHUNKS))]


def engine(d: Path, spec: KVSpec, nbytes: int, fsync: bool) -> CacheEngine:
    """One engine for the whole run, its pool holding everything: pool pages are touched
    once and stay warm, as a long-running engine's are (first-touch page faults on this VM
    cost more than the disk, and they are not lmc's cost)."""
    # Write queues are capped at half the pool, and the whole run's chunks must fit in the
    # queue: once the gather outran the disk (stores at ~1.0 of a copy), a pool of nbytes
    # dropped chunks at the queue's bound and the run was refused.
    room = 2 * max(nbytes, 2 * PROMPT_CHUNKS * CHUNK_BYTES)
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size=room + 4 * CHUNK_BYTES,
                      local_disk=str(d), local_disk_size=2 * nbytes, disk_fsync=fsync,
                      write_queue_size=nbytes + CHUNK_BYTES)
    eng = CacheEngine(cfg, spec, "bench-llama-8b")
    eng.pool.buffer.zero_()
    return eng


def forget(eng: CacheEngine, ps) -> None:
    """Empty L1 and the disk: the next store writes new files, as a first store does."""
    eng.storage.delete([k for toks in ps for k in eng.db.keys(toks)])


def lmc_store(eng: CacheEngine, caches, ps, slots) -> float:
    """Each prompt stored in turn (the writer overlaps the next gathers), then flush: the
    chunks are in their files (and fdatasync-ed with --fsync)."""
    nbytes = len(ps) * PROMPT_CHUNKS * CHUNK_BYTES
    forget(eng, ps)
    before = eng.stats().get("disk.dropped_queue_full", 0)
    t0 = time.perf_counter()
    for toks in ps:
        eng.store(toks, caches, slots)
    assert eng.flush(600)
    dt = time.perf_counter() - t0
    st = eng.stats()
    assert st["disk.chunks"] == len(ps) * PROMPT_CHUNKS, st
    assert st.get("disk.dropped_queue_full", 0) == before, st
    return nbytes / GiB / dt


def l1_store(eng: CacheEngine, caches, ps, slots) -> float:
    """The same stores into an engine without a disk tier: the gather alone, the ceiling of
    the engine-level figure on a machine where copying is slower than the disk."""
    nbytes = len(ps) * PROMPT_CHUNKS * CHUNK_BYTES
    eng.storage.l1.clear()
    t0 = time.perf_counter()
    for toks in ps:
        eng.store(toks, caches, slots)
    return nbytes / GiB / (time.perf_counter() - t0)


def l1_retrieve(eng: CacheEngine, caches, ps, slots) -> float:
    """The same retrieves served from L1: the scatter alone, the engine-level retrieve's
    other ceiling."""
    nbytes = len(ps) * PROMPT_CHUNKS * CHUNK_BYTES
    t0 = time.perf_counter()
    for toks in ps:
        assert eng.retrieve(toks, caches, slots) == len(toks)
    return nbytes / GiB / (time.perf_counter() - t0)


def lmc_retrieve(eng: CacheEngine, caches, ps, slots, prefetch: bool) -> float:
    """Every prompt retrieved into the KV cache with L1 empty: disk -> pool -> KV.
    ``prefetch``: all prompts are prefetched first (the connector's pattern), so reading
    prompt k+1 overlaps scattering prompt k."""
    nbytes = len(ps) * PROMPT_CHUNKS * CHUNK_BYTES
    eng.storage.l1.clear()
    drop_caches()
    t0 = time.perf_counter()
    futs = [eng.prefetch(toks) for toks in ps] if prefetch else [None] * len(ps)
    for toks, f in zip(ps, futs):
        if f is not None:
            f.result()
        assert eng.retrieve(toks, caches, slots) == len(toks)
    dt = time.perf_counter() - t0
    return nbytes / GiB / dt


class TierOnly:
    """``put`` / ``get`` of pool objects on the tier itself: the engine's share left out."""

    def __init__(self, d: Path, nbytes: int, fsync: bool, threads: int) -> None:
        self.pool = MemoryPool(2 * nbytes + 2 * CHUNK_BYTES, pin_memory=False)
        self.pool.buffer.zero_()
        cfg = CacheConfig(local_disk=str(d), local_disk_size=2 * nbytes, disk_fsync=fsync)
        self.disk = DiskBackend(config=cfg, pool=self.pool, io_threads=threads)
        n = nbytes // CHUNK_BYTES
        self.nbytes = nbytes
        self.objs = self.pool.allocate_many((LAYERS, 2, CHUNK, HEADS * DIM), DTYPE, n, CHUNK)
        for o in self.objs:
            o.tensor.view(torch.int16).random_()
        self.keys = [i.to_bytes(16, "little") for i in range(n)]

    def run(self) -> tuple[float, float]:
        self.disk.delete(self.keys)
        t0 = time.perf_counter()
        assert self.disk.put(self.keys, self.objs) == len(self.keys)
        w = self.nbytes / GiB / (time.perf_counter() - t0)
        drop_caches()
        t0 = time.perf_counter()
        got = self.disk.get(self.keys)
        r = self.nbytes / GiB / (time.perf_counter() - t0)
        assert all(o is not None for o in got)
        for o in got:
            o.release()
        return w, r


def set_layers(layers: int) -> None:
    """A smaller chunk for smoke runs (``--layers``): every size here derives from it."""
    global LAYERS, CHUNK_BYTES
    LAYERS = layers
    CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * DIM * DTYPE.itemsize


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="directory on the disk to measure (default: a new temp dir)")
    ap.add_argument("--gib", type=float, default=2.0, help="data per measurement")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fsync", action="store_true", help="disk_fsync: fdatasync every value")
    ap.add_argument("--threads", type=int, default=4, help="I/O threads of the tier-only run")
    ap.add_argument("--layers", type=int, default=LAYERS,
                    help="layers of the chunk shape (32: a 32 MiB Llama-8B chunk)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2-layer chunks (2 MiB), 16 MiB per measurement, 1 rep")
    ap.add_argument("--json", help="also write every repetition's figures to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.gib, args.reps = 2, 1 / 64, 1
    set_layers(args.layers)
    root = Path(args.dir or tempfile.mkdtemp(prefix="lmc-bench-disk-"))
    root.mkdir(parents=True, exist_ok=True)
    nchunks = max(1, int(args.gib * GiB) // CHUNK_BYTES // PROMPT_CHUNKS) * PROMPT_CHUNKS
    nbytes = nchunks * CHUNK_BYTES
    tool = "fio" if shutil.which("fio") else "dd"
    limit = fio if tool == "fio" else dd
    caches, spec = make_kv(PROMPT_CHUNKS * CHUNK)
    ps = prompts(nchunks)
    slots = torch.arange(PROMPT_CHUNKS * CHUNK)
    print(f"disk tier vs {tool} O_DIRECT 1 MiB sequential on {root}: {nchunks} chunks of "
          f"{CHUNK_BYTES >> 20} MiB ({nbytes / GiB:.2f} GiB) per measurement, "
          f"{args.reps} reps, fsync={'on' if args.fsync else 'off'}, "
          f"drop_caches={'yes' if drop_caches() else 'no (O_DIRECT reads)'}")
    eng = engine(root / "lmc", spec, nbytes, args.fsync)
    l1 = CacheEngine(CacheConfig(chunk_size=CHUNK, local_cpu_size=nbytes + 4 * CHUNK_BYTES),
                     spec, "bench-llama-8b")
    l1.pool.buffer.zero_()
    l1_store(l1, caches, ps, slots)
    tier = TierOnly(root / "tier", nbytes, args.fsync, args.threads)
    lmc_store(eng, caches, ps, slots)  # warm-up: pool pages, KV pages, transfer plans
    lmc_retrieve(eng, caches, ps, slots, False)
    tier.run()
    keys = ("lim_w", "lmc_w", "l1_w", "tier_w", "lim_r", "lmc_r", "lmc_rp", "l1_r", "tier_r")
    res: dict[str, list[float]] = {k: [] for k in keys}
    for rep in range(args.reps):
        res["lim_w"].append(limit(root, "write", nbytes))
        res["lmc_w"].append(lmc_store(eng, caches, ps, slots))
        res["l1_w"].append(l1_store(l1, caches, ps, slots))
        drop_caches()
        res["lim_r"].append(limit(root, "read", nbytes))
        res["lmc_r"].append(lmc_retrieve(eng, caches, ps, slots, False))
        res["lmc_rp"].append(lmc_retrieve(eng, caches, ps, slots, True))
        res["l1_r"].append(l1_retrieve(l1, caches, ps, slots))
        tw, tr = tier.run()
        res["tier_w"].append(tw)
        res["tier_r"].append(tr)
        print(f"  rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in res.items()))
    eng.close()
    l1.close()
    tier.disk.close()
    (root / "fio.dat").unlink(missing_ok=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"tool": tool, "fsync": args.fsync, "chunk_mib": CHUNK_BYTES / 2**20,
             "gib": nbytes / GiB, "reps": res, "median": med}, indent=1))
    print(f"{'':28s}{'GiB/s':>8s}{'vs ' + tool:>10s}")
    print(f"{tool + ' write (limit)':28s}{med['lim_w']:8.2f}")
    print(f"{'lmc durable store (engine)':28s}{med['lmc_w']:8.2f}{med['lmc_w'] / med['lim_w']:9.0%}")
    print(f"{'lmc tier put':28s}{med['tier_w']:8.2f}{med['tier_w'] / med['lim_w']:9.0%}")
    print(f"{'(L1-only store: the gather)':28s}{med['l1_w']:8.2f}"
          f"{med['l1_w'] / med['lim_w']:9.0%}   engine store / min(gather, {tool}): "
          f"{med['lmc_w'] / min(med['l1_w'], med['lim_w']):.0%}")
    print(f"{tool + ' read (limit)':28s}{med['lim_r']:8.2f}")
    print(f"{'lmc retrieve (engine)':28s}{med['lmc_r']:8.2f}{med['lmc_r'] / med['lim_r']:9.0%}")
    print(f"{'lmc prefetch+retrieve':28s}{med['lmc_rp']:8.2f}"
          f"{med['lmc_rp'] / med['lim_r']:9.0%}")
    print(f"{'lmc tier get':28s}{med['tier_r']:8.2f}{med['tier_r'] / med['lim_r']:9.0%}")
    print(f"{'(L1-hit retrieve: scatter)':28s}{med['l1_r']:8.2f}"
          f"{med['l1_r'] / med['lim_r']:9.0%}   prefetch+retrieve / min(scatter, {tool}): "
          f"{med['lmc_rp'] / min(med['l1_r'], med['lim_r']):.0%}")
    print("target >= 80% of each; LMCache 0.5.6 here: store 0.94, retrieve 0.66 GiB/s "
          "(fio 1.47 / 1.36)")


if __name__ == "__main__":
    main()
