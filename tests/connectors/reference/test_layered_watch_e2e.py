"""A load read layer by layer that turns out slower than recomputing is cut (issue 36), on
the reference engine with a fresh lmc engine (new ``CacheEngine``, empty L1, nothing
measured) whose prompt sits in a real disk tier read layer by layer behind a real
``rate_limit`` link (``layered``: each chunk's layer handed on once its bytes passed):

* slow from the start: the compute is known only by its floor; the read is cut before
  any chunk is whole;
* slowing down after two of the four layers of every chunk landed fast: those chunks hold
  half their layers when the read is cut, and none of them is counted.

Every time: tokens and logits identical to no cache, the tokens reported cached a whole
number of blocks -- no chunk counted that did not land whole and verify -- and the cut
counted as a stop, not a failure. The links are slow enough (seconds per chunk against
milliseconds, or a prior of 50 tokens/s, of compute) that whether a cut happens never
depends on this machine's load; no test reads a clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmc.connectors.reference import LMCReferenceConnector
from lmc.reference import LLM
from lmc.storage.backends.disk.backend import DiskBackend
from lmc.storage.wrappers import RateLimitTier
from tests.connectors.reference.helpers import BLOCK, assert_same, plain_llm, prompt, run
from tests.deadlines import HANG_S

P = prompt(37, 150)
CS = 32  # a chunk of the tiny model: 32 tokens x 4 layers, 32 KiB a layer


class SlowsAfter(RateLimitTier):
    """A real layered ``rate_limit`` link whose rate drops to ``slow`` once ``fast_bytes``
    have passed it (the relay paces one chunk's layer at a time, in layer order)."""

    def __init__(self, *a, fast_bytes: int, slow: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.fast_bytes, self.slow, self.paced = fast_bytes, slow, 0

    def _pace(self, nbytes: int, t0: float) -> None:
        if self.paced >= self.fast_bytes:
            self.rate = self.slow
        self.paced += nbytes
        super()._pace(nbytes, t0)


def store_on_disk(tiny_dir: Path, path: Path) -> None:
    """Engine A computes ``P`` and writes its chunks to the disk directory, then ends."""
    conn = LMCReferenceConnector({"chunk_size": CS, "local_cpu_size": "32MiB",
                                  "local_disk": str(path), "local_disk_size": "64MiB"},
                                 model_dir=tiny_dir)
    llm = LLM(tiny_dir, kv_connector=conn, num_blocks=128, block_size=BLOCK)
    run(llm, [P])
    assert conn.cache.flush(30)
    llm.close()


def fresh_engine(tiny_dir: Path, path: Path, link, priors=None
                 ) -> tuple[LLM, LMCReferenceConnector]:
    """Engine B: a new process's view -- empty L1, the disk behind ``link``; its lookups hear
    the disk however loaded the host (the load is the subject, not the lookup's deadline)."""

    def tier(config, pool):
        return link(config, pool, DiskBackend(config=config, pool=pool, path=str(path),
                                              size="64MiB"))

    cfg: dict = {"chunk_size": CS, "local_cpu_size": "32MiB", "lookup_min_wait": HANG_S}
    if priors:
        cfg["load_policy_priors"] = priors
    conn = LMCReferenceConnector(cfg, model_dir=tiny_dir, tiers=[tier])
    return LLM(tiny_dir, kv_connector=conn, num_blocks=128, block_size=BLOCK), conn


@pytest.fixture(scope="module")
def want(tiny_dir: Path) -> list:
    return run(plain_llm(tiny_dir), [P])


def worker_stat(conn: LMCReferenceConnector, key: str) -> float:
    return conn.stats()[f"worker.{key}"]


def test_fresh_engine_behind_a_slow_layered_link_cuts_and_recomputes(
        tiny_dir: Path, tmp_path: Path, want: list) -> None:
    store_on_disk(tiny_dir, tmp_path / "d")
    # 64 KiB/s: one chunk's layer (32 KiB) takes 0.5 s, the prompt ~9 s; its compute, ms
    llm, conn = fresh_engine(tiny_dir, tmp_path / "d", lambda c, p, inner: RateLimitTier(
        config=c, pool=p, inner=inner, bytes_per_second=64 << 10, layered=True))
    eng = conn.cache
    assert eng.speeds.prefill.rate() is None and eng.speeds.prefill.floor is not None
    assert eng.lookup(P) == len(P)
    got = run(llm, [P])
    assert_same(got, want)
    assert got[0].num_cached_tokens == 0  # no chunk was whole when the read was cut
    assert worker_stat(conn, "loads_stopped") == 1
    assert worker_stat(conn, "stopped_tokens") == len(P) - 1
    assert worker_stat(conn, "loaded_tokens") == 0
    assert worker_stat(conn, "load_failures") == 0  # a cut is lmc's choice, not a failure
    pool = eng.pool
    llm.close()  # the relay is still pacing: close wakes it and waits for the read
    assert pool.leaks == []


def test_layered_link_slowing_mid_load_counts_no_partly_read_chunk(
        tiny_dir: Path, tmp_path: Path, want: list) -> None:
    store_on_disk(tiny_dir, tmp_path / "d")
    # about two of the four layers of every chunk pass at 256 MiB/s (1 KiB a token a
    # layer), then 16 KiB/s (2 s a chunk's layer); compute taken as 50 tokens/s: the
    # ~18 s left cost more than recomputing (3 s)
    half = (len(P) - 1) * 2 * 1024
    llm, conn = fresh_engine(tiny_dir, tmp_path / "d", lambda c, p, inner: SlowsAfter(
        config=c, pool=p, inner=inner, bytes_per_second=256 << 20, layered=True,
        fast_bytes=half, slow=16 << 10), priors={"prefill": 50})
    link = conn.cache.storage.lower[0]
    got = run(llm, [P])
    assert_same(got, want)
    assert link.paced >= half  # the cut came after half of every chunk had landed
    n = got[0].num_cached_tokens
    assert n % BLOCK == 0 and n % CS == 0  # whole chunks, whole blocks
    assert n < len(P) - 1  # the chunks still arriving were recomputed
    assert worker_stat(conn, "loads_stopped") == 1
    assert worker_stat(conn, "loaded_tokens") == n
    assert worker_stat(conn, "stopped_tokens") == len(P) - 1 - n
    assert worker_stat(conn, "load_failures") == 0
    llm.close()
