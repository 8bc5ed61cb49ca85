"""Memory pool and objects: views, reference counting, leases, leak reports."""

from __future__ import annotations

import gc

import pytest
import torch

from lmc.memory import Lease, MemoryPool


def test_objects_are_disjoint_aligned_views():
    pool = MemoryPool(1 << 20, pin_memory=False)
    a = pool.allocate((2, 3, 100), torch.float16, 3)
    b = pool.allocate((5000,), torch.float32, 0)
    a.tensor.fill_(1.5)
    b.tensor.fill_(-2.0)
    assert bool((a.tensor == 1.5).all()) and bool((b.tensor == -2.0).all())
    assert a.tensor.data_ptr() % 4096 == 0 and b.tensor.data_ptr() % 4096 == 0
    assert a.tensor.is_contiguous() and a.tensor.shape == (2, 3, 100)
    assert a.num_tokens == 3
    a.release()
    b.release()
    assert pool.used_bytes == 0


def test_refcount_frees_at_zero_and_rejects_double_release():
    pool = MemoryPool(1 << 16, pin_memory=False)
    o = pool.allocate((1024,), torch.uint8)
    o.acquire()
    o.release()
    assert pool.used_bytes == 4096
    with o:
        pass
    assert pool.used_bytes == 0
    with pytest.raises(RuntimeError, match="already freed"):
        o.release()
    with pytest.raises(RuntimeError, match="already freed"):
        o.acquire()


def test_exhaustion_returns_none():
    pool = MemoryPool(1 << 16, pin_memory=False)
    objs = [pool.allocate((4096,), torch.uint8) for _ in range(16)]
    assert all(objs) and pool.allocate((1,), torch.uint8) is None
    Lease(objs).release()
    assert pool.allocate((1 << 16,), torch.uint8) is not None


def test_debug_mode_reports_leak_with_allocation_site_and_reclaims():
    pool = MemoryPool(1 << 16, pin_memory=False, debug=True)

    def leaky_function():
        pool.allocate((100,), torch.uint8)  # dropped while still referenced

    leaky_function()
    gc.collect()
    assert len(pool.leaks) == 1
    assert "leaky_function" in pool.leaks[0]
    assert pool.used_bytes == 0, "a leaked object's memory is reclaimed"


def test_debug_outstanding_lists_live_objects():
    pool = MemoryPool(1 << 16, pin_memory=False, debug=True)
    o = pool.allocate((10,), torch.uint8)
    live = pool.outstanding()
    assert len(live) == 1 and live[0][0] is o and "test_debug_outstanding" in live[0][1]
    o.release()
    assert pool.outstanding() == []


def test_pin_true_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning is allowed here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        MemoryPool(1 << 16, pin_memory=True)


def test_allocate_many_on_fragmented_pool_gives_each_object_its_own_block():
    """Regression: a fragmented pool returned blocks [0, 10, 2] (units); the batch's views were
    built as if contiguous because first and last were evenly spaced, so the middle object
    wrote into block 1, a live chunk."""
    unit = 4096
    pool = MemoryPool(12 * unit, pin_memory=False)
    singles = [pool.allocate((unit,), torch.uint8) for _ in range(12)]
    assert [o.offset for o in singles] == [i * unit for i in range(12)]
    for i, o in enumerate(singles):
        o.tensor.fill_(i)
    for i in (0, 10, 2):  # three free single units, none adjacent: no batch block fits
        singles[i].release()
    batch = pool.allocate_many((unit,), torch.uint8, 3)
    offs = [o.offset for o in batch]
    assert sorted(offs) == [0, 2 * unit, 10 * unit]
    assert offs != sorted(offs) or offs[1] - offs[0] != offs[2] - offs[1], \
        "the allocator no longer fragments this way: rebuild the scenario"
    base = pool.buffer.data_ptr()
    for j, o in enumerate(batch):
        assert o.tensor.data_ptr() == base + o.offset
        o.tensor.fill_(100 + j)
    for i, o in enumerate(singles):  # every live neighbour kept its bytes
        if i not in (0, 10, 2):
            assert bool((o.tensor == i).all()), f"live block {i} was overwritten"
    for j, o in enumerate(batch):
        assert bool((pool.buffer[o.offset: o.offset + unit] == 100 + j).all())
