"""lmc's per-chunk calls on the engine's thread create no GC-tracked objects (issue 36): a
``with lock:`` builds a tracked tuple for each ``__exit__`` call, and a pinned lookup of a
long prompt made one per chunk. Counted with the collector's own trigger: at a gen-0
threshold of 1, every tracked allocation starts a collection (any thread's: each pool's
pre-fault thread has ended before counting)."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable

import torch

from lmc import CacheConfig, CacheEngine, KVSpec
from lmc.memory.pool import MemoryPool


def tracked_allocations(fn: Callable[[], object]) -> int:
    fn()  # warm: free lists and caches filled
    starts = [0]

    def counted(phase: str, info: dict) -> None:
        starts[0] += phase == "start"

    old = gc.get_threshold()
    gc.collect()
    gc.callbacks.append(counted)
    gc.set_threshold(1, 1_000_000, 1_000_000)
    try:
        fn()
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(counted)
    return starts[0]


def test_acquire_and_release_allocate_nothing_tracked() -> None:
    pool = MemoryPool(4 << 20, False)
    pool.wait_ready()  # its pre-fault thread allocates too: done before counting
    obj = pool.allocate((4, 4), torch.float32)
    assert obj is not None

    def both() -> None:
        obj.acquire()
        obj.release()

    assert tracked_allocations(both) == 0
    obj.release()
    pool.close()


def test_pinned_lookup_allocations_do_not_grow_with_the_prompt() -> None:
    """Re-pinning (a scheduler asking again) releases the last pins in one call."""
    counts = []
    for n in (2048, 16384):
        kv = [torch.zeros(2, n // 16 + 8, 16, 1, 8) for _ in range(2)]
        spec = KVSpec.from_tensors(kv, "vllm_flash", block_size=16)
        eng = CacheEngine(CacheConfig(chunk_size=256, local_cpu_size="32MiB"), spec, "m")
        eng.pool.wait_ready()
        toks = torch.randint(2, 100_000, (n,), generator=torch.Generator().manual_seed(1))
        eng.store(toks, kv, torch.arange(n))
        counts.append(tracked_allocations(functools.partial(eng.lookup, toks, pin=True)))
        eng.unpin(toks)
        eng.close()
    # 8 chunks, then 64: the same few objects per call, none per chunk
    assert counts[1] - counts[0] < 8, counts
