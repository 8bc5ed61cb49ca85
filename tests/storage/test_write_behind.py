"""Write-behind from L1 to a real disk tier: the byte bound (drop and count, never wait),
write-on-evict, serving chunks that wait in the queue, flush/close draining or cancelling,
and a tier whose writes fail. A slow tier is the real disk tier with an injected delay."""

from __future__ import annotations

import shutil
import time

import torch

from lmc import CacheConfig, CacheEngine
from lmc.memory.pool import MemoryPool
from lmc.storage.manager import StorageManager
from lmc.storage.tier import create_backend
from tests.deadlines import AT_ONCE_S, HANG_S, SLACK_S
from tests.kvutil import assert_bits_equal, make_caches, spec_for, token_kv
from tests.storage.slow_tier import SlowDisk

CHUNK = 16
CHUNK_BYTES = 3 * 2 * CHUNK * 2 * 8 * 4  # make_caches defaults, float32: 6 KiB (8 KiB block)


def _setup(tmp_path, delay=None, **cfg):
    """An engine over vllm_flash float32 caches with a (slow) disk tier in ``tmp_path``."""
    src = make_caches("vllm_flash", blocks=64, block_size=4, seed=3)
    spec = spec_for("vllm_flash", src)
    config = CacheConfig(**{"chunk_size": CHUNK, "local_cpu_size": "1MiB", **cfg})
    tiers = None
    if delay is not None:
        tiers = [lambda c, pool: SlowDisk(config=c, pool=pool, path=tmp_path, delay=delay,
                                          io_threads=1)]
    else:
        config = config.replace(local_disk=str(tmp_path))
    return CacheEngine(config, spec, "m", tiers=tiers), src, spec


def _prompt(i: int) -> list[int]:
    """One full chunk of tokens per prompt: distinct prompts have independent keys."""
    return [i * 1000 + t for t in range(CHUNK)]


def _slots(i: int) -> torch.Tensor:
    return torch.arange(CHUNK) + (i % 16) * CHUNK


def test_full_queue_drops_and_counts_and_store_never_waits(tmp_path):
    """A tier that writes nothing until released (tests/deadlines.py): the queue's bound is
    hit whatever this machine's speed, and a store that waited on the tier would take
    ``HANG_S``."""
    eng, src, _ = _setup(tmp_path, delay=HANG_S, write_queue_size=3 * CHUNK_BYTES)
    with eng:
        disk = eng.storage.lower[0]
        times = []
        for i in range(10):
            t0 = time.perf_counter()
            assert eng.store(_prompt(i), src, _slots(i)) == CHUNK
            times.append(time.perf_counter() - t0)
        st = eng.stats()
        assert st["disk.dropped_queue_full"] == 7  # 3 fit the bound (one of them in flight)
        assert st["disk.queue_bytes"] <= 3 * CHUNK_BYTES
        assert max(times) < AT_ONCE_S, f"a store waited on the slow tier: {max(times):.3f} s"
        disk.release()
        assert eng.flush(HANG_S)
        assert len(disk) == 3 and eng.stats()["disk.queue_bytes"] == 0
        assert all(eng.lookup(_prompt(i)) == CHUNK for i in range(10))  # all still in L1


def test_a_full_queue_drops_its_lowest_priority_chunks_first(tmp_path):
    """A tier that writes nothing until released; a queue of 3 chunks (one taken by the
    writer). A chunk offered to the full queue takes the room of a waiting one of a lower
    priority (the lowest, then the oldest, dropped); one that ranks no higher than any
    waiting chunk is dropped itself. Priorities are the manager's (``set_priority``)."""
    eng, src, _ = _setup(tmp_path, delay=HANG_S, write_queue_size=3 * CHUNK_BYTES)
    with eng:
        disk = eng.storage.lower[0]
        assert eng.store(_prompt(0), src, _slots(0)) == CHUNK
        assert disk.entered.wait(HANG_S), "the writer never took p0"  # in flight alone
        for i in (1, 2):  # waiting behind it
            assert eng.store(_prompt(i), src, _slots(i)) == CHUNK
        eng.set_priority(_prompt(1), -2)
        eng.set_priority(_prompt(2), -1)
        eng.set_priority(_prompt(6), 3)  # remembered for a chunk not stored yet
        for i in (3, 4, 5, 6):
            assert eng.store(_prompt(i), src, _slots(i)) == CHUNK
        # p3 displaced p1 (-2), p4 displaced p2 (-1), p5 (0) found nothing below it, p6 (3)
        # displaced p3 (the older of the two at 0)
        assert eng.stats()["disk.dropped_queue_full"] == 4
        disk.release()
        assert eng.flush(HANG_S)
        keys = [eng.db.keys(_prompt(i))[0] for i in range(7)]
        assert disk.contains(keys) == [True, False, False, False, True, False, True]
        assert disk.priority_of(keys[6]) == 3  # ranked as it arrived
        assert all(eng.lookup(_prompt(i)) == CHUNK for i in range(7))  # all still in L1


