"""The layered load watch (lmc/storage/layered_watch.py): its rule on counted progress, and
a cut of a real disk tier's layered read -- the chunks kept land whole and verify, the
ones cut stop being read and never count."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.backends.disk import disk_layered_read as disk_layers
from lmc.storage.backends.disk.backend import DiskBackend
from lmc.storage.layered_read import LayeredRead, LayerGate
from lmc.storage.layered_watch import Progress, _when_cut, costs, decide, rate_bound
from tests.deadlines import HANG_S
from tests.storage.backends.conftest import redis_server  # noqa: F401 - real redis-server

MiB = 1 << 20


def progress(now: float, moved: float, landed: list[int], sizes: list[int] | None = None,
             last: float = 0.0, ref: tuple[float, float] = (0.0, 0.0)) -> Progress:
    return Progress(now, 0.0, last, moved, ref, sizes or [MiB] * len(landed), landed)


def test_rate_bound_counts_bytes_in_flight_and_the_latter_half() -> None:
    p = progress(2.0, 4 * MiB, [0, 0, 0, 0])  # 4 MiB in flight after 2 s
    assert rate_bound(p) == 2 * MiB
    assert rate_bound(progress(0.0, 4 * MiB, [0])) == math.inf  # no time has passed
    assert rate_bound(progress(2.0, 0.0, [0])) == math.inf  # nothing moved nor in flight
    # 3 MiB by t=1 (the latter half's start), 3.5 MiB by t=2: 0.5 MiB/s lately
    p = progress(2.0, 3.5 * MiB, [MiB, MiB, MiB, MiB // 2], ref=(1.0, 3 * MiB))
    assert rate_bound(p) == MiB / 2


def test_costs_are_bytes_left_at_the_rate_plus_recomputing() -> None:
    p = progress(1.0, 2 * MiB, [MiB // 2, MiB // 2, 0, 0])  # 1 MiB in flight beyond
    # left per k: 0, 0.5, 1, 2, 3 MiB; less the 1 MiB in flight; at 1 MiB/s
    assert costs(p, MiB, [4.0, 3.0, 2.0, 1.0, 0.0]) == [4.0, 3.0, 2.0, 2.0, 2.0]


def test_a_fast_read_goes_on() -> None:
    p = progress(0.01, 8 * MiB, [2 * MiB] * 4, sizes=[4 * MiB] * 4, last=0.01)
    d = decide(p, [1.0, 0.75, 0.5, 0.25, 0.0], 0.03, 1e-3)
    assert d.cut_to is None and d.wake > 0.01


def test_a_slow_read_is_cut_to_none_when_recomputing_all_wins() -> None:
    # 1 MiB in flight after 1 s, 16 MiB to go; recomputing everything costs 0.5 s
    p = progress(1.0, MiB, [0] * 4, sizes=[4 * MiB] * 4)
    d = decide(p, [0.5, 0.4, 0.25, 0.1, 0.0], 0.03, 1e-3)
    assert d.cut_to == 0 and "chunk 0" in d.why


def test_the_wake_time_is_when_the_rule_would_cut() -> None:
    # 1 MiB in flight at t=0.1 s, 4 MiB to read, recomputing from chunk k costs rc[k]:
    # with nothing more moving, the bound 1 MiB / t first makes keeping 3 chunks (1 MiB
    # left after the one in flight, then rc[3]) beat all 4 (3 MiB left) when
    # (3 - 1.03 * 2) MiB * t / 1 MiB = 1.03 * rc[3] + 1 ms, at t = 0.104 / 0.94
    rc = [0.5, 0.4, 0.25, 0.1, 0.0]
    d = decide(progress(0.1, MiB, [0] * 4), rc, 0.03, 1e-3)
    assert d.cut_to is None
    assert d.wake == pytest.approx((1.03 * 0.1 + 1e-3) / 0.94, rel=1e-6)
    # later, at 5 MiB/s at best, keeping chunk 0 only costs least: 0 s left + 0.4 s
    later = decide(progress(0.2, MiB, [0] * 4), rc, 0.03, 1e-3)
    assert later.cut_to == 1


def test_a_read_that_goes_on_after_a_cut_is_cut_to_none_or_left_alone() -> None:
    """A producer that does not stop for a cut (Redis: its connections go on in layer order)
    lands the kept chunks' last layers after everyone's, so keeping some costs as much as
    keeping all: the rule weighs none against all only. Where the partial rule keeps chunk 0
    (above: at 5 MiB/s, 0 s left + 0.4 s), it cuts to none (0.5 s), and it wakes for that
    choice alone."""
    rc = [0.5, 0.4, 0.25, 0.1, 0.0]
    assert decide(progress(0.2, MiB, [0] * 4), rc, 0.03, 1e-3).cut_to == 1
    d = decide(progress(0.2, MiB, [0] * 4), rc, 0.03, 1e-3, partial=False)
    assert d.cut_to == 0 and "chunk 0" in d.why
    # the wake: 1 MiB / t makes all 4 MiB (3 left after the one in flight) cost more than
    # 1.03 * rc[0] + 1 ms when 3 MiB * t / 1 MiB = 1.03 * 0.5 + 1e-3
    early = progress(0.1, MiB, [0] * 4)
    assert decide(early, rc, 0.03, 1e-3, partial=False).cut_to is None
    assert _when_cut(early, rc, 0.03, 1e-3, False) == pytest.approx((1.03 * 0.5 + 1e-3) / 3)
    assert _when_cut(early, rc, 0.03, 1e-3) < 0.172  # the partial rule: keeping 3 chunks
    # a stall keeps nothing either, though chunks 0 and 1 are whole: after as long as
    # recomputing from chunk 0 costs (2 s; the partial rule cut at 1 s, from chunk 2)
    stalled = progress(3.5, 4 * MiB, [MiB, MiB, 0, 0], sizes=[MiB] * 4, last=1.0,
                       ref=(1.0, 2 * MiB))
    d = decide(stalled, [2.0, 1.5, 1.0, 0.5, 0.0], 0.03, 1e-3, partial=False)
    assert d.cut_to == 0 and "nothing landed" in d.why


def test_a_redis_read_notes_its_progress_and_says_it_goes_on_after_a_cut(
        redis_server) -> None:  # noqa: F811
    """What the rule above is for: a Redis layered read declares that it goes on after a cut
    (``stops_on_cut`` False), and notes each piece as it lands, nothing left counted as in
    flight once it verified (without that the watch saw nothing until the end)."""
    from lmc.storage.backends.redis.backend import RedisBackend

    pool = MemoryPool(32 << 20, False)
    url = redis_server.url
    cfg = CacheConfig(chunk_size=32, local_cpu_size=32 << 20, remote_url=url,
                      remote_timeout=5.0, remote_key_prefix="watch-progress")
    tier = RedisBackend(url, config=cfg, pool=pool, get_piece=4096)
    try:
        keys = [bytes([0x70 + i]) * 16 for i in range(3)]
        objs = [pool.allocate((4, 2, 32, 64), torch.float32, 32) for _ in keys]
        for i, o in enumerate(objs):
            o.tensor.fill_(i)
        assert tier.put(keys, objs) == 3
        for o in objs:
            o.release()
        read = tier.get_layers(keys)
        assert read is not None and not read.stops_on_cut
        read.wait_verified(timeout=HANG_S)
        assert read.landed_bytes == [o.nbytes for o in read.objs]  # 16 pieces each
        assert read.in_flight == 0
        for o in read.objs:
            o.release()
        read.wait_ended(timeout=HANG_S)
    finally:
        tier.close()
        pool.close()


def test_a_stalled_read_is_cut_to_the_chunks_already_whole() -> None:
    # chunks 0 and 1 whole; everything left in flight (no bound); nothing landed for 2 s,
    # longer than recomputing from chunk 2 (1 s)
    sizes = [MiB] * 4
    p = progress(3.0, 4 * MiB, [MiB, MiB, 0, 0], sizes=sizes, last=1.0, ref=(1.0, 2 * MiB))
    d = decide(p, [2.0, 1.5, 1.0, 0.5, 0.0], 0.03, 1e-3)
    assert d.cut_to == 2 and "nothing landed" in d.why


def _disk(tmp: Path, n: int, layers: int = 4) -> tuple[MemoryPool, DiskBackend, list[bytes]]:
    pool = MemoryPool(32 << 20, False)
    cfg = CacheConfig(chunk_size=32, local_cpu_size=32 << 20)
    disk = DiskBackend(config=cfg, pool=pool, path=str(tmp), size=64 << 20)
    keys = [bytes([i + 1]) * 16 for i in range(n)]
    objs = []
    for i in range(n):
        o = pool.allocate((layers, 2, 32, 64), torch.float32, 32)
        o.tensor.copy_(torch.arange(o.tensor.numel(), dtype=torch.float32).view_as(o.tensor)
                       + 1000 * i)
        objs.append(o)
    assert disk.put(keys, objs) == n
    for o in objs:
        o.release()
    return pool, disk, keys


def test_a_cut_disk_read_lands_the_kept_chunks_whole_and_stops_reading_the_rest(
        tmp_path: Path, monkeypatch) -> None:
    pool, disk, keys = _disk(tmp_path, 8)
    hold = threading.Event()
    read_cut: list[int] = []  # windows of keys cut that were still read
    real = disk_layers.DiskLayeredRead._read_window

    def held(self, v, obj, lo, hi):
        if lo >= v.hdr.payload_len // 4:  # layers 1.. wait until the cut was made
            assert hold.wait(60), "never released"
            if v.key in keys[2:]:
                read_cut.append(lo)
        return real(self, v, obj, lo, hi)

    monkeypatch.setattr(disk_layers.DiskLayeredRead, "_read_window", held)
    read = disk.get_layers(keys)
    assert read is not None and all(o is not None for o in read.objs)
    read.wait_layer(0, timeout=60)  # layer 0 of every chunk is in place...
    gate = LayerGate([(read, j) for j in range(8)])
    assert read.cut(2) and gate.kept() == 2  # ...and the read keeps chunks 0 and 1 only
    assert not read.cut(5)  # a cut never takes chunks back
    hold.set()
    gate.wait_verified(timeout=60)
    assert read.ok == [True, True] + [False] * 6
    for i in range(2):  # the kept chunks are bit-exact
        o = read.objs[i]
        want = torch.arange(o.tensor.numel(), dtype=torch.float32).view_as(o.tensor) + 1000 * i
        assert torch.equal(o.tensor, want)
    read.wait_ended(timeout=60)
    assert not read.cut(1)  # every kept layer landed: nothing left to cut
    # the queued windows of the keys cut were dropped: at most the pool's threads' worth
    # of layer 1+ windows (4) had started when the cut came
    assert len(read_cut) <= 4, read_cut
    for o in read.objs:
        o.release()
    disk.close()
    assert pool.outstanding() == []
    pool.close()


def _waits(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_waiter_blocked_on_a_layer_goes_on_when_the_read_is_cut_to_none() -> None:
    """The engine's I/O thread waits for a layer that will never land (a link stuck after
    the decision); the watch cuts the read to nothing: the wait ends at once, with nothing
    landed, instead of waiting for bytes no one will use (issue 36: a fresh engine behind
    a 3 MiB/s Redis link took 2.0x the engine alone, the stop's recompute waiting for
    each layer of the abandoned read)."""
    read = LayeredRead([None, None, None], num_layers=4)
    gate = LayerGate([(read, 0), (read, 1), (read, 2)])
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            gate.wait_layer(2)
            gate.wait_verified()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    waiter = _waits(wait)
    waiter.join(0.05)
    assert waiter.is_alive(), "nothing landed: the waiter must be blocked"
    assert read.cut(0)
    waiter.join(HANG_S)
    assert not waiter.is_alive(), "the wait did not end at the cut"
    assert errors == [] and gate.kept() == 0 and not read.settled
    # a cut that keeps some keys still waits for them
    read2 = LayeredRead([None, None], num_layers=2)
    w2 = _waits(lambda: read2.wait_layer(1, HANG_S, [0, 1]))
    assert read2.cut(1)
    w2.join(0.05)
    assert w2.is_alive(), "key 0 is kept: its layer must land first"
    read2.landed(1)
    w2.join(HANG_S)
    assert not w2.is_alive()
