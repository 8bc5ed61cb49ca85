"""Completion, ownership and ordering of layer-wise copies, with copies that land late
(tests/late_transfer.py): wait(i) orders after layer i only, load(i) returns with the layer in
the cache, close/abort wait for copies in flight, a save starts after its point on the
engine's stream, plan() never reads device memory back, and the late backend really catches
a missing wait."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.memory.pool import Lease
from lmc.transfer.completion import EventCompletion
from lmc.transfer.cuda_copy import CudaTransfer
from tests.kvutil import assert_bits_equal, make_caches, spec_for, token_kv
from tests.late_transfer import LateCompletion, LateTransfer, late_copies, late_factory, new_seed
from tests.requirements import missing
from tests.transfer import cuda_emulation as emu

SLOTS = torch.arange(48)


def _late_setup(seed: int = 0):
    """An engine whose copies all go through one LateTransfer (and its ``hold`` gates)."""
    src = make_caches("vllm_flash", layers=4, blocks=32, block_size=4, dtype=torch.bfloat16)
    dst = make_caches("vllm_flash", layers=4, blocks=32, block_size=4, dtype=torch.bfloat16,
                      zeros=True)
    spec = spec_for("vllm_flash", src)
    eng = CacheEngine(CacheConfig(chunk_size=16, local_cpu_size="4MiB"), spec, "m",
                      transfer=late_factory(seed))
    return eng, spec, src, dst, list(range(100, 148))


def test_wait_orders_after_that_layer_only():
    with late_copies(new_seed()) as watch:
        eng, spec, src, dst, toks = _late_setup()
        with eng:
            eng.store(toks, src, SLOTS)
            tr = eng.transfer_for(dst)
            gate = tr.hold[(3,)] = threading.Event()  # layer 3 lands only when released
            rt = eng.retrieve_layer(toks, dst, SLOTS).start()
            for layer in range(3):
                rt.wait(layer)
                assert_bits_equal(token_kv(spec, dst, SLOTS)[layer],
                                  token_kv(spec, src, SLOTS)[layer], f"layer {layer}")
            assert not rt._handles[3].done()
            assert torch.isnan(token_kv(spec, dst, SLOTS)[3].float()).all(), "in flight: poison"
            gate.set()
            rt.wait(3)
            assert_bits_equal(token_kv(spec, dst, SLOTS)[3], token_kv(spec, src, SLOTS)[3], "3")
            assert rt.close() == 48
    watch.check()


def test_load_returns_with_the_layer_in_the_cache():
    with late_copies(new_seed()) as watch:
        eng, spec, src, dst, toks = _late_setup()
        with eng:
            eng.store(toks, src, SLOTS)
            with eng.retrieve_layer(toks, dst, SLOTS) as rt:
                for layer in reversed(range(spec.num_layers)):
                    rt.load(layer)
                    assert_bits_equal(token_kv(spec, dst, SLOTS)[layer],
                                      token_kv(spec, src, SLOTS)[layer], f"layer {layer}")
    watch.check()


def test_close_and_abort_wait_for_copies_in_flight():
    with late_copies(new_seed()) as watch:
        eng, spec, src, dst, toks = _late_setup()
        with eng:
            st = eng.store_layer(toks, src, SLOTS)
            for layer in range(spec.num_layers):
                st.save(layer)
            st.abort()  # the gathers are still in flight: abort must wait before freeing
            assert eng.pool.used_bytes == 0 and eng.lookup(toks) == 0
            eng.store(toks, src, SLOTS)
            rt = eng.retrieve_layer(toks, dst, SLOTS).start()
            eng.storage.delete(eng.db.keys(toks))  # the retrieve is now the only owner
            assert rt.close() == 48  # waits, then frees: no copy may read freed memory
            assert eng.pool.used_bytes == 0
            assert_bits_equal(token_kv(spec, dst, SLOTS), token_kv(spec, src, SLOTS),
                              "loads completed before the release")
    watch.check()


def test_save_starts_after_its_point_on_the_engine_stream():
    with late_copies(new_seed()) as watch:
        eng, spec, src, dst, toks = _late_setup()
        with eng:
            st = eng.store_layer(toks, src, SLOTS)
            point = LateCompletion()  # the engine's stream has not reached it yet
            st.save(0, after=point)
            for layer in range(1, spec.num_layers):
                st.save(layer)
            time.sleep(0.02)  # past every random delay: an early gather would have run
            src[0].fill_(7)  # the forward writes layer 0 "after" save() was called...
            point._finish(None)  # ...and only then reaches the recorded point
            assert st.commit() == 48
            with eng.retrieve_layer(toks, dst, SLOTS) as rt:
                for layer in range(spec.num_layers):
                    rt.load(layer)
            assert_bits_equal(token_kv(spec, dst, SLOTS), token_kv(spec, src, SLOTS),
                              "the gather read layer 0 after the point")
    watch.check()


def test_the_late_backend_catches_a_missing_wait():
    """The checks that make the suites meaningful: each broken consumer is caught."""
    with late_copies(new_seed()) as watch:
        eng, spec, src, dst, toks = _late_setup()
        with eng:
            eng.store(toks, src, SLOTS)
            tr = eng.transfer_for(dst)
            tr.hold[(0,)] = gate = threading.Event()
            rt = eng.retrieve_layer(toks, dst, SLOTS).start()
            # 1. reading a layer before waiting for it reads poison, not stale zeros
            rt._handles[0].future.result()  # enqueued, not landed
            assert torch.isnan(token_kv(spec, dst, SLOTS)[0].float()).all()
            # 2. releasing the lease before waiting raises (strict), after waiting for it
            threading.Timer(0.05, gate.set).start()
            with pytest.raises(AssertionError, match="still in flight"):
                rt.lease.release()
            rt.close()
            # 3. freeing pool memory under a copy is a violation, and poisons the memory
            objs = eng.storage.get_prefix(eng.db.keys(toks))
            tr.hold[(1,)] = gate = threading.Event()
            h = tr.scatter(tr.plan(SLOTS, [(0, 16), (16, 32), (32, 48)]),
                           [o.tensor for o in objs], [1])
            eng.storage.delete(eng.db.keys(toks))
            Lease(objs).release()  # early: bypasses CopyLease on purpose
            gate.set()
            h.wait()
            assert torch.isnan(dst[1].float()).any(), "the late copy moved poisoned memory"
    assert watch.violations and "freed under an in-flight scatter" in watch.violations[0]


# ----------------------------------------------------------- plan() never reads the device
_HOST_READS = {torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy,
               torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__,
               torch.Tensor.__float__, torch.Tensor.__array__}


class DeviceOnly(torch.Tensor):
    """A tensor standing for device memory: reading it on the host (a device sync on a GPU)
    raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            raise AssertionError(f"{func.__name__} read a device tensor on the host (a sync)")
        return super().__torch_function__(func, types, args, kwargs or {})


