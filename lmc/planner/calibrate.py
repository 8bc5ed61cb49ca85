"""``lmc plan --calibrate``: measure what the cost model needs, on this machine.

* **Prefill**: the reference engine alone (no connector) runs one prompt at a time with
  ``max_tokens=1`` at a few lengths, after one unmeasured prefill at the longest (a process's
  first long prefill also pays page faults on fresh temporaries); the median TTFT of a few
  repetitions per length is kept. This is ``benchmarks/bench_ttft.py``'s "full prefill".
* **Tier loads**: lmc's own ``CacheEngine`` over the engine's KV cache stores a prompt's
  chunks, then times ``retrieve`` (lookup, read, scatter into the KV cache: what a hit costs
  the engine) from L1, from the disk tier (L1 emptied before each repetition, so the chunks
  come from disk, O_DIRECT, and are promoted) and, given a Redis or ``lmc://`` URL, from that
  remote tier.

The model is ``--model DIR`` (a Llama-family checkpoint the reference engine loads) or a small
random-weight checkpoint made on first use, which is right for trying the planner and wrong
for sizing a deployment: the profile records which model it measured.
"""

from __future__ import annotations

import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lmc.planner.costmodel import Profile, TierCost, stamp

BLOCK = 16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_model() -> Path:
    """The random-weight checkpoint calibration uses when no ``--model`` is given."""
    from lmc.reference.tiny import cached_checkpoint

    return cached_checkpoint("plan-calibrate-h512-l4-kv4", hidden=512, layers=4, heads=8,
                             kv_heads=4, max_position_embeddings=8192)


def _median_time(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None
                 ) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_prefill(llm: object, lengths: Sequence[int], reps: int, vocab: int
                    ) -> list[tuple[int, float]]:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(n)]

    log(f"prefill: warm-up at {max(lengths)} tokens (not measured)")
    llm.generate([prompt(max(lengths))], max_tokens=1)  # type: ignore[attr-defined]
    out = []
    for n in sorted(lengths):
        ts = [llm.generate([prompt(n)], max_tokens=1)[0].ttft_s  # type: ignore[attr-defined]
              for _ in range(reps)]
        out.append((n, statistics.median(ts)))
        log(f"prefill: {n} tokens {out[-1][1] * 1e3:.1f} ms (median of {reps})")
    return out


def measure_tier(name: str, kv_caches: list[torch.Tensor], spec: object, tokens: list[int],
                 config_overrides: dict, reps: int) -> TierCost:
    """Bandwidth of ``retrieve`` of ``tokens`` from one tier (see the module doc)."""
    from lmc.cache_engine import CacheEngine
    from lmc.config import CacheConfig

    n = len(tokens)
    slots = torch.arange(n, dtype=torch.int64)
    nbytes = spec.chunk_nbytes(1) * n  # type: ignore[attr-defined]
    cfg = CacheConfig(**{"local_cpu_size": max(64 << 20, 3 * nbytes), **config_overrides})
    with CacheEngine(cfg, spec, "lmc-plan-calibrate") as eng:  # type: ignore[arg-type]
        eng.store(tokens, kv_caches, slots)
        if name != "L1":
            if not eng.flush(timeout=120):
                raise RuntimeError(f"calibration: writes to the {name} tier did not finish")
            if eng.storage.l1 is not None and len(eng.storage.tiers) < 2:
                raise RuntimeError(f"calibration: no {name} tier was built")

        def load() -> None:
            got = eng.retrieve(tokens, kv_caches, slots)
            if got != n:
                raise RuntimeError(f"calibration: the {name} tier served {got} of {n} tokens")

        clear = None if name == "L1" else eng.storage.l1.clear
        load()  # warm: transfer plans, file handles, connections
        secs = _median_time(load, reps, before=clear)
    cost = TierCost(bytes_per_s=nbytes / secs)
    log(f"{name}: {nbytes / 2**20:.0f} MiB in {secs * 1e3:.1f} ms = "
        f"{cost.bytes_per_s / 2**30:.2f} GiB/s (median of {reps})")
    return cost


def calibrate(model_dir: str | Path | None = None, *, lengths: Sequence[int] = (256, 1024, 2048,
              4096), reps: int = 3, load_tokens: int = 4096, chunk_size: int = 256,
              disk_dir: str | None = None, remote_url: str | None = None,
              threads: int = 0) -> Profile:
    """Measure and return a :class:`Profile` (the caller saves it)."""
    from lmc.kv_spec import KVSpec
    from lmc.reference import LLM

    if threads:
        torch.set_num_threads(threads)
    path = Path(model_dir) if model_dir else default_model()
    longest = max(max(lengths), load_tokens)
    log(f"calibrating with {path} ({torch.get_num_threads()} torch threads)")
    llm = LLM(path, block_size=BLOCK, max_num_batched_tokens=longest + BLOCK, max_num_seqs=1,
              max_model_len=longest + 2 * BLOCK,
              kv_cache_memory=1 << 62)  # capped by max_model_len's blocks below
    try:
        if llm.max_model_len < longest + 1:
            raise ValueError(f"{path} allows {llm.max_model_len} tokens; calibrate with "
                             f"shorter --lengths (longest asked: {longest})")
        vocab = int(llm.config.vocab_size)
        points = measure_prefill(llm, lengths, reps, vocab)
        kv = list(llm.kv_caches)
        spec = KVSpec.from_tensors(kv, "vllm_flash", block_size=BLOCK)
        rng = random.Random(1)
        toks = [rng.randrange(2, vocab) for _ in range(load_tokens)]
        tiers = {"L1": measure_tier("L1", kv, spec, toks, {"chunk_size": chunk_size}, reps)}
        tmp = tempfile.mkdtemp(prefix="lmc-plan-disk-", dir=disk_dir)
        try:
            tiers["disk"] = measure_tier(
                "disk", kv, spec, toks, {"chunk_size": chunk_size, "local_disk": tmp,
                                         "local_disk_size": 4 * spec.chunk_nbytes(load_tokens)},
                reps)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if remote_url:
            tiers["remote"] = measure_tier(
                "remote", kv, spec, toks, {"chunk_size": chunk_size, "remote_url": remote_url},
                reps)
        bpt = spec.chunk_nbytes(chunk_size) // chunk_size
    finally:
        llm.close()
    prof = Profile(model=str(path), kv_bytes_per_token=bpt, chunk_size=chunk_size,
                   prefill_points=points, tiers=tiers, created=stamp(),
                   host=socket.gethostname(),
                   notes={"torch_threads": torch.get_num_threads(), "reps": reps,
                          "load_tokens": load_tokens})
    log(f"prefill fit: c0={prof.fit[0] * 1e3:.2f} ms, {prof.fit[1] * 1e6:.2f} us/token, "
        f"{prof.fit[2] * 1e9:.4f} ns/token^2; worst error on the points "
        f"{prof.fit_error() * 100:.1f}%")
    return prof
