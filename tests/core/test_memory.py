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