def test_write_on_evict_moves_evicted_chunks_down(tmp_path):
    """128 KiB of pool = 16 chunks of L1. Chunks reach the disk when evicted, or ahead of
    it: once the pool's free room is below the queue's bound and the queue is idle, a store
    queues copies of L1's next victims (write-ahead), which L1 then evicts without queueing
    (the disk holds them). An eviction holds the victim's memory until written, so a store
    under pressure moves up to a queue's worth (capped at a quarter of the pool) of cold
    chunks down and drops a victim only when the queue is full. Every chunk is in L1, on
    disk, or counted as dropped."""
    eng, src, spec = _setup(tmp_path, local_cpu_size="128KiB", write_policy="write_on_evict")
    disk = eng.storage.lower[0]
    with eng:
        for i in range(16):
            eng.store(_prompt(i), src, _slots(i))
        assert eng.flush(5)
        st = eng.stats()
        assert st["cpu.evictions"] == 0 and 0 < len(disk) <= 3  # written ahead, not moved
        for i in range(16, 24):
            eng.store(_prompt(i), src, _slots(i))
            assert eng.flush(5)
        st = eng.stats()
        dropped = st.get("disk.dropped_queue_full", 0)
        assert st["cpu.evictions"] > 0 and dropped < st["cpu.evictions"]
        assert st["disk.queue_limit_bytes"] == 32 << 10
        keys = [eng.db.keys(_prompt(i))[0] for i in range(24)]
        on_disk = disk.contains(keys)
        in_l1 = eng.storage.l1_contains(keys)
        assert sum(a or b for a, b in zip(on_disk, in_l1)) + dropped == 24
        assert not any(a and b for a, b in zip(on_disk[:8], in_l1[:8]))  # the evicted: moved
        first = on_disk.index(True)
        dst = make_caches("vllm_flash", blocks=64, block_size=4, zeros=True)
        assert eng.retrieve(_prompt(first), dst, torch.arange(CHUNK)) == CHUNK  # from disk
        assert_bits_equal(token_kv(spec, dst, torch.arange(CHUNK)),
                          token_kv(spec, src, _slots(first)), "evicted chunk")
        assert eng.contains_chunks(_prompt(first)).all()  # promoted back into L1


def test_a_promoted_chunk_evicted_again_is_the_disks_newest_not_its_first_victim(tmp_path):
    """Write-on-evict: a disk hit promoted into L1 leaves its disk copy demoted (L1 will
    write it back). When L1 evicts it again it skips that write (the disk holds it), so the
    copy must count as just written: left first in line, the disk's next eviction took it
    and the chunk was gone from both tiers (the agentic replay lost session chunks so)."""
    eng, src, _ = _setup(tmp_path, local_cpu_size="128KiB", write_policy="write_on_evict")
    disk = eng.storage.lower[0]
    key = lambda i: eng.db.keys(_prompt(i))[0]  # noqa: E731
    with eng:
        for i in range(24):
            eng.store(_prompt(i), src, _slots(i))
            assert eng.flush(5)
        assert disk.contains([key(0)]) == [True] and not eng.storage.l1_contains([key(0)])[0]
        dst = make_caches("vllm_flash", blocks=64, block_size=4, zeros=True)
        assert eng.retrieve(_prompt(0), dst, torch.arange(CHUNK)) == CHUNK  # promoted
        order = disk.index.policy.keys_in_order()
        assert order[0] == key(0)  # demoted: L1 holds it now
        before = set(order)
        for i in range(24, 48):  # L1 evicts p0 again
            eng.store(_prompt(i), src, _slots(i))
            assert eng.flush(5)
        assert not eng.storage.l1_contains([key(0)])[0]
        assert eng.stats().get("disk.put_skipped_present", 0) == 0  # never queued again
        order = disk.index.policy.keys_in_order()
        assert key(0) in order
        older = [k for k in order[:order.index(key(0))] if k in before]
        assert len(older) == len(before) - 1, "p0 kept its place before older disk chunks"


