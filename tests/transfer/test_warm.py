"""lmc.transfer.warm: a new cache's copies are warmed on a scratch cache, never on the engine's.

The kernels run on the host (tests/transfer/cuda_emulation.py), every access checked against
the regions a test registers: a warm-up touching the engine's cache, or any memory it was not
given, fails the launch.
"""

from __future__ import annotations

import logging

import pytest
import torch

from lmc.config import CacheConfig
from lmc.transfer import cuda_copy as ct
from lmc.transfer.kv_spec import KVSpec
from lmc.transfer.torch_copy import TorchTransfer
from lmc.transfer.warm import scratch_caches, warm_up
from tests.kvutil import assert_bits_equal, make_caches, spec_for
from tests.requirements import missing
from tests.transfer import cuda_emulation as emu


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    if emu.compiler() is None:
        missing("no C++ compiler (g++ or clang++): the kernel code cannot run on the host")
    return emu.build(tmp_path_factory.mktemp("emu"))


def _flat(caches) -> list[torch.Tensor]:
    if isinstance(caches, tuple):
        return [*caches[0], *caches[1]]
    return list(caches)


class ScratchOnly(emu.HostBackend):
    """The emulation, with the engine's cache *read-only* for the kernels: a warm-up that
    wrote it would fail its launch."""

    def __init__(self, lib, engine, scratch) -> None:
        super().__init__(lib, caches=_flat(scratch))
        self.engine = _flat(engine)

    def launch(self, name, blocks, args, stream) -> None:
        self.virtual = [emu.storage_region(t, False) for t in self.engine]
        super().launch(name, blocks, args, stream)


@pytest.mark.parametrize("layout", ["vllm_flash", "vllm_gpu", "sglang_mha", "vllm_mla"])
@pytest.mark.parametrize("modes", [("direct", "direct"), ("staged", "staged"),
                                   ("direct", "staged")])
def test_warm_up_runs_every_shape_on_a_scratch_cache(emu_lib, layout, modes):
    caches = make_caches(layout, layers=3, dtype=torch.bfloat16, blocks=8)
    before = [t.clone() for t in _flat(caches)]
    spec = spec_for(layout, caches)
    scratch = scratch_caches(spec, 3, torch.device("cpu"))
    backend = ScratchOnly(emu_lib, caches, scratch)
    tr = ct.CudaTransfer(spec, caches, backend=backend, gather_mode=modes[0],
                         scatter_mode=modes[1])
    secs = warm_up(tr, scratch=scratch, backend=backend)
    assert secs is not None and secs >= 0
    names = [n for n, _ in backend.launches]
    assert sum("gather" in n for n in names) == 2, names  # one layer, then every layer
    assert sum("scatter" in n for n in names) == 2, names
    for t, b in zip(_flat(caches), before, strict=True):
        assert_bits_equal(t, b, "the engine's cache after a warm-up")
    # the scratch is the engine's geometry with a few blocks, in its container form
    assert type(scratch) is type(caches)
    assert KVSpec.from_tensors(scratch, layout).geometry_only() == spec.geometry_only()


def test_warm_up_has_nothing_to_do_on_the_cpu_path():
    caches = make_caches("vllm_flash")
    assert warm_up(TorchTransfer(spec_for("vllm_flash", caches), caches)) is None


def test_a_failed_warm_up_is_logged_and_the_cache_still_binds(emu_lib, caplog):
    """The emulation refuses the scratch cache warm_up makes itself (not a region it knows):
    the warm-up fails, the engine logs it without a traceback and binds the cache anyway;
    its copies then work."""
    from lmc.cache_engine import CacheEngine

    caches = make_caches("vllm_flash", layers=2, dtype=torch.float32, blocks=8)
    spec = spec_for("vllm_flash", caches)
    made: list[ct.CudaTransfer] = []

    def factory(s, c):
        made.append(ct.CudaTransfer(s, c, backend=emu.HostBackend(emu_lib, caches=list(c))))
        return made[-1]

    eng = CacheEngine(CacheConfig(chunk_size=8, local_cpu_size=8 << 20), spec, "m",
                      transfer=factory)
    try:
        with caplog.at_level(logging.WARNING, logger="lmc.cache_engine"):
            tr = eng.transfer_for(caches)
        assert tr is made[0]
        warned = [r for r in caplog.records if "warming the copies" in r.getMessage()]
        assert len(warned) == 1 and warned[0].exc_info is None, caplog.text
        assert "first request pays" in warned[0].getMessage()
        tokens = list(range(16))
        slots = torch.arange(16)
        assert eng.store(tokens, caches, slots) == 16
        want = [t.clone() for t in caches]
        for t in caches:
            t.zero_()
        assert eng.retrieve(tokens, caches, slots) == 16
        for t, w in zip(caches, want, strict=True):
            assert_bits_equal(t[:, :4], w[:, :4], "retrieved after a failed warm-up")
    finally:
        eng.close()


@pytest.mark.gpu
def test_gpu_warm_up_at_binding_leaves_the_cache_as_it_was(caplog):
    from lmc.cache_engine import CacheEngine

    caches = make_caches("vllm_flash", layers=4, heads=8, dim=128, blocks=64, block_size=16,
                         dtype=torch.bfloat16, device="cuda")
    before = [t.clone() for t in caches]
    spec = spec_for("vllm_flash", caches)
    eng = CacheEngine(CacheConfig(chunk_size=256, local_cpu_size=256 << 20), spec, "m")
    try:
        with caplog.at_level(logging.INFO, logger="lmc.cache_engine"):
            tr = eng.transfer_for(caches)
        assert isinstance(tr, ct.CudaTransfer)
        assert any("ready in" in r.getMessage() for r in caplog.records), caplog.text
        torch.cuda.synchronize()
        for t, b in zip(caches, before, strict=True):
            assert_bits_equal(t, b, "the engine's cache after a warm-up")
        assert warm_up(tr) is not None  # a second one (the kernels loaded): still exact
        torch.cuda.synchronize()
        for t, b in zip(caches, before, strict=True):
            assert_bits_equal(t, b, "the engine's cache after a second warm-up")
    finally:
        eng.close()
