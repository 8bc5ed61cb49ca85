"""What the model identity costs at start-up: a cold digest of every weight byte, and a warm
start that reads none, beside the limits measured in the same run.

A checkpoint of ``--gib`` GiB of random bytes in ``--files`` weight files (plus a config.json)
is written to ``--dir`` (deleted at the end). lmc's digest cache lives in a private temporary
folder, so the first identity is cold. Figures:

* cold, weights in the page cache (a start right after the engine loaded them): the identity
  beside a plain read of the same files with the same threads (``pread`` into a bounded buffer,
  no hashing), beside memcpy and beside xxh3_128 on one thread in memory;
* cold, weights on disk (page cache dropped for the files with ``posix_fadvise(DONTNEED)``
  after an fsync): the identity beside the same plain read from disk;
* warm: the identity again, with its digests cached: its time and the bytes it read
  (``rchar``), which must be far below the checkpoint.

Each cold figure is the median of ``--reps`` repetitions, interleaved with its limit's.

    python benchmarks/bench_model_identity.py [--gib 4] [--files 1] [--reps 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmc.connectors.core import digest_cache, weight_digest  # noqa: E402
from lmc.connectors.core.digest_cache import DigestCache  # noqa: E402
from lmc.connectors.core.model_id import model_identity  # noqa: E402

GB = 1e9
PIECE = 64 << 20


def write_checkpoint(root: Path, total: int, files: int) -> list[Path]:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama", "hidden_size": 4096}\n')
    rng = np.random.default_rng(0)
    paths = []
    for i in range(files):
        path = root / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        left = total // files
        with open(path, "wb") as f:
            while left:
                n = min(PIECE, left)
                f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
                left -= n
            f.flush()
            os.fsync(f.fileno())
        paths.append(path)
    return paths


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(paths: list[Path], threads: int) -> float:
    """Seconds to read the files as the digest does (segments on ``threads`` threads, one
    bounded buffer each), without hashing: the read limit."""
    def segment(path: Path, off: int, n: int) -> None:
        buf = bytearray(weight_digest.BLOCK)
        view = memoryview(buf)
        fd = os.open(path, os.O_RDONLY)
        try:
            end = off + n
            while off < end:
                off += os.preadv(fd, [view[: min(len(buf), end - off)]], off)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        jobs = [pool.submit(segment, p, off, min(weight_digest.SEGMENT, p.stat().st_size - off))
                for p in paths for off in range(0, p.stat().st_size, weight_digest.SEGMENT)]
        for j in jobs:
            j.result()
    return time.perf_counter() - t0


def memcpy_rate(nbytes: int = 256 << 20) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return nbytes / best


def xxh3_rate(nbytes: int = 256 << 20) -> float:
    buf = np.ones(nbytes, dtype=np.uint8).tobytes()
    best = min(_timed(lambda: xxhash.xxh3_128(buf).digest()) for _ in range(5))
    return nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cold_identity(root: Path, cache_dir: Path) -> tuple[float, str]:
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(mode=0o700)
    t0 = time.perf_counter()
    ident = model_identity(root, cache=DigestCache(cache_dir))
    return time.perf_counter() - t0, ident


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--files", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    total = int(args.gib * (1 << 30)) // args.files * args.files
    work = Path(tempfile.mkdtemp(prefix="lmc-bench-identity-", dir=args.dir))
    try:
        return run(work, total, args.files, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, total: int, files: int, reps: int) -> int:
    root, cache_dir = work / "ckpt", work / "digests"
    t0 = time.perf_counter()
    paths = write_checkpoint(root, total, files)
    time.sleep(digest_cache.RACY_NS / 1e9 + 0.1)  # files changed this recently are not cached
    threads = weight_digest.threads_for(total)
    load = os.getloadavg()[0]
    print(f"checkpoint: {total / GB:.2f} GB in {files} file(s), written in "
          f"{time.perf_counter() - t0:.1f} s; {threads} hashing threads; load {load:.1f}")
    mem, hashing = memcpy_rate(), xxh3_rate()
    cached: list[tuple[float, float]] = []
    disk: list[tuple[float, float]] = []
    for _ in range(reps):
        plain_read(paths, threads)  # into the page cache
        cached.append((plain_read(paths, threads), cold_identity(root, cache_dir)[0]))
        evict(paths)
        lim = plain_read(paths, threads)
        evict(paths)
        disk.append((lim, cold_identity(root, cache_dir)[0]))
    before = rchar()
    t0 = time.perf_counter()
    warm = model_identity(root, cache=DigestCache(cache_dir))
    warm_s, warm_read = time.perf_counter() - t0, rchar() - before
    assert warm == cold_identity(root, cache_dir)[1]

    def rates(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
        lim = statistics.median(total / a for a, _ in pairs)
        got = statistics.median(total / b for _, b in pairs)
        ratio = statistics.median(a / b for a, b in pairs)
        return got, lim, ratio

    c_got, c_lim, c_ratio = rates(cached)
    d_got, d_lim, d_ratio = rates(disk)
    print(f"\n| figure | lmc | limit (same run) | ratio |\n|---|---|---|---|\n"
          f"| cold identity, weights in page cache | {c_got / GB:.2f} GB/s "
          f"({total / c_got:.2f} s) | plain read, {threads} threads: {c_lim / GB:.2f} GB/s; "
          f"memcpy {mem / GB:.2f} GB/s; xxh3_128 1 thread {hashing / GB:.2f} GB/s | "
          f"{c_ratio:.2f} of the read |\n"
          f"| cold identity, weights on disk | {d_got / GB:.2f} GB/s ({total / d_got:.2f} s) | "
          f"plain read from disk: {d_lim / GB:.2f} GB/s | {d_ratio:.2f} |\n"
          f"| warm identity (digests cached) | {warm_s * 1e3:.1f} ms, {warm_read:,} bytes read | "
          f"checkpoint {total:,} bytes | {warm_read / total:.1e} of it read |")
    print(f"load average after: {os.getloadavg()[0]:.1f} (before {load:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