def test_chunks_waiting_in_the_queue_are_served(tmp_path):
    """Write-on-evict with a slow disk: an evicted chunk still waiting to be written is found
    by lookup and retrieve (and goes back into L1), not lost in the gap."""
    eng, src, spec = _setup(tmp_path, delay=HANG_S, local_cpu_size="64KiB",
                            write_policy="write_on_evict")
    with eng:
        for i in range(10):  # 8 fit; prompts 0 and 1 are evicted into the queue
            eng.store(_prompt(i), src, _slots(i))
        assert not eng.contains_chunks(_prompt(1)).any()
        assert eng.stats()["disk.queue_chunks"] >= 1
        assert eng.lookup(_prompt(1)) == CHUNK
        dst = make_caches("vllm_flash", blocks=64, block_size=4, zeros=True)
        t0 = time.perf_counter()
        assert eng.retrieve(_prompt(1), dst, torch.arange(CHUNK)) == CHUNK
        assert time.perf_counter() - t0 < AT_ONCE_S  # from the queue, not the held read
        assert_bits_equal(token_kv(spec, dst, torch.arange(CHUNK)),
                          token_kv(spec, src, _slots(1)), "queued chunk")
        assert eng.contains_chunks(_prompt(1)).all()
        eng.storage.lower[0].release()  # the queue drains at once on leaving


def test_flush_waits_and_close_drains(tmp_path):
    eng, src, _ = _setup(tmp_path, delay=0.05)
    with eng:
        for i in range(6):
            eng.store(_prompt(i), src, _slots(i))
        assert not eng.flush(0.01)  # six slow writes cannot be done yet
        assert eng.flush(10)
        assert len(eng.storage.lower[0]) == 6
        for i in range(6, 10):
            eng.store(_prompt(i), src, _slots(i))
    # close drained the rest: a new engine finds all ten on disk
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size="1MiB", local_disk=str(tmp_path))
    with CacheEngine(cfg, eng.spec, "m") as eng2:
        assert all(eng2.lookup(_prompt(i)) == CHUNK for i in range(10))


def test_close_with_a_deadline_cancels_the_rest_and_releases_everything(tmp_path):
    pool = MemoryPool(1 << 20, pin_memory=False)
    cfg = CacheConfig(local_cpu_size=1 << 20)
    l1 = create_backend("cpu", cfg, pool)
    # 1 s a value: all 20 would take 20 s; the deadline plus the write in progress, 1.25 s
    slow = SlowDisk(config=cfg, pool=pool, path=tmp_path, delay=1.0, io_threads=1)
    sm = StorageManager([l1, slow], queue_bytes=1 << 20, close_timeout=0.25)
    keys = [bytes([i]) * 16 for i in range(20)]
    objs = [pool.allocate((1, 2, 4, 64), torch.float32, 4) for _ in keys]
    sm.put(keys, objs)
    for o in objs:
        o.release()
    t0 = time.perf_counter()
    sm.close()
    assert time.perf_counter() - t0 < 0.25 + 1.0 + SLACK_S  # not the 20 s of every write
    q = sm.queues[0]
    if q._thread is not None:
        q._thread.join()  # the batch that was inside put() when the deadline passed
    assert len(slow) < 20
    m = slow.metrics  # queued at the deadline: closed; cancelled inside the tier: rejected
    assert m.get("dropped_closed") + m.get("dropped_rejected") + len(slow) == 20
    assert pool.used_bytes == 0  # the queue's references were all released


def test_a_failing_tier_loses_writes_not_the_writer(tmp_path):
    d = tmp_path / "d"
    eng, src, _ = _setup(d)
    with eng:
        eng.store(_prompt(0), src, _slots(0))
        assert eng.flush(5)
        shutil.rmtree(d)  # every write now fails (ENOENT): skipped and counted
        eng.store(_prompt(1), src, _slots(1))
        assert eng.flush(5)
        st = eng.stats()
        assert st["disk.errors_put_ENOENT"] == 1 and st["disk.dropped_rejected"] == 1
        d.mkdir()  # the directory is back: writes work again
        eng.store(_prompt(2), src, _slots(2))
        assert eng.flush(5)
        assert eng.storage.lower[0].contains(eng.db.keys(_prompt(2))) == [True]


def test_chunks_the_tier_already_holds_are_not_written_again(tmp_path):
    """A second engine storing the same prompt (a shared system prompt, a restart) finds the
    chunks in the tier with one batched contains() and sends nothing."""
    eng, src, spec = _setup(tmp_path)
    with eng:
        eng.store(_prompt(0), src, _slots(0))
        assert eng.flush(5)
        assert eng.stats()["disk.write_bytes"] > 0
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size="1MiB", local_disk=str(tmp_path))
    with CacheEngine(cfg, spec, "m") as eng2:
        assert eng2.store(_prompt(0), src, _slots(0)) == CHUNK  # new to this L1
        assert eng2.flush(5)
        st = eng2.stats()
        assert st["disk.put_skipped_present"] == 1 and "disk.write_bytes" not in st


