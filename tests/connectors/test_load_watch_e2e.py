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

import time
from pathlib import Path

import pytest

from lmc.connectors.reference import LMCReferenceConnector
from lmc.reference import LLM
from lmc.storage.backends.disk.backend import DiskBackend
from lmc.storage.wrappers import RateLimitTier
from tests.connectors.helpers import BLOCK, assert_same, plain_llm, prompt, run

P = prompt(36, 150)


class SlowsDown(RateLimitTier):
    """A real ``rate_limit`` link whose rate drops to ``slow`` after ``fast_gets`` reads."""

    def __init__(self, *a, fast_gets: int, slow: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.fast_gets = fast_gets
        self.slow = slow
        self.gets = 0

    def get(self, keys):
        self.gets += 1
        if self.gets > self.fast_gets:
            self.rate = self.slow
        return super().get(keys)


def store_on_disk(tiny_dir: Path, path: Path, chunk_size: int) -> None:
    """Engine A computes ``P`` and writes its chunks to the disk directory, then ends."""
    conn = LMCReferenceConnector({"chunk_size": chunk_size, "local_cpu_size": "32MiB",
                                  "local_disk": str(path), "local_disk_size": "64MiB"},
                                 model_dir=tiny_dir)
    llm = LLM(tiny_dir, kv_connector=conn, num_blocks=128, block_size=BLOCK)
    run(llm, [P])
    assert conn.cache.flush(30)
    llm.close()


def fresh_engine(tiny_dir: Path, path: Path, chunk_size: int, link, priors=None
                 ) -> tuple[LLM, LMCReferenceConnector]:
    """Engine B: a new process's view -- empty L1, the disk behind ``link``."""
    made = []

    def tier(config, pool):
        disk = DiskBackend(config=config, pool=pool, path=str(path), size="64MiB")
        made.append(link(config, pool, disk))
        return made[-1]

    cfg = {"chunk_size": chunk_size, "local_cpu_size": "32MiB"}
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
    # the first two reads (chunks 0 and 1) at 256 MiB/s, then 64 KiB/s; the compute is
    # taken as 200 tokens/s, so a fast chunk (< 1 ms of link) never looks too slow and a
    # slow one (seconds) always does
    llm, conn = fresh_engine(tiny_dir, tmp_path / "d", cs, lambda c, p, inner: SlowsDown(
        config=c, pool=p, inner=inner, bytes_per_second=256 << 20, fast_gets=2,
        slow=64 << 10), priors={"prefill": 200})
    link = conn.cache.storage.lower[0]
    got = run(llm, [P])
    assert_same(got, want)
    assert worker_stat(conn, "loads_stopped") == 1
    n = got[0].num_cached_tokens
    assert n % BLOCK == 0  # a whole number of blocks
    assert n <= 2 * cs  # nothing the slowed link was still delivering
    assert n == (2 * cs) // BLOCK * BLOCK  # every chunk it delivered whole, to a block
    assert worker_stat(conn, "loaded_tokens") == 2 * cs  # what lmc counts: whole chunks
    assert worker_stat(conn, "stopped_tokens") == len(P) - 1 - 2 * cs
    assert link.gets == 3  # the piece the link slowed in was abandoned, nothing after it
    llm.close()


def test_abandoned_piece_lands_in_l1(tiny_dir: Path, tmp_path: Path, want: list) -> None:
    """The piece in flight at the stop is still read: once it lands its chunks are
    promoted (they verified), so a later request finds them in L1."""
    cs = 32
    store_on_disk(tiny_dir, tmp_path / "d", cs)
    llm, conn = fresh_engine(tiny_dir, tmp_path / "d", cs, lambda c, p, inner: SlowsDown(
        config=c, pool=p, inner=inner, bytes_per_second=256 << 20, fast_gets=1,
        slow=256 << 10), priors={"prefill": 200})
    got = run(llm, [P])
    assert_same(got, want)
    assert worker_stat(conn, "loads_stopped") == 1
    eng = conn.cache
    keys = eng.db.keys(P)
    deadline = time.monotonic() + 60  # hang guard: the slowed chunk takes ~0.25 s
    while eng.storage.l1.prefix_hits(keys[:2]) < 2:
        assert time.monotonic() < deadline, "the abandoned piece never reached L1"
        time.sleep(0.02)
    llm.close()
