"""Pool pre-faulting: pages populated ahead of stores, contents never disturbed, progress told.

Residency is read from the kernel (``mincore``), not from the pre-faulter's own counters.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap

import pytest
import torch

from lmc.memory import prefault as pf
from lmc.memory.pool import MemoryPool

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not pf.populate(torch.empty(4096, dtype=torch.uint8)
                                                .data_ptr(), 4096),
                                reason="kernel without MADV_POPULATE_WRITE")


def resident_pages(buf: torch.Tensor) -> tuple[int, int]:
    """(resident, total) 4 KiB pages of ``buf``, as the kernel reports them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    addr = buf.data_ptr()
    start = -(-addr // pf.PAGE) * pf.PAGE
    n = (addr + buf.numel() * buf.element_size() - start) // pf.PAGE
    vec = ctypes.create_string_buffer(n)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * pf.PAGE), vec) == 0, \
        ctypes.get_errno()
    return sum(b & 1 for b in vec.raw), n


def fresh(nbytes: int) -> torch.Tensor:
    """Untouched memory of a mapping of its own, in 4 KiB pages whatever the host's
    transparent huge page setting: what the kernel makes resident is then exactly what was
    faulted. (``torch.empty`` memory is not: the allocator writes its header into the
    mapping's first page, and with THP "always" on a 2 MiB-aligned mapping that one write
    faults in a whole huge page, 511 pages of the buffer; a populate of an unaligned block
    faults the huge pages around it too.)"""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)  # before any page is touched
    return torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive; touches nothing


def test_human_units():
    assert pf.human_bytes(512) == "512 B"
    assert pf.human_bytes(1536) == "1.5 KiB"
    assert pf.human_bytes(20 << 30) == "20.0 GiB"
    assert pf.human_seconds(0.0123) == "12 ms"
    assert pf.human_seconds(2.5) == "2.50 s"
    assert pf.human_seconds(75) == "1 min 15 s"


def test_ensure_populates_the_block_and_nothing_around_it():
    """A store past the front pays for its own bytes only, not for 64 MiB steps near it."""
    buf = fresh(64 * MiB)
    p = pf.Prefaulter(buf, step=4 * MiB)
    assert resident_pages(buf)[0] == 0  # untouched
    p.ensure(2 * MiB + 8192, 10 * MiB)  # not on a step's edge
    resident, total = resident_pages(buf[2 * MiB + 8192: 12 * MiB + 8192])
    assert resident == total
    assert resident_pages(buf[12 * MiB + 8192:])[0] == 0
    assert resident_pages(buf[: 2 * MiB + 8192])[0] == 0
    assert p.front == 0  # a store's own bytes do not advance the pre-fault


SLOW_MADVISE = pf.FaultRates(populate=0.5 * 2**30, zero=6 * 2**30, copy_fresh=5 * 2**30,
                             copy_warm=12 * 2**30)  # the VM
FAST_MADVISE = pf.FaultRates(populate=18 * 2**30, zero=5 * 2**30, copy_fresh=1 * 2**30,
                             copy_warm=15 * 2**30)  # a THP host measured here


def test_rates_choose_the_faster_way_for_the_thread_and_for_a_store():
    assert SLOW_MADVISE.method == "zero" and not SLOW_MADVISE.ensure_populates
    assert FAST_MADVISE.method == "populate" and FAST_MADVISE.ensure_populates