class _PlanBackend(emu.HostStreams):
    """CupyBackend's plan-time calls; what it uploads is 'device' memory."""

    def upload(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(arr.copy()).as_subclass(DeviceOnly)

    def is_host(self, t: torch.Tensor) -> bool:
        return not isinstance(t, DeviceOnly)


def _cuda_transfer():
    caches = make_caches("vllm_flash", layers=2, blocks=8, block_size=4)
    spec = spec_for("vllm_flash", caches)
    return CudaTransfer(spec, caches, backend=_PlanBackend())


def test_plan_from_host_slots_never_reads_the_device():
    tr = _cuda_transfer()
    slots = torch.tensor([4, 5, 6, 7, 9, -1, 30, 31])
    plan = tr.plan(slots, [(0, 4), (4, 8)])
    tokens = plan.tokens.as_subclass(torch.Tensor)
    assert tokens[0].tolist() == slots.tolist() and plan.holes == [False, True]
    with pytest.raises(ValueError, match="slot 32"):
        tr.plan(torch.tensor([1, 32]), [(0, 2)])


def test_plan_from_device_slots_never_reads_them_back():
    tr = _cuda_transfer()
    slots = torch.tensor([4, 5, 6, 7, 9, -1, 32, 31]).as_subclass(DeviceOnly)
    plan = tr.plan(slots, [(0, 4), (4, 8)])  # no ValueError: that would need a read
    tokens = plan.tokens.as_subclass(torch.Tensor)
    assert tokens[0].tolist() == [4, 5, 6, 7, 9, -1, -1, 31], "past the cache: skipped"
    assert plan.holes == [True, True]  # unknown without a read: staged gathers pre-load
    bad = plan.bad_slots.as_subclass(torch.Tensor)
    with pytest.raises(ValueError, match="past the end of the KV cache"):
        EventCompletion(None, bad).wait()  # reported at the host wait, after the copy


# ------------------------------------------------- the kernel path, layer-wise and late
class _LockedHostBackend(emu.HostBackend):
    """Late copies run on several threads; the emulation's access checks are global."""

    lock = threading.Lock()

    def launch(self, *args) -> None:
        with self.lock:
            super().launch(*args)


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    if emu.compiler() is None:
        missing("no C++ compiler (g++ or clang++): the kernel code cannot run on the host")
    return emu.build(tmp_path_factory.mktemp("emu"))


def test_layerwise_through_the_emulated_kernels(emu_lib):
    """CudaTransfer (its kernels compiled for the host) under the layer-wise forms, every
    copy late: ``after=``/``stream=`` reach the kernel path and its handles are honoured."""
    def make(spec, caches):
        backend = _LockedHostBackend(emu_lib, caches=list(caches))
        return LateTransfer(CudaTransfer(spec, caches, backend=backend), seed=1)

    with late_copies(new_seed()) as watch:
        src = make_caches("vllm_flash", layers=4, blocks=32, block_size=4)
        dst = make_caches("vllm_flash", layers=4, blocks=32, block_size=4, zeros=True)
        spec = spec_for("vllm_flash", src)
        toks = list(range(100, 148))
        with CacheEngine(CacheConfig(chunk_size=16, local_cpu_size="4MiB"), spec, "m",
                         transfer=make) as eng:
            st = eng.store_layer(toks, src, SLOTS)
            for layer in range(spec.num_layers):
                st.save(layer)
            assert st.commit() == 48
            slots2 = torch.arange(64, 112)
            with eng.retrieve_layer(toks, dst, slots2) as rt:
                rt.start()
                for layer in range(spec.num_layers):
                    rt.wait(layer)
                    assert_bits_equal(token_kv(spec, dst, slots2)[layer],
                                      token_kv(spec, src, SLOTS)[layer], f"layer {layer}")
    watch.check()
