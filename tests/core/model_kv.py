"""Shared pieces of the model-based tests: a KV that is a pure function of the token prefix, a
paged cache whose every write can be checked, prompts with shared prefixes, and the model of
what the engine may answer.

Why a pure function: a causal model's KV for token ``i`` depends only on ``tokens[:i+1]``. If
the test's KV has the same property, any process or thread can verify any hit bit for bit
without a side channel, and a hit that returns other bytes (another chunk's, a freed block's,
a neighbour's) can never match by accident.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, settings

from lmc import CacheConfig, CacheEngine, KVSpec

CHUNK = 16          # tokens per chunk
BLOCK = 4           # tokens per paged block
NUM_BLOCKS = 64     # 256 slots
NUM_SLOTS = NUM_BLOCKS * BLOCK
HEAD_DIM = 16


@dataclass(frozen=True)
class Geometry:
    """A tiny model's KV shape (float32, vllm_flash)."""

    layers: int
    heads: int

    @property
    def row(self) -> int:
        """int32 words per token per plane."""
        return self.heads * HEAD_DIM


# "unit": 2 layers * 2 planes * 16 words * 4 B = 256 B a token, so a full chunk is exactly one
# 4 KiB pool unit and every tail rounds up to one: batches of equal blocks carved from single
# holes (the pattern that broke batch views). "mixed": 768 B a token, a full chunk is three
# units and a tail one to three: mixed block sizes fragment the pool.
GEOMETRIES = {"unit": Geometry(2, 1), "mixed": Geometry(3, 2)}
BASE_LEN = 6 * CHUNK
NUM_BASES = 5
VOCAB = 5000
_M64 = (1 << 64) - 1

LONG = os.environ.get("LMC_HYPOTHESIS_PROFILE") == "long"
# Shrinking a long engine sequence can take hypothesis minutes; CI fails fast on the example
# as found (its steps, seed and reproduce blob are printed), longer runs shrink it.
SHRINK = LONG or os.environ.get("LMC_HYPOTHESIS_SHRINK") == "1"


def scaled(examples: int, steps: int, **kw: Any) -> settings:
    """Per-test settings: modest under the default profile, 20x the examples under ``long``."""
    phases = [p for p in Phase if SHRINK or p not in (Phase.shrink, Phase.explain)]
    return settings(max_examples=examples * (20 if LONG else 1),
                    stateful_step_count=steps * (2 if LONG else 1), deadline=None,
                    print_blob=True, phases=phases,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                    **kw)


