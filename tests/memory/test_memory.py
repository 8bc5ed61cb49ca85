"""Memory pool and objects: views, reference counting, leases, leak reports."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from lmc.memory import invariants
from lmc.memory.invariants import InvariantError
from lmc.memory.pool import Lease, MemoryPool
from lmc.memory.tlsf import CheckedTLSFAllocator, TLSFAllocator


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
    whole = pool.allocate((1 << 16,), torch.uint8)
    assert whole is not None
    whole.release()


@pytest.mark.leaks_expected
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


def test_byte_view_is_the_objects_bytes_and_refuses_a_freed_object():
    pool = MemoryPool(1 << 16, pin_memory=False)
    a = pool.allocate((100,), torch.float32)
    b = pool.allocate((10,), torch.uint8)
    a.tensor.copy_(torch.arange(100, dtype=torch.float32))
    mv = a.byte_view()
    assert len(mv) == 400 and bytes(mv) == a.tensor.numpy().tobytes()
    mv[:4] = torch.tensor([7.0]).numpy().tobytes()  # writable, zero-copy
    assert float(a.tensor[0]) == 7.0
    assert len(a.byte_view(4096)) == 4096  # padded to its block (O_DIRECT)
    with pytest.raises(ValueError, match="runs past its 4096 B block"):
        a.byte_view(4097)
    a.release()
    with pytest.raises(RuntimeError, match="after its last release"):
        a.byte_view()
    b.release()


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
    arrays = pool.arrays(batch)  # batch views: made together on first use
    for j, (o, t) in enumerate(zip(batch, pool.tensors(batch))):
        assert t.data_ptr() == base + o.offset == arrays[j].__array_interface__["data"][0]
        t.fill_(100 + j)
    for i, o in enumerate(singles):  # every live neighbour kept its bytes
        if i not in (0, 10, 2):
            assert bool((o.tensor == i).all()), f"live block {i} was overwritten"
    for j, o in enumerate(batch):
        assert bool((pool.buffer[o.offset: o.offset + unit] == 100 + j).all())
    Lease(batch + [o for i, o in enumerate(singles) if i not in (0, 10, 2)]).release()
    assert pool.used_bytes == 0


def test_batch_views_of_spaced_neighbours_mixed_with_cached_and_foreign_objects():
    """``tensors()`` / ``arrays()`` make a run's views in one go: objects smaller than their
    block (evenly spaced with gaps), one whose view already exists, one of a shorter shape
    and one of another pool in the same list each get exactly their own bytes."""
    pool = MemoryPool(1 << 20, pin_memory=False)
    other = MemoryPool(1 << 16, pin_memory=False)
    objs = pool.allocate_many((5000,), torch.uint8, 5)  # 8 KiB blocks: 3192 B gaps
    assert [o.offset for o in objs] == [i * 8192 for i in range(5)]
    cached = objs[2].tensor
    short = pool.allocate((100,), torch.uint8)
    foreign = other.allocate((300,), torch.uint8)
    batch = objs[:3] + [short] + objs[3:] + [foreign]
    tensors = pool.tensors(batch)
    arrays = pool.arrays(batch)
    assert tensors[2] is cached
    pool.buffer.fill_(0)
    for j, (o, t, a) in enumerate(zip(batch, tensors, arrays)):
        assert tuple(t.shape) == a.shape == o.shape and t.is_contiguous()
        assert a.flags.c_contiguous and a.dtype == np.uint8
        assert o.tensor is t and o.array is a  # cached on the objects
        a[:] = j + 1  # through the array, read back through the tensor
        assert bool((t == j + 1).all())
    for j, o in enumerate(batch[:-1]):
        block = pool.buffer[o.offset: o.offset + 8192].numpy()
        assert (block[: o.nbytes] == j + 1).all() and (block[o.nbytes:] == 0).all()
    Lease(batch[:-1]).release()
    foreign.release()
    with pytest.raises(RuntimeError, match="after its last release"):
        pool.arrays([objs[0]])
    pool.close()
    other.close()


# ------------------------------------------------------------------ invariant mode
def test_invariant_mode_follows_the_environment_and_costs_nothing_off(monkeypatch):
    monkeypatch.setenv(invariants.ENV, "1")
    on = MemoryPool(1 << 16, pin_memory=False)
    monkeypatch.setenv(invariants.ENV, "0")
    off = MemoryPool(1 << 16, pin_memory=False)
    assert on.invariants and type(on.allocator) is CheckedTLSFAllocator
    assert not off.invariants and type(off.allocator) is TLSFAllocator
    o = off.allocate((10,), torch.uint8)
    assert o.site is None and off.outstanding() == []  # no sites, no tracking when off
    o.release()


def test_invariant_mode_poisons_freed_blocks_so_use_after_release_reads_garbage(monkeypatch):
    pool = MemoryPool(1 << 16, pin_memory=False, invariants=True)
    keep = pool.allocate((1024,), torch.float32)
    o = pool.allocate((2000,), torch.float16)
    keep.tensor.fill_(3.0)
    stale = o.tensor  # a view someone kept past the release
    stale.fill_(1.0)
    o.release()
    assert bool(stale.isnan().all()), "freed KV still read as valid values"
    assert bool((pool.buffer[o.offset: o.offset + 4096] == 0xFF).all())  # its whole block
    assert bool((keep.tensor == 3.0).all()), "poisoning reached a live neighbour"
    keep.release()
    monkeypatch.setenv(invariants.ENV, "0")
    off = MemoryPool(1 << 16, pin_memory=False)
    o = off.allocate((100,), torch.float16)
    o.tensor.fill_(1.0)
    stale = o.tensor
    o.release()
    assert bool((stale == 1.0).all()), "the mode off must not pay for poisoning"


def test_invariant_mode_catches_a_batch_view_at_the_wrong_address(monkeypatch):
    """The bug class of the fragmented-pool regression: a batch of objects whose views were
    built as if their blocks were neighbours. Forced here by a view one block off."""
    pool = MemoryPool(1 << 16, pin_memory=False, invariants=True)
    real_view = pool.view

    def shifted(offset, shape, dtype):
        return real_view(offset + 4096, shape, dtype)

    monkeypatch.setattr(pool, "view", shifted)
    objs = pool.allocate_many((4096,), torch.uint8, 2)
    with pytest.raises(InvariantError, match=r"starts at pool\+4096 \(want pool\+0\)"):
        pool.tensors(objs)  # views are made in a batch on first use
    assert any("want pool+0" in v for v in invariants.take())
    pool.close()
    invariants.take()  # the batch never reached a caller: its references are this test's


def test_invariant_mode_catches_a_batch_array_at_the_wrong_address(monkeypatch):
    """The same for the numpy views CPU copies use (made from the pool's buffer, not from a
    tensor): one block off fails, for a batch of neighbours and for a single object."""
    pool = MemoryPool(1 << 16, pin_memory=False, invariants=True)
    real = pool._typed_array
    monkeypatch.setattr(pool, "_typed_array", lambda item: real(item)[4096 // item:])
    objs = pool.allocate_many((1024,), torch.float32, 3)
    with pytest.raises(InvariantError, match=r"starts at pool\+4096 \(want pool\+0\)"):
        pool.arrays(objs)
    with pytest.raises(InvariantError, match=r"array of .* \(want pool\+4096\)"):
        objs[1].array  # noqa: B018 - made on first access
    invariants.take()
    pool.release_many(objs)
    pool.close()


def test_invariant_mode_catches_a_view_longer_than_its_object(monkeypatch):
    pool = MemoryPool(1 << 16, pin_memory=False, invariants=True)
    o = pool.allocate((100,), torch.uint8)
    real_view = pool.view
    monkeypatch.setattr(pool, "view", lambda off, shape, dtype: real_view(off, (200,), dtype))
    with pytest.raises(InvariantError, match="spans 200 B \\(want 100\\)"):
        o.tensor  # noqa: B018 - the view is made on first access
    invariants.take()
    o.release()


def test_allocator_check_catches_overlapping_blocks(monkeypatch):
    a = CheckedTLSFAllocator(1 << 20, align=4096)
    first = a.allocate(3 * 4096)
    assert first == 0
    # a corrupted free list: the block just handed out is offered again, one unit in
    a._insert(1, 2)
    with pytest.raises(InvariantError, match=r"\[1, 3\), overlapping the live block \[0, 3\)"):
        while True:  # drain the real free block first; the corrupt one comes up in its class
            off = a.allocate(2 * 4096)
            assert off is not None, "the corrupt block was never handed out"
    invariants.take()


def test_allocator_check_catches_a_live_block_handed_out_again():
    """The same start twice is the worst overlap of all; the batch path must not hide it."""
    a = CheckedTLSFAllocator(1 << 20, align=4096)
    assert a.allocate(4096) == 0
    a._insert(0, 1)  # corrupted free list: the live block is offered again
    with pytest.raises(InvariantError, match=r"\[0, 1\), whose start is already a live"):
        a.allocate(4096)
    invariants.take()
    b = CheckedTLSFAllocator(1 << 20, align=4096)
    assert b.allocate_many(4096, 2) == [0, 4096]
    b._insert(1, 1)
    with pytest.raises(InvariantError, match=r"\[1, 2\), whose start is already a live"):
        b.allocate_many(4096, 1)
    invariants.take()


def test_checked_allocator_agrees_with_plain_one_under_churn():
    import random

    rng = random.Random(7)
    plain, checked = TLSFAllocator(4 << 20), CheckedTLSFAllocator(4 << 20)
    live: list[int] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = live.pop(rng.randrange(len(live)))
            plain.free(off)
            checked.free(off)
        else:
            n, count = rng.randint(1, 60_000), rng.randint(1, 4)
            got = plain.allocate_many(n, count)
            assert checked.allocate_many(n, count) == got
            live += got
    assert checked._starts == sorted(o // 4096 for o in live)


@pytest.mark.leaks_expected
def test_close_with_references_held_reports_each_with_its_site():
    pool = MemoryPool(1 << 16, pin_memory=False, invariants=True)

    def forgets_to_release():
        return pool.allocate((10,), torch.uint8)

    kept = forgets_to_release()
    done = pool.allocate((10,), torch.uint8)
    done.release()
    pool.close()
    found = invariants.take()
    assert len(found) == 1 and len(pool.leaks) == 1
    assert "1 object(s) still referenced" in found[0]
    assert "forgets_to_release" in found[0] and "offset=0" in found[0]
    kept.release()  # after close: nothing to free, nothing reported twice
    assert invariants.take() == []


def test_close_with_references_held_is_reported_even_untracked(monkeypatch, caplog):
    """Production pools record no sites, but a close with references held still says so."""
    monkeypatch.setenv(invariants.ENV, "0")
    pool = MemoryPool(1 << 16, pin_memory=False)
    kept = [pool.allocate((10,), torch.uint8) for _ in range(3)]
    with caplog.at_level("WARNING", logger="lmc.memory.pool"):
        pool.close()
    assert len(pool.leaks) == 1 and "3 block(s) still referenced" in pool.leaks[0]
    assert "debug_leaks" in caplog.text
    Lease(kept).release()
    clean = MemoryPool(1 << 16, pin_memory=False)
    clean.allocate((10,), torch.uint8).release()
    clean.close()
    assert clean.leaks == []


def test_the_harness_fails_a_test_that_leaks_and_names_the_site(pytester):
    """tests/conftest.py's fixture, run on two small tests of its own: the one that closes a
    pool with a reference held fails at teardown; the marked one passes."""
    from pathlib import Path

    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_leaky="""
        import pytest, torch
        from lmc.memory.pool import MemoryPool

        def leaky_helper(pool):
            return pool.allocate((10,), torch.uint8)

        def test_leaks():
            pool = MemoryPool(1 << 16, pin_memory=False)
            leaky_helper(pool)
            pool.close()

        KEPT = []

        def test_dropped_while_referenced():
            KEPT.append(MemoryPool(1 << 16, pin_memory=False))  # the pool lives on
            leaky_helper(KEPT[0])

        def test_dropped_whole_without_close_is_no_leak():
            pool = MemoryPool(1 << 16, pin_memory=False)
            held = leaky_helper(pool)  # an owner dropped with its pool: nothing lost

        @pytest.mark.leaks_expected
        def test_leaks_on_purpose():
            pool = MemoryPool(1 << 16, pin_memory=False)
            leaky_helper(pool)
            pool.close()
    """)
    res = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    res.assert_outcomes(passed=4, errors=2)
    res.stdout.fnmatch_lines(["*pool invariant violation*", "*in leaky_helper*"])


def test_the_harness_fails_the_run_on_a_violation_outside_any_test(pytester):
    """A module fixture's teardown that closes a pool with a reference held belongs to no
    test; the run still fails and says so."""
    from pathlib import Path

    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_fixture_leak="""
        import pytest, torch
        from lmc.memory.pool import MemoryPool

        @pytest.fixture(scope="module")
        def pool():
            p = MemoryPool(1 << 16, pin_memory=False)
            held = p.allocate((10,), torch.uint8)
            yield p
            p.close()  # held is still referenced

        def test_uses_the_pool(pool):
            pool.allocate((10,), torch.uint8).release()
    """)
    res = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    res.assert_outcomes(passed=1)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(["*1 pool invariant violation(s) outside any test*",
                              "*still referenced*"])


def test_batch_made_objects_are_those_init_makes():
    """``MemoryObj.batch`` (what allocate_many uses) sets every slot as ``__init__`` does."""
    from lmc.memory.pool import MemoryObj

    pool = MemoryPool(1 << 16, pin_memory=False)
    made = MemoryObj.batch(pool, [0, 4096], 100, (10, 10), torch.uint8, 7, None)
    ref = MemoryObj(pool, 4096, 100, (10, 10), torch.uint8, 7, None)
    slots = [s for s in MemoryObj.__slots__ if s != "__weakref__"]
    assert [getattr(made[1], s) for s in slots] == [getattr(ref, s) for s in slots]
    assert made[0].offset == 0 and made[0].ref_count == 1
    for o in (*made, ref):
        o._refs = 0  # never allocated from the pool: nothing to free
    pool.close()


def test_the_harness_still_catches_a_leak_only_the_collector_finds(pytester):
    """tests/conftest.py freezes the objects that exist after collection (gc.freeze) and
    collects after each pool-making test: an object dropped while referenced inside a
    reference cycle made by the test (freed only by the collector, never by refcounting) must
    still fail that test. A fresh process, so that the freeze happens as in a real run."""
    from pathlib import Path

    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_cycle_leak="""
        import gc, torch
        from lmc.memory.pool import MemoryPool

        KEPT = []

        def test_session_objects_are_frozen():
            assert gc.get_freeze_count() > 100_000

        def test_dropped_in_a_cycle_while_referenced():
            KEPT.append(MemoryPool(1 << 16, pin_memory=False))  # the pool lives on
            box = [KEPT[0].allocate((10,), torch.uint8)]
            box.append(box)  # a cycle: only gc.collect() frees the object

        def test_a_clean_test_after_it():
            pool = MemoryPool(1 << 16, pin_memory=False)
            pool.allocate((10,), torch.uint8).release()
            pool.close()
    """)
    res = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=120)
    res.assert_outcomes(passed=3, errors=1)
    res.stdout.fnmatch_lines(["*ERROR at teardown of test_dropped_in_a_cycle_while_referenced*",
                              "*pool invariant violation*"])
