"""The pinned pool: mapped by lmc and page-locked with cudaHostRegister in steps, sized as asked.

Threat model: docs/design.md, "Memory" (a configured ``local_cpu_size`` must never pin more
than asked rounded up to 2 MiB -- torch's pinned host allocator pinned the next power of two
-- and a failed registration must be an error naming the size and the host's limits, never a
silent fallback to pageable memory). The register call is a stand-in here (no GPU on CI)
that checks every call: sizes, alignment, order, no overlap, and the unregister at close.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmc.memory import prefault as pf
from lmc.memory.pool import MemoryPool

MiB = 1 << 20


class StandIn:
    """cudaHostRegister / cudaHostUnregister checked call by call: each range 2 MiB-aligned,
    a whole number of 2 MiB, mapped memory (its ends are read), never overlapping a live
    one; ``fail_at``: the call number that fails as a driver would (out of memory)."""

    def __init__(self, fail_at: int | None = None, delay: float = 0.0) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.errors: list[str] = []
        self.fail_at = fail_at
        self.delay = delay
        self.lock = threading.Lock()

    def register(self, addr: int, nbytes: int) -> None:
        time.sleep(self.delay)
        with self.lock:
            self.calls.append(("register", addr, nbytes))
            n = sum(1 for c in self.calls if c[0] == "register")
            if self.fail_at is not None and n >= self.fail_at:
                raise RuntimeError("cudaErrorMemoryAllocation: out of memory")
            if addr % pf.HUGE or nbytes % pf.HUGE or nbytes <= 0:
                self.errors.append(f"unaligned range {addr:#x}+{nbytes}")
            for a, m in self.live.items():
                if addr < a + m and a < addr + nbytes:
                    self.errors.append(f"{addr:#x}+{nbytes} overlaps {a:#x}+{m}")
            ctypes.string_at(addr, 1), ctypes.string_at(addr + nbytes - 1, 1)  # mapped
            self.live[addr] = nbytes

    def unregister(self, addr: int) -> None:
        with self.lock:
            self.calls.append(("unregister", addr, 0))
            if self.live.pop(addr, None) is None:
                self.errors.append(f"unregister of {addr:#x}, never registered")

    def registered(self) -> list[tuple[int, int]]:
        return [(a, n) for kind, a, n in self.calls if kind == "register"]


def _pool(size: int, reg: StandIn, **kw) -> MemoryPool:
    return MemoryPool(size, "true", registrar=reg, **{"pin_step": 4 * MiB, **kw})


@pytest.mark.parametrize("size", [4096, 2 * MiB, 10 * MiB + 4096, 33 * MiB])
@pytest.mark.parametrize("mode", ["now", "background"])
def test_pinned_bytes_are_the_size_asked_rounded_to_2mib(size, mode):
    """Torch's pinned allocator rounds up to a power of two (65 GiB asked pins 128 GiB);
    here the registered ranges cover exactly the size rounded up to 2 MiB, in steps from an
    aligned start, each registered once, all unregistered at close."""
    reg = StandIn()
    pool = _pool(size, reg, prefault=mode)
    pool._prefault.wait(10)
    ranges = reg.registered()
    want = -(-size // pf.HUGE) * pf.HUGE
    assert sum(n for _, n in ranges) == want, "pinned bytes are not the size asked"
    assert ranges[0][0] == pool.buffer.data_ptr(), "the pool does not start where pinned"
    for (a, n), (b, _) in zip(ranges, ranges[1:]):
        assert b == a + n, "steps are not consecutive from the front"
    assert all(n <= 4 * MiB for _, n in ranges)
    st = pool.stats()
    assert st["pinned_bytes"] == want and st["pinned_asked"] == size and st["pinned"] == 1
    pool.close()
    assert not reg.live, "close left memory registered"
    assert not reg.errors, reg.errors


def test_allocation_past_the_front_is_pinned_before_it_is_handed_out():
    """A block handed out while the background registration is behind is page-locked
    first (the allocating thread registers the steps up to it), never pageable."""
    reg = StandIn(delay=0.02)
    pool = _pool(64 * MiB, reg)
    obj = pool.allocate((40 * MiB,), torch.uint8)
    end = obj.offset + obj.nbytes
    assert pool._prefault.front >= end
    covered = sum(n for a, n in reg.registered() if a < pool.buffer.data_ptr() + end)
    assert covered >= end
    obj.release()
    pool.close()
    assert not reg.live and not reg.errors, reg.errors


def test_a_failed_registration_is_an_error_naming_size_and_limits():
    """The driver refusing (the host out of lockable memory) is a PinError naming the size
    asked and RLIMIT_MEMLOCK / MemAvailable; what was registered is unregistered."""
    reg = StandIn(fail_at=3)
    with pytest.raises(pf.PinError) as e:
        _pool(20 * MiB, reg, prefault="now")
    msg = str(e.value)
    assert "local_cpu_size asked 20.0 MiB" in msg and "RLIMIT_MEMLOCK" in msg and "MemAvailable" in msg
    assert "out of memory" in msg and "pin_memory=false" in msg
    assert not reg.live, "a failed pool left memory registered"


def test_a_background_failure_fails_the_next_allocation_and_leaks_nothing(caplog):
    """Registration failing in the background is logged and raised by the next allocation
    that needs the unpinned part: never a silent fallback to pageable copies."""
    reg = StandIn(fail_at=2)
    with caplog.at_level(logging.ERROR, logger="lmc.memory.prefault"):
        pool = _pool(32 * MiB, reg)
        pool._prefault.done.wait(10)
    assert any("page-locking" in r.getMessage() for r in caplog.records)
    ok = pool.allocate((MiB,), torch.uint8)  # inside the first, pinned, step
    assert ok is not None
    with pytest.raises(pf.PinError, match="RLIMIT_MEMLOCK"):
        pool.allocate((20 * MiB,), torch.uint8)
    assert pool.used_bytes == ok.nbytes, "the refused allocation leaked its block"
    ok.release()
    pool.close()
    assert not reg.live


def test_a_first_step_failure_fails_the_constructor():
    """A broken driver fails the pool at once, not in a thread nobody watches."""
    with pytest.raises(pf.PinError):
        _pool(32 * MiB, StandIn(fail_at=1))


def test_more_than_the_host_has_is_refused_before_mapping(monkeypatch):
    reg = StandIn()
    monkeypatch.setattr("lmc.memory.pool.mem_available", lambda: 8 * MiB)
    with pytest.raises(pf.PinError, match=r"16.0 MiB pool.*MemAvailable"):
        _pool(16 * MiB, reg)
    assert not reg.calls


def test_a_dropped_pool_unregisters_its_memory():
    reg = StandIn()
    pool = _pool(8 * MiB, reg, prefault="now")
    assert reg.live
    del pool
    gc.collect()
    assert not reg.live, "a pool dropped without close() left its memory page-locked"


def test_close_during_background_registration_leaves_nothing_registered():
    reg = StandIn(delay=0.01)
    pool = _pool(128 * MiB, reg, pin_step=2 * MiB)
    time.sleep(0.03)
    pool.close()
    time.sleep(0.05)
    assert not reg.live and not reg.errors, (reg.live, reg.errors)


def test_pinned_memory_is_usable_and_pageable_pools_never_register():
    reg = StandIn()
    pool = _pool(6 * MiB, reg)
    with pool.allocate((1024,), torch.int64) as o:
        o.tensor.copy_(torch.arange(1024))
        assert int(o.tensor.sum()) == 1023 * 1024 // 2
    pool.close()
    plain = MemoryPool(6 * MiB, "false", registrar=reg)
    assert plain.stats()["pinned"] == 0
    n = len(reg.calls)
    plain.close()
    assert len(reg.calls) == n


def test_host_alloc_and_pinner_arguments():
    t, kind = pf.host_alloc(3 * MiB + 1)
    assert t.numel() == 4 * MiB and t.data_ptr() % pf.HUGE == 0
    assert kind in ("hugetlb", "thp", "4k")
    with pytest.raises(ValueError, match="multiple of 2 MiB"):
        pf.Pinner(t, StandIn(), step=3 * MiB)
    with pytest.raises(ValueError, match="alignment must divide 2 MiB"):
        MemoryPool(8 * MiB, "true", registrar=StandIn(), align=3 * 4096)


class _FakeRuntime:
    """cudaPointerGetAttributes over a list of registrations, each mapped at ``shift`` plus
    its own offset (registrations whose device ranges are not adjacent)."""

    memoryTypeHost = 1

    class CUDARuntimeError(Exception):
        pass

    def __init__(self, regs: list[tuple[int, int, int]]) -> None:
        self.regs = regs  # (host address, bytes, device address)

    def pointerGetAttributes(self, addr: int):  # noqa: N802 - CUDA's name
        for a, n, d in self.regs:
            if a <= addr < a + n:
                return type("A", (), {"type": 1, "devicePointer": d + addr - a})()
        raise self.CUDARuntimeError("cudaErrorInvalidValue")


def test_a_buffer_across_two_registrations_is_staged_unless_mapped_as_one():
    """The kernel reaches a 'direct' buffer through the device address of its first byte; a
    chunk across two registered steps is safe there only if the two map contiguously, else
    it takes the staged path (a copy engine reads any host range)."""
    from lmc.transfer.cuda_copy import CupyBackend

    be = object.__new__(CupyBackend)
    be.device = torch.device("cuda", 0)
    buf = torch.empty(4 * MiB, dtype=torch.uint8)
    a = buf.data_ptr()
    half = 2 * MiB
    be._rt = _FakeRuntime([(a, half, 1 << 40), (a + half, half, (1 << 40) + half)])
    assert be.locate(buf) == ("mapped", 1 << 40)
    be._rt = _FakeRuntime([(a, half, 1 << 40), (a + half, half, 1 << 41)])
    assert be.locate(buf) == ("host", 0)
    assert be.locate(buf[: half]) == ("mapped", 1 << 40)
    be._rt = _FakeRuntime([(a, half, 1 << 40)])  # its tail not page-locked at all
    assert be.locate(buf) == ("host", 0)
    be._rt = _FakeRuntime([])
    assert be.locate(buf) == ("host", 0)


@pytest.mark.gpu
def test_gpu_pool_is_page_locked_through_the_cuda_runtime():
    """On a GPU: the real cudaHostRegister, 65 MiB asked pins 66 MiB (not 128), the pool's
    tensors are pinned for torch, a copy to the device is exact, close unregisters."""
    pool = MemoryPool(65 * MiB, "true", prefault="now")
    st = pool.stats()
    assert st["pinned_bytes"] == 66 * MiB and st["pinned_asked"] == 65 * MiB
    with pool.allocate((8 * MiB,), torch.uint8) as o:
        assert o.tensor.is_pinned()
        o.tensor.copy_(torch.arange(8 * MiB, dtype=torch.int64).to(torch.uint8))
        dev = o.tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), o.tensor)
    pool.close()
    assert not pool.buffer.is_pinned(), "close() left the pool page-locked"


@settings(max_examples=25)
@given(size_mib=st.integers(1, 40), extra=st.integers(0, 4095),
       step_mib=st.sampled_from([2, 4, 6, 8]), fail_at=st.one_of(st.none(), st.integers(1, 12)),
       mode=st.sampled_from(["now", "background"]),
       allocs=st.lists(st.integers(1, 6 * MiB), max_size=6))
def test_property_pinning_never_overpins_leaks_or_hands_out_unpinned(size_mib, extra, step_mib,
                                                                      fail_at, mode, allocs):
    """Any size, step, failure point and allocation sequence: registered ranges are disjoint
    steps, never past the size rounded up to 2 MiB, covering the pinned front; every block
    handed out lies inside that front (else the allocation raised PinError and
    kept nothing); close (or a failed constructor) leaves nothing registered."""
    size = size_mib * MiB + extra
    reg = StandIn(fail_at=fail_at)
    try:
        pool = _pool(size, reg, prefault=mode, pin_step=step_mib * MiB)
    except pf.PinError:
        assert not reg.live and not reg.errors, (reg.live, reg.errors)
        return
    held = []
    try:
        for n in allocs:
            try:
                o = pool.allocate((n,), torch.uint8)
            except pf.PinError:
                continue
            if o is None:
                continue
            held.append(o)
            assert o.offset + o.nbytes <= pool._prefault.front, "handed out unpinned"
        # steps are claimed in order but two threads may finish them out of order (and one
        # may fail while a later one succeeds): the ranges are disjoint steps inside the
        # rounded size, and the front -- what blocks are handed out from -- is all covered
        ranges = sorted(reg.live.items())
        base, top = pool.buffer.data_ptr(), -(-size // pf.HUGE) * pf.HUGE
        for (a, n), (b, _) in zip(ranges, ranges[1:]):
            assert a + n <= b
        assert all(base <= a and a + n <= base + top for a, n in ranges)
        covered, end = 0, base
        for a, n in ranges:
            if a != end:
                break
            covered, end = covered + n, a + n
        assert covered >= pool._prefault.front
    finally:
        for o in held:
            o.release()
        assert pool.used_bytes == 0, "a refused allocation kept its block"
        pool.close()
    assert not reg.live and not reg.errors, (reg.live, reg.errors)