# ------------------------------------------------------------------ the KV function
def _mix(x: int) -> int:
    """splitmix64 finaliser: every input bit reaches every output bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def prefix_hashes(tokens: Sequence[int]) -> np.ndarray:
    """``h[i]`` depends on ``tokens[:i+1]`` only (a chained hash)."""
    out = np.empty(len(tokens), dtype=np.uint64)
    h = 0x243F6A8885A308D3
    for i, t in enumerate(tokens):
        h = _mix((h ^ (int(t) + 0x9E3779B97F4A7C15)) & _M64)
        out[i] = h
    return out


def token_rows(tokens: Sequence[int], geom: Geometry) -> np.ndarray:
    """The KV of every token as int32 words ``[layers, 2, n, ROW]``: arbitrary bit patterns
    (NaN payloads included once viewed as float32), a function of the token's prefix."""
    h = prefix_hashes(tokens)
    words = geom.layers * 2 * geom.row
    with np.errstate(over="ignore"):
        x = h[:, None] + np.arange(1, words + 1, dtype=np.uint64)[None, :] * np.uint64(
            0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    w = (x & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(
        w.reshape(len(tokens), geom.layers, 2, geom.row).transpose(1, 2, 0, 3))


# ------------------------------------------------------------------ prompts
def base_tokens(base: int) -> list[int]:
    r = random.Random(1000 + base)
    return [r.randrange(VOCAB) for _ in range(BASE_LEN)]


BASES = [base_tokens(b) for b in range(NUM_BASES)]


def prompt(base: int, length: int, diverge: int | None = None) -> list[int]:
    """A prefix of one of a few bases (so prompts share prefixes), optionally with one token
    changed at ``diverge`` (every chunk from there on gets a different key)."""
    toks = list(BASES[base % NUM_BASES][:length])
    if diverge is not None and diverge < length:
        toks[diverge] = (toks[diverge] + 1 + base) % VOCAB
    return toks


def fresh_prompt(serial: int, length: int) -> list[int]:
    """A prompt sharing no chunk with any other (eviction pressure)."""
    r = random.Random(-1 - serial)
    return [VOCAB + r.randrange(VOCAB) for _ in range(length)]


def slots_for(n: int, seed: int, blockwise: bool, holes: int = 0) -> torch.Tensor:
    """``n`` distinct slots: whole shuffled blocks (an engine's block table) or scattered
    tokens; ``holes`` of them set to -1 (unmapped: the engine must skip them)."""
    rng = np.random.default_rng(seed)
    if blockwise:
        blocks = rng.permutation(NUM_BLOCKS)[: -(-n // BLOCK)]
        s = (blocks[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[:n]
    else:
        s = rng.permutation(NUM_SLOTS)[:n]
    s = s.astype(np.int64)
    if holes:  # may unmap a whole short chunk: it must then move nothing
        s[rng.choice(n, size=min(holes, n), replace=False)] = -1
    return torch.from_numpy(s)


def mask_for(n: int, masked_chunks: int) -> torch.Tensor | None:
    if not masked_chunks:
        return None
    m = torch.ones(n, dtype=torch.bool)
    m[: masked_chunks * CHUNK] = False
    return m


def chunk_ends(n: int) -> list[int]:
    return [min(e, n) for e in range(CHUNK, n + CHUNK, CHUNK)]


# ------------------------------------------------------------------ the engine's cache
class PagedCache:
    """A vllm_flash KV cache ``[layers][2, blocks, block, heads, dim]`` over one tensor, so a
    test can write a prompt's KV at given slots and compare the whole cache in one go."""

    def __init__(self, geom: Geometry, seed: int = 0) -> None:
        self.geom = geom
        g = torch.Generator().manual_seed(seed)
        self.words = torch.randint(-(1 << 31), 1 << 31, (geom.layers, 2, NUM_SLOTS, geom.row),
                                   dtype=torch.int64, generator=g).to(torch.int32)
        flat = self.words.view(torch.float32)
        self.caches = [flat[li].view(2, NUM_BLOCKS, BLOCK, geom.heads, HEAD_DIM)
                       for li in range(geom.layers)]

    def spec(self) -> KVSpec:
        return KVSpec.from_tensors(self.caches, "vllm_flash")

    def write(self, tokens: Sequence[int], slots: torch.Tensor) -> None:
        """Put the prompt's KV where the engine computed it (skipping unmapped slots)."""
        rows = torch.from_numpy(token_rows(tokens, self.geom))
        keep = slots >= 0
        self.words[:, :, slots[keep]] = rows[:, :, keep]

    def snapshot(self) -> torch.Tensor:
        return self.words.clone()

    def check_retrieved(self, before: torch.Tensor, tokens: Sequence[int], slots: torch.Tensor,
                        start: int, end: int, what: str) -> None:
        """Tokens ``[start, end)`` hold exactly their KV at their (mapped) slots and every
        other word of the cache is as it was ``before``."""
        want = before.clone()
        s = slots[start:end]
        keep = s >= 0
        if end > start:
            rows = torch.from_numpy(token_rows(tokens[:end], self.geom)[:, :, start:end])
            want[:, :, s[keep]] = rows[:, :, keep]
        diff = want != self.words
        if bool(diff.any()):
            bad_slots = sorted(set(torch.nonzero(diff)[:, 2].tolist()))
            asked = set(s[keep].tolist())
            wrong = [x for x in bad_slots if x in asked]
            stray = [x for x in bad_slots if x not in asked]
            raise AssertionError(
                f"{what}: wrong KV at {len(wrong)} retrieved slot(s) {wrong[:8]}, "
                f"{len(stray)} slot(s) written that were not asked {stray[:8]} "
                f"(tokens {start}..{end} of {len(tokens)})")


# ------------------------------------------------------------------ engine factories
@dataclass
class Backend:
    """How to build an engine: its extra config and what may excuse a miss.

    ``persistent``: a lower tier keeps chunks across engine restarts, and a chunk once stored
    must keep being found unless the engine reports a write it dropped or a tier error.
    """

    name: str
    extra: Callable[[str], dict[str, Any]] = lambda workdir: {}
    persistent: bool = False
    cleanup: list[str] = field(default_factory=list)


# Counters of the disk, Redis (redis.py) and lmc:// (server.py) tiers that mean "this value
# may now be missing": a failed or refused call, a value not stored, a bad value deleted.
REMOTE_LOSSES = ("checksum_failures", "evictions", "corrupt", "failures", "skipped_open",
                 "not_stored", "expired_in_queue", "rejected_keys", "alloc_failures")


def excuses(stats: dict[str, Any], persistent: bool) -> float:
    """Counters that can legitimately turn a stored chunk into a miss.

    L1 alone: evictions and chunks skipped for lack of room. With a persistent lower tier a
    chunk evicted from L1 is still below it, so only what a tier reports as a lost write or
    read counts: dropped writes, errors, checksum/tag failures, lower-tier evictions, and the
    remote tiers' own counters for calls that failed, timed out in their queue or were turned
    away by an open breaker (a loaded machine makes those happen; each is a reported miss)."""
    total = 0.0
    for k, v in stats.items():
        if not isinstance(v, (int, float)):
            continue
        tier_part = k.split(".", 1)[-1]
        if persistent:
            if "." in k and not k.startswith("cpu.") and (
                    tier_part.startswith(("dropped_", "errors_"))
                    or tier_part in REMOTE_LOSSES):
                total += v
        elif k in ("cpu.evictions",) or k.startswith("skipped_pool_full"):
            total += v
    return total


def make_engine(cache: PagedCache, pool_bytes: int, extra: dict[str, Any], tenant: str,
                max_pins: int = 4096) -> CacheEngine:
    """A small engine; pins never time out (the tests' steps are not timed)."""
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size=pool_bytes, pin_memory="false",
                      tenant=tenant, debug_leaks=True, max_pinned_chunks=max_pins,
                      pin_timeout=3600, **extra)
    return CacheEngine(cfg, cache.spec(), model_id="model-kv-test")


def tempdir(tag: str) -> str:
    return tempfile.mkdtemp(prefix=f"lmc-model-{tag}-")


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
