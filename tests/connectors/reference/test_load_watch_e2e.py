"""A load that turns out slower than recomputing stops (issue 36), on the reference engine
with a fresh lmc engine (new ``CacheEngine``, empty L1, nothing measured) whose prompt sits
in a real disk tier behind a real ``rate_limit`` link:

* slow from the start: the engine's compute is known only by its floor (the model's
  arithmetic at the measured matmul rate); the load stops in its first piece;
* slowing down mid-load: the link moves the first chunks fast, then crawls; the load keeps
  what it read and stops in the piece the link slowed in.

Every time: tokens and logits identical to no cache, the tokens reported cached a whole
number of blocks, never a chunk the link had not delivered whole, and the stop counted.
The links are slow enough (seconds per chunk against milliseconds of compute) that
whether a stop happens never depends on this machine's load: the rule compares counted
pieces with the compute estimate, and no test reads a clock."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from lmc.connectors.reference import LMCReferenceConnector
from lmc.reference import LLM
from lmc.storage.backends.disk.backend import DiskBackend
from lmc.storage.load_watch import DEPTH
from lmc.storage.wrappers import RateLimitTier
from tests.connectors.reference.helpers import BLOCK, assert_same, plain_llm, prompt, run
from tests.deadlines import HANG_S

P = prompt(36, 150)


class SlowsDown(RateLimitTier):
    """A real ``rate_limit`` link that slows to ``slow`` once it has delivered the first
    ``fast`` chunks of the prompt: a read of a later chunk waits until every read of those
    has returned (a link delivers in order; the watched load has two reads in flight),
    then the link is slow from then on. ``fast_keys`` is set once the engine exists."""

    def __init__(self, *a, fast: int, slow: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.fast = fast
        self.slow = slow
        self.gets = 0
        self.fast_keys: list = []
        self._fast_read = threading.Event()
        self._count = threading.Lock()

    def get(self, keys):
        with self._count:
            self.gets += 1
        fast = self.fast_keys[:self.fast]
        if any(k not in fast for k in keys):
            assert self._fast_read.wait(HANG_S), "the fast chunks were never read"
            self.rate = self.slow
        out = super().get(keys)
        if fast and all(k in fast for k in keys) and keys[-1] == fast[-1]:
            self._fast_read.set()
        return out


def store_on_disk(tiny_dir: Path, path: Path, chunk_size: int) -> None:
    """Engine A computes ``P`` and writes its chunks to the disk directory, then ends."""
    conn = LMCReferenceConnector({"chunk_size": chunk_size, "local_cpu_size": "32MiB",
                                  "local_disk": str(path), "local_disk_size": "64MiB"},
                                 model_dir=tiny_dir)
    llm = LLM(tiny_dir, kv_connector=conn, num_blocks=128, block_size=BLOCK)
    run(llm, [P])
    assert conn.cache.flush(30)
    llm.close()


def fresh_engine(tiny_dir: Path, path: Path, chunk_size: int, link, priors=None,
                 lookup_min_wait: float | None = HANG_S
                 ) -> tuple[LLM, LMCReferenceConnector]:
    """Engine B: a new process's view -- empty L1, the disk behind ``link``. Its lookups
    hear the disk however loaded the host (``lookup_min_wait``; ``None``: the default
    20 ms, for a test of that deadline): the load is the subject."""
    made = []

    def tier(config, pool):
        disk = DiskBackend(config=config, pool=pool, path=str(path), size="64MiB")
        made.append(link(config, pool, disk))
        return made[-1]

    cfg: dict = {"chunk_size": chunk_size, "local_cpu_size": "32MiB"}
    if lookup_min_wait is not None:
        cfg["lookup_min_wait"] = lookup_min_wait
    if priors:
        cfg["load_policy_priors"] = priors
    conn = LMCReferenceConnector(cfg, model_dir=tiny_dir, tiers=[tier])
    llm = LLM(tiny_dir, kv_connector=conn, num_blocks=128, block_size=BLOCK)
    return llm, conn


@pytest.fixture(scope="module")
def want(tiny_dir: Path) -> list:
    return run(plain_llm(tiny_dir), [P])


def worker_stat(conn: LMCReferenceConnector, key: str) -> float:
    return conn.stats()[f"worker.{key}"]


def test_fresh_engine_behind_a_slow_link_stops_and_recomputes(
        tiny_dir: Path, tmp_path: Path, want: list) -> None:
    cs = 32
    store_on_disk(tiny_dir, tmp_path / "d", cs)
    # 64 KiB/s: a chunk of this model (32 tokens, 128 KiB) takes 2 s; its compute, milliseconds
    llm, conn = fresh_engine(tiny_dir, tmp_path / "d", cs, lambda c, p, inner: RateLimitTier(
        config=c, pool=p, inner=inner, bytes_per_second=64 << 10))
    eng = conn.cache
    assert eng.speeds.prefill.rate() is None and eng.speeds.prefill.floor is not None
    assert eng.lookup(P) == len(P)  # every chunk on disk, none in L1
    got = run(llm, [P])
    assert_same(got, want)
    # stopped in its first piece: no chunk was delivered whole before the stop
    assert got[0].num_cached_tokens == 0
    assert worker_stat(conn, "loads_stopped") == 1
    assert worker_stat(conn, "stopped_tokens") == len(P) - 1
    assert worker_stat(conn, "load_failures") == 0  # a stop is lmc's choice, not a failure
    assert worker_stat(conn, "recomputed_after_failure") == 0
    # closed while the abandoned piece is still on the link: the close wakes it and waits
    # for it, so its pool memory is released before the pool closes
    pool = eng.pool
    llm.close()
    assert pool.leaks == []


@pytest.mark.parametrize("cs", [32, 24])  # 24: chunk boundaries inside blocks of 16
def test_link_slowing_mid_load_keeps_whole_chunks_only(tiny_dir: Path, tmp_path: Path,
                                                       want: list, cs: int) -> None:
    store_on_disk(tiny_dir, tmp_path / "d", cs)
    # chunks 0 and 1 at 256 MiB/s, then 32 KiB/s (4 s a chunk); the compute is taken as
    # 50 tokens/s, so a fast chunk (< 1 ms of link) is never waited for as long as
    # recomputing what follows it (> 1.7 s), and a slow one always is
    llm, conn = fresh_engine(tiny_dir, tmp_path / "d", cs, lambda c, p, inner: SlowsDown(
        config=c, pool=p, inner=inner, bytes_per_second=256 << 20, fast=2,
        slow=32 << 10), priors={"prefill": 50})
    link = conn.cache.storage.lower[0]
    link.fast_keys = conn.cache.db.keys(P)
    got = run(llm, [P])
    assert_same(got, want)
    assert worker_stat(conn, "loads_stopped") == 1
    n = got[0].num_cached_tokens
    assert n % BLOCK == 0  # a whole number of blocks
    assert n <= 2 * cs  # nothing the slowed link was still delivering
    assert n == (2 * cs) // BLOCK * BLOCK  # every chunk it delivered whole, to a block
    assert worker_stat(conn, "loaded_tokens") == 2 * cs  # what lmc counts: whole chunks
    assert worker_stat(conn, "stopped_tokens") == len(P) - 1 - 2 * cs
    # chunk 0 alone (the tier's rate unknown), then DEPTH reads in flight, one more once
    # chunk 1 landed; those in flight abandoned once chunk 2 had been waited for as long
    # as recomputing costs, nothing read after them
    chunks = -(-(len(P) - 1) // cs)
    assert link.gets == min(chunks, 2 + DEPTH)
    llm.close()


def test_abandoned_piece_lands_in_l1(tiny_dir: Path, tmp_path: Path, want: list) -> None:
    """The piece in flight at the stop is still read: once it lands its chunks are
    promoted (they verified), so a later request finds them in L1."""
    cs = 32
    store_on_disk(tiny_dir, tmp_path / "d", cs)
    llm, conn = fresh_engine(tiny_dir, tmp_path / "d", cs, lambda c, p, inner: SlowsDown(
        config=c, pool=p, inner=inner, bytes_per_second=256 << 20, fast=1,
        slow=32 << 10), priors={"prefill": 50})
    conn.cache.storage.lower[0].fast_keys = conn.cache.db.keys(P)
    got = run(llm, [P])
    assert_same(got, want)
    assert worker_stat(conn, "loads_stopped") == 1
    eng = conn.cache
    keys = eng.db.keys(P)
    deadline = time.monotonic() + HANG_S  # hang guard: the slowed chunk takes ~4 s
    while eng.storage.l1.prefix_hits(keys[:2]) < 2:
        assert time.monotonic() < deadline, "the abandoned piece never reached L1"
        time.sleep(0.02)
    llm.close()