def test_ensure_lets_the_copy_fault_a_block_when_madvise_is_slower(monkeypatch):
    """Where madvise is slower than a copy's own faults, a store's block is not filled
    with it (it made one store in every background run 4-7x slower)."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(pf, "populate", lambda a, n: calls.append((a, n)) or True)
    buf = fresh(64 * MiB)
    p = pf.Prefaulter(buf, step=4 * MiB, rates=SLOW_MADVISE)
    p.ensure(0, 10 * MiB)
    assert calls == []
    assert p.front == 12 * MiB  # its steps are the copy's: the zeroing thread skips them
    q = pf.Prefaulter(fresh(64 * MiB), step=4 * MiB, rates=FAST_MADVISE)
    q.ensure(0, 10 * MiB)
    assert calls == [(q.addr, 10 * MiB)]


def test_calibration_measures_the_pool_and_says_what_it_chose(caplog):
    caplog.set_level(logging.INFO, logger="lmc.memory.prefault")
    buf = fresh(512 * MiB)
    p = pf.Prefaulter(buf, name="pool-x")
    rates = p.calibrate()
    assert rates is not None and min(rates.populate, rates.zero, rates.copy_fresh,
                                     rates.copy_warm) > 0
    assert p.method == rates.method and p.front == 4 * pf.CALIBRATE
    assert resident_pages(buf[: 4 * pf.CALIBRATE])[0] == 4 * pf.CALIBRATE // pf.PAGE
    assert "pool-x: measured populate" in caplog.text and "GiB/s" in caplog.text
    assert pf.Prefaulter(fresh(64 * MiB)).calibrate() is None  # too small to measure


@pytest.mark.parametrize("rates", [SLOW_MADVISE, FAST_MADVISE], ids=["zeroing", "madvise"])
def test_stores_racing_the_thread_keep_every_byte(rates):
    """Blocks handed out while the thread faults (zeroing included) keep what stores wrote."""
    for _ in range(3):
        pool = MemoryPool(96 * MiB, pin_memory=False, prefault="off")
        p = pool._prefault = pf.Prefaulter(pool.buffer, step=2 * MiB, rates=rates)
        p.start()
        objs = [pool.allocate((MiB,), torch.uint8) for _ in range(80)]
        for i, o in enumerate(objs):
            o.tensor.fill_(i % 251 + 1)
        assert p.done.wait(30)
        assert p.front == pool.size
        for i, o in enumerate(objs):
            assert bool((o.tensor == i % 251 + 1).all()), (rates.method, i)
        pool.release_many(objs)
        pool.close()


def test_background_prefault_reaches_the_end_and_keeps_contents(caplog):
    """Stores write while the thread populates the same region: every byte stays theirs."""
    caplog.set_level(logging.INFO, logger="lmc.memory.prefault")
    pool = MemoryPool(96 * MiB, pin_memory=False, prefault="off")
    p = pool._prefault = pf.Prefaulter(pool.buffer, step=2 * MiB)  # many small steps
    p.start()
    objs = pool.allocate_many((MiB,), torch.uint8, 48)
    for i, o in enumerate(objs):
        o.tensor.fill_(i % 251)
    assert p.done.wait(30)
    assert p.front == pool.size and pool.stats()["prefaulted"] == pool.size
    assert resident_pages(pool.buffer)[0] == resident_pages(pool.buffer)[1]
    for i, o in enumerate(objs):
        assert bool((o.tensor == i % 251).all()), i
    pool.release_many(objs)
    pool.close()
    assert p._stop_counted  # its pages left the process-wide gauge (other pools may be live)
    text = caplog.text
    assert "pre-faulting 96.0 MiB in the background" in text
    assert "pre-faulted 96.0 MiB in" in text and "/s)" in text


def test_fresh_pool_hands_out_blocks_from_the_front():
    """The allocator carves from the low end, so stores land on pages populated first."""
    pool = MemoryPool(32 * MiB, pin_memory=False, prefault="off")
    offs = [pool.allocate((MiB,), torch.uint8) for _ in range(8)]
    assert [o.offset for o in offs] == [i * MiB for i in range(8)]
    pool.release_many(offs)
    pool.close()


def test_allocation_past_the_front_is_populated_before_the_caller_writes():
    pool = MemoryPool(64 * MiB, pin_memory=False, prefault="off")
    pool._prefault = pf.Prefaulter(pool.buffer, step=4 * MiB)  # never started: only helpers
    o = pool.allocate((20 * MiB,), torch.uint8)
    resident, total = resident_pages(o.tensor)
    assert resident == total
    o.release()
    pool.close()


def test_now_mode_populates_before_returning_and_off_mode_does_not():
    now = MemoryPool(32 * MiB, pin_memory=False, prefault="now")
    assert now.stats()["prefaulted"] == now.size
    assert resident_pages(now.buffer)[0] == resident_pages(now.buffer)[1]
    off = MemoryPool(32 * MiB, pin_memory=False, prefault="off")
    assert off.stats()["prefaulted"] == 0
    # the allocator's header write just before the buffer may have faulted in the huge page
    # it lies in (THP "always", a 2 MiB-aligned mapping): at most the buffer's first 2 MiB
    assert resident_pages(off.buffer[2 * MiB:])[0] == 0
    now.close()
    off.close()
    with pytest.raises(ValueError, match="prefault must be"):
        MemoryPool(MiB, pin_memory=False, prefault="eager")


def test_now_mode_touches_what_the_kernel_would_not_populate(monkeypatch):
    """MADV_POPULATE_WRITE refusing for a moment (ENOMEM): "now" still returns with every
    page resident, zeroed instead (nothing is handed out of a new pool yet)."""
    monkeypatch.setattr(pf, "populate", lambda addr, n: False)
    monkeypatch.setattr(pf, "_populate_ok", True)  # the kernel can populate, just not now
    pool = MemoryPool(32 * MiB, pin_memory=False, prefault="now")
    assert pool.stats()["prefaulted"] == pool.size
    assert resident_pages(pool.buffer)[0] == resident_pages(pool.buffer)[1]
    pool.close()


def test_close_stops_the_thread_and_a_dropped_pool_lets_it_end():
    pool = MemoryPool(256 * MiB, pin_memory=False)
    t = pool._prefault._thread
    pool.close()
    assert not t.is_alive()
    pool = MemoryPool(256 * MiB, pin_memory=False)
    t = pool._prefault._thread
    del pool
    gc.collect()
    t.join(10)
    assert not t.is_alive()


def test_bad_step_is_refused():
    with pytest.raises(ValueError, match="multiple of 4096"):
        pf.Prefaulter(fresh(MiB), step=1000)


def test_waiting_for_ready_helps_the_prefault():
    """Whoever waits for "ready" faults steps too: with no thread at all (a thread starved
    on a busy host), the waiter alone finishes the pool."""
    pool = MemoryPool(64 * MiB, pin_memory=False, prefault="off")
    pool._prefault = pf.Prefaulter(pool.buffer, step=4 * MiB)  # never started
    assert not pool.wait_ready(0)
    assert pool.wait_ready(10)
    assert resident_pages(pool.buffer)[0] == resident_pages(pool.buffer)[1]
    pool.close()