def test_a_writer_left_inside_put_at_close_is_not_a_leak_and_frees_on_return(tmp_path):
    """A bounded close() that stops waiting for a writer still inside a tier's put() leaves
    that batch to the writer: closing the pool reports no leak (CI once failed here by timing:
    a 0.3 s-per-value tier and a 0.2 s close deadline), and the writer releases every object
    when put() returns. The writer is held inside put() by an event, so this is deterministic."""
    import threading

    from lmc.memory import invariants

    entered, go = threading.Event(), threading.Event()

    class HeldDisk(SlowDisk):
        def put(self, keys, objs):  # held before any I/O starts: the tier's close waits
            entered.set()            # for I/O in progress, not for a caller of put()
            go.wait(30)
            return super().put(keys, objs)

    eng, src, _ = _setup(tmp_path, delay=None)
    eng.close()
    eng = CacheEngine(CacheConfig(chunk_size=CHUNK, local_cpu_size="1MiB"), eng.spec, "m",
                      tiers=[lambda c, pool: HeldDisk(config=c, pool=pool, path=tmp_path,
                                                      delay=0.0, io_threads=1)])
    eng.storage.close_timeout = 0.2
    for i in range(4):
        eng.store(_prompt(i), src, _slots(i))
    assert entered.wait(10), "the writer never reached put()"
    q = eng.storage.queues[0]
    held = list(q._writing)
    assert held, "the writer holds no batch"
    invariants.take()  # only what close() reports counts below
    eng.close()  # returns at the deadline; the writer is still inside put()
    assert invariants.take() == [], "a batch left to its writer was reported as leaked"
    assert not eng.pool.leaks
    go.set()
    q._thread.join(10)
    assert not q._thread.is_alive()
    assert all(o._refs == 0 for o in held), "the writer did not release its batch"


def _until(cond, what: str, limit: float = HANG_S) -> None:
    """Wait for ``cond()`` (a success path: only a hang reaches ``limit``)."""
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def _save_layerwise(eng: CacheEngine, i: int, src) -> None:
    st = eng.store_layer(_prompt(i), src, _slots(i))
    for layer in range(eng.num_layers):
        st.save(layer)
    assert st.commit() == CHUNK


def test_writes_hold_off_while_the_engine_saves_until_a_flush(tmp_path):
    """write_quiet_ms: the writer does not start while the engine has saved within the
    window (an hour here, and no time cap: nothing but a flush can release it), and a flush
    writes what was held, bit for bit."""
    eng, src, spec = _setup(tmp_path, write_quiet_ms=3_600_000)
    with eng:
        q = eng.storage.queues[0]
        q.max_hold = 10 * HANG_S
        _save_layerwise(eng, 1, src)
        _until(lambda: q.held >= 1, "the writer held off")
        assert len(eng.storage.lower[0]) == 0 and eng.stats()["disk.queue_chunks"] == 1
        assert eng.stats()["disk.write_held"] >= 1
        assert eng.flush(HANG_S)
        assert len(eng.storage.lower[0]) == 1
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size="1MiB", local_disk=str(tmp_path))
    with CacheEngine(cfg, spec, "m") as eng2:  # read back from the disk alone
        dst = make_caches("vllm_flash", blocks=64, block_size=4, zeros=True)
        assert eng2.retrieve(_prompt(1), dst, _slots(1)) == CHUNK
        assert_bits_equal(token_kv(spec, dst, _slots(1)), token_kv(spec, src, _slots(1)),
                          "a held write, flushed")


def test_held_writes_go_after_max_hold_and_when_the_queue_is_half_full(tmp_path):
    """The hold is bounded: a queue idle for ``max_hold`` writes while the engine still
    saves, and a queue past half its bytes writes at once (else offers would be dropped)."""
    eng, src, _ = _setup(tmp_path / "a", write_quiet_ms=3_600_000)
    with eng:
        eng.storage.queues[0].max_hold = 0.2
        _save_layerwise(eng, 1, src)
        eng.storage.note_saving()  # still saving
        _until(lambda: len(eng.storage.lower[0]) == 1, "written after max_hold")
    eng, src, _ = _setup(tmp_path / "b", write_quiet_ms=3_600_000,
                         write_queue_size=3 * CHUNK_BYTES)
    with eng:
        q = eng.storage.queues[0]
        q.max_hold = 10 * HANG_S
        _save_layerwise(eng, 1, src)
        _until(lambda: q.held >= 1, "the writer held off")
        _save_layerwise(eng, 2, src)  # 2 of 3 chunks' bytes queued: past half
        _until(lambda: len(eng.storage.lower[0]) == 2, "written once half full")


def test_no_hold_by_default(tmp_path):
    eng, src, _ = _setup(tmp_path)
    with eng:
        assert eng.storage.quiet is None and eng.storage.queues[0].hold is None
        _save_layerwise(eng, 1, src)
        _until(lambda: len(eng.storage.lower[0]) == 1, "written without a flush")
        assert "disk.write_held" not in eng.stats()
