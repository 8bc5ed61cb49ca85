"""Pool pre-faulting: pages populated ahead of stores, contents never disturbed, progress told.

Residency is read from the kernel (``mincore``), not from the pre-faulter's own counters.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading

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
    """Untouched, page-aligned memory of its own mapping (large: torch mmaps it)."""
    raw = torch.empty(nbytes + pf.PAGE, dtype=torch.uint8)
    skew = (-raw.data_ptr()) % pf.PAGE
    return raw[skew: skew + nbytes]


def test_human_units():
    assert pf.human_bytes(512) == "512 B"
    assert pf.human_bytes(1536) == "1.5 KiB"
    assert pf.human_bytes(20 << 30) == "20.0 GiB"
    assert pf.human_seconds(0.0123) == "12 ms"
    assert pf.human_seconds(2.5) == "2.50 s"
    assert pf.human_seconds(75) == "1 min 15 s"


def test_ensure_populates_the_front_steps_and_nothing_past_them():
    buf = fresh(64 * MiB)
    p = pf.Prefaulter(buf, step=4 * MiB)
    assert resident_pages(buf)[0] < 64  # untouched (a page or so of the heap at most)
    p.ensure(0, 10 * MiB)  # needs steps 0..2: claimed and populated by this thread
    assert p.front == 12 * MiB
    resident, total = resident_pages(buf[: 12 * MiB])
    assert resident == total
    assert resident_pages(buf[16 * MiB:])[0] == 0
    p.ensure(0, 4 * MiB)  # inside the front: nothing to do
    assert p.front == 12 * MiB


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
    assert pool._prefault.front == 20 * MiB
    o.release()
    pool.close()


def test_now_mode_populates_before_returning_and_off_mode_does_not():
    now = MemoryPool(32 * MiB, pin_memory=False, prefault="now")
    assert now.stats()["prefaulted"] == now.size
    assert resident_pages(now.buffer)[0] == resident_pages(now.buffer)[1]
    off = MemoryPool(32 * MiB, pin_memory=False, prefault="off")
    assert off.stats()["prefaulted"] == 0
    assert resident_pages(off.buffer)[0] < 64
    now.close()
    off.close()
    with pytest.raises(ValueError, match="prefault must be"):
        MemoryPool(MiB, pin_memory=False, prefault="eager")


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


def test_helpers_and_background_never_populate_a_step_twice():
    buf = fresh(64 * MiB)
    p = pf.Prefaulter(buf, step=8 * MiB)  # every helper's block within 4 steps: claims
    seen: list[tuple[int, int]] = []
    real = pf.populate

    def counting(addr: int, n: int) -> bool:
        seen.append((addr, n))
        return real(addr, n)

    pf_populate, pf.populate = pf.populate, counting
    try:
        p.start()
        helpers = [threading.Thread(target=p.ensure, args=(i * 8 * MiB, 6 * MiB))
                   for i in range(4)]
        for h in helpers:
            h.start()
        for h in helpers:
            h.join()
        assert p.done.wait(30)
    finally:
        pf.populate = pf_populate
    steps = sorted(a for a, n in seen if n == 8 * MiB)
    assert steps == [buf.data_ptr() + i * 8 * MiB for i in range(8)]  # each claimed once
    # a helper re-populates its own block only where a step was still in flight
    assert all(n == 6 * MiB for a, n in seen if n != 8 * MiB)
    assert p.front == 64 * MiB


def test_bad_step_is_refused():
    with pytest.raises(ValueError, match="multiple of 4096"):
        pf.Prefaulter(fresh(MiB), step=1000)
