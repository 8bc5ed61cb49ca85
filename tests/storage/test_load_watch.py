"""The load watch's rule (lmc/storage/load_watch.py) on counted pieces, and its read against
a real disk tier behind a real ``rate_limit`` link: a prefix of whole chunks, the piece in
flight abandoned to its owner."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.backends.disk.backend import DiskBackend
from lmc.storage.load_watch import LoadWatch, Running, piece_size, read_watched
from lmc.storage.wrappers import RateLimitTier
from tests.deadlines import HANG_S

SHAPE = (2, 2, 32, 64)  # one chunk: 32 KiB of float32


def test_pieces_one_chunk_then_a_sixteenth_of_the_rest() -> None:
    # four in flight: each a sixteenth of what remains, so they stay a quarter of it
    assert piece_size(64, first=True) == 1
    assert [piece_size(n, first=False, depth=4) for n in (63, 32, 16, 7, 1)] == \
        [3, 2, 1, 1, 1]


def test_deadline_is_when_the_rest_would_cost_more_than_recomputing() -> None:
    w = LoadWatch(lambda pos: (100 - pos) * 0.01, margin=0.0, slack_s=0.0, positions=[0, 50])
    # a piece of 1 chunk from chunk 0 with 3 chunks behind it: recomputing costs 1 s, so
    # the piece may take 1/3 s before the 3 after it (at its rate) cost more
    assert math.isclose(w.deadline(10.0, 0, 1, 3), 10.0 + 1.0 / 3)
    assert w.deadline(10.0, 0, 1, 0) == math.inf  # the last piece always finishes
    assert math.isclose(w.limit(1), 0.5)


def _tier(tmp: Path, rate: int) -> tuple[MemoryPool, RateLimitTier, list[bytes]]:
    pool = MemoryPool(8 << 20, False)
    cfg = CacheConfig(chunk_size=32, local_cpu_size=8 << 20)
    disk = DiskBackend(config=cfg, pool=pool, path=str(tmp), size=32 << 20)
    keys = [bytes([i]) * 16 for i in range(6)]
    objs = []
    for i in range(6):
        o = pool.allocate(SHAPE, torch.float32, 32)
        o.tensor.fill_(i)
        objs.append(o)
    assert disk.put(keys, objs) == 6
    for o in objs:
        o.release()
    return pool, RateLimitTier(config=cfg, pool=pool, inner=disk, bytes_per_second=rate), keys


def test_a_slow_link_gives_a_prefix_of_whole_chunks(tmp_path: Path) -> None:
    # 64 KiB/s: a 32 KiB chunk takes 0.5 s; recomputing is taken to cost 1 ms a chunk
    pool, link, keys = _tier(tmp_path, 64 << 10)
    w = LoadWatch(lambda pos: (192 - pos) / 32 * 1e-3, positions=[32 * i for i in range(6)])
    abandoned: list = []
    landed = threading.Event()

    def abandon(ks, objs) -> None:
        abandoned.extend(o for o in objs if o is not None)
        landed.set()

    with ThreadPoolExecutor(2) as ex:
        got = read_watched(link.get, abandon, keys, range(6), w, ex, "disk")
        assert w.stopped_at == 0 and "not done after" in w.reason
        assert got == [None] * 6  # the first chunk was still on the link: nothing counted
        assert landed.wait(60)  # hang guard: the abandoned piece lands, to its owner
    assert [o.tensor[0, 0, 0, 0].item() for o in abandoned] == [0.0]
    for o in abandoned:
        o.release()
    link.close()
    assert pool.outstanding() == []
    pool.close()


def test_an_abandoned_piece_is_running_until_its_owner_has_it(tmp_path: Path) -> None:
    """A stopped read returns before its abandoned piece lands; ``Running`` says when that
    piece has landed, been observed and handed over (what ``StorageManager.wait_reads`` and
    its close wait for). The piece is held on an event, not a clock: it cannot land early."""
    pool, link, keys = _tier(tmp_path, 1 << 30)
    go = threading.Event()

    def held_get(ks):
        assert go.wait(HANG_S), "never released"
        return link.get(ks)

    w = LoadWatch(lambda pos: (192 - pos) / 32 * 1e-3, positions=[32 * i for i in range(6)])
    running = Running()
    abandoned: list = []
    observed: list = []
    with ThreadPoolExecutor(2) as ex:
        got = read_watched(held_get, lambda ks, objs: abandoned.extend(
            o for o in objs if o is not None), keys, range(6), w, ex, "disk",
            observe=lambda n, s: observed.append(n), running=running)
        assert w.stopped_at == 0 and got == [None] * 6
        assert not running.wait_idle(0) and abandoned == [] and observed == []
        go.set()
        assert running.wait_idle(HANG_S)  # hang guard: only the release lets it land
        assert [o.tensor[0, 0, 0, 0].item() for o in abandoned] == [0.0]
        assert observed == [abandoned[0].nbytes]
    for o in abandoned:
        o.release()
    link.close()
    assert pool.outstanding() == []
    pool.close()


def test_an_unknown_compute_reads_everything_in_one_call(tmp_path: Path) -> None:
    pool, link, keys = _tier(tmp_path, 1 << 30)
    w = LoadWatch(lambda pos: math.inf, positions=[32 * i for i in range(6)])
    with ThreadPoolExecutor(1) as ex:
        got = read_watched(link.get, lambda ks, objs: None, keys, range(6), w, ex, "disk")
    assert w.stopped_at is None and w.pieces == 0
    assert [o.tensor[0, 0, 0, 0].item() for o in got] == [float(i) for i in range(6)]
    for o in got:
        o.release()
    link.close()
    pool.close()


class SlowAfter(RateLimitTier):
    """A real ``rate_limit`` link that delivers ``keys[:fast]`` at its rate, then slows to
    ``slow`` bytes/s: a read of a later chunk waits until the earlier ones were delivered
    (a link delivers in order; a watched read has several in flight)."""

    def __init__(self, *a, fast_keys: list[bytes], slow: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.fast_keys, self.slow = fast_keys, slow
        self._left = threading.Semaphore(0)

    def get(self, keys):
        if any(k not in self.fast_keys for k in keys):
            for _ in self.fast_keys:  # hang guard: every fast chunk was asked for first
                assert self._left.acquire(timeout=60)
            self.rate = self.slow
        out = super().get(keys)
        for k in keys:
            if k in self.fast_keys:
                self._left.release()
        return out


def test_a_link_slowing_under_the_last_pieces_still_stops(tmp_path: Path) -> None:
    """Every chunk is in flight when the link slows (four pieces at once, the last one
    asked for once the first landed): no chunk is left to bound the rest by, yet the read
    stops once the slow chunk has been waited for as long as recomputing from it costs,
    instead of waiting for the link (2 s a chunk here against 0.5 s of compute)."""
    pool, fast, keys = _tier(tmp_path, 1 << 30)
    link = SlowAfter(config=CacheConfig(chunk_size=32, local_cpu_size=8 << 20), pool=pool,
                     inner=fast.inner, bytes_per_second=1 << 30, fast_keys=keys[:5],
                     slow=16 << 10)
    w = LoadWatch(lambda pos: (192 - pos) / 32 * 0.5, positions=[32 * i for i in range(6)])
    abandoned: list = []
    with ThreadPoolExecutor(4) as ex:
        got = read_watched(link.get, lambda ks, objs: abandoned.extend(
            o for o in objs if o is not None), keys, range(6), w, ex, "disk")
        assert w.stopped_at is not None and w.stopped_at <= 5, w.reason
        assert got[5] is None  # the slow chunk never counted
        n = w.stopped_at
        assert all(o is not None for o in got[:n]) and all(o is None for o in got[n:])
        assert [o.tensor[0, 0, 0, 0].item() for o in got[:n]] == [float(i) for i in range(n)]
        link.close()  # the slow read ends at once; the executor waits for every piece
    # each piece in flight at the stop went to its owner, the slow chunk included
    assert sorted(o.tensor[0, 0, 0, 0].item() for o in abandoned) == \
        [float(i) for i in range(n, 6)]
    for o in got[:n] + abandoned:
        o.release()
    assert pool.outstanding() == []
    pool.close()
