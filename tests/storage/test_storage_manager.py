"""Backend registry and the multi-tier prefix logic (two real CPU tiers)."""

from __future__ import annotations

import logging

import pytest
import torch

from lmc import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.manager import StorageManager
from lmc.storage.tier import StorageBackend, backend_factory, create_backend


def test_registry_finds_backends_by_name_and_rejects_unknown():
    from lmc.storage.backends.cpu import CPUBackend

    assert backend_factory("cpu") is CPUBackend
    with pytest.raises(ValueError, match="unknown storage backend 'tape'"):
        backend_factory("tape")
    with pytest.raises(ValueError, match="no storage backend handles URL scheme 'ftp'"):
        backend_factory("ftp://x")


def _tier(size=1 << 20):
    cfg = CacheConfig(local_cpu_size=size)
    pool = MemoryPool(size, pin_memory=False)
    return create_backend("cpu", cfg, pool), pool


def _obj(pool, val):
    o = pool.allocate((8,), torch.float32, 1)
    o.tensor.fill_(val)
    return o


def test_prefix_spans_tiers_and_stops_at_first_gap():
    (l1, p1), (l2, p2) = _tier(), _tier()
    sm = StorageManager([l1, l2])
    keys = [bytes([i]) * 16 for i in range(5)]
    for tier, pool, idx in [(l1, p1, [0, 3]), (l2, p2, [1, 2])]:
        objs = [_obj(pool, i) for i in idx]
        tier.put([keys[i] for i in idx], objs)
        for o in objs:
            o.release()
    assert sm.prefix_hits(keys) == 4
    got = sm.get_prefix(keys)
    assert [float(o.tensor[0]) for o in got] == [0, 1, 2, 3]
    for o in got:
        o.release()
    assert sm.prefix_hits(keys[1:]) == 3 and sm.prefix_hits([keys[4]]) == 0
    sm.close()  # the tiers' own references go back to their pools
    assert p1.used_bytes == 0 and p2.used_bytes == 0


class _Broken(StorageBackend):
    """A tier whose every call fails, as a dead remote would."""

    name = "broken"

    def contains(self, keys):
        raise ConnectionError("down")

    def get(self, keys):
        raise ConnectionError("down")

    def put(self, keys, objs):
        raise ConnectionError("down")

    def delete(self, keys):
        raise ConnectionError("down")


def test_a_failing_tier_is_a_miss_not_an_error():
    l1, p1 = _tier()
    sm = StorageManager([l1, _Broken()])
    k = [b"a" * 16, b"b" * 16]
    o = _obj(p1, 1)
    l1.put(k[:1], [o])
    o.release()
    assert sm.prefix_hits(k) == 1
    got = sm.get_prefix(k)
    assert len(got) == 1
    got[0].release()
    assert sm.delete(k) == 1


def test_first_tier_must_allocate():
    with pytest.raises(TypeError, match="memory tier"):
        StorageManager([_Broken()])


def test_write_through_queues_never_pin_the_whole_pool(tmp_path):
    """Under write-through a queued chunk is also L1's object: referenced until written, so
    unevictable. With a queue as large as the pool and a slow tier, every L1 chunk was
    queued and every later allocation failed until the writer caught up; the queue is
    capped at half the pool, so stores keep room while the tier is slow."""
    from lmc.memory.pool import Lease
    from lmc.storage.manager import TierPool
    from tests.storage.slow_tier import SlowDisk

    unit = 4096
    pool = MemoryPool(16 * unit, pin_memory=False)
    cfg = CacheConfig(local_cpu_size=16 * unit)
    l1 = create_backend("cpu", cfg, pool)
    slow = SlowDisk(config=cfg, pool=TierPool(l1), path=tmp_path, delay=0.2, io_threads=1)
    sm = StorageManager([l1, slow], queue_bytes=1 << 30, close_timeout=0.1)
    assert sm.queues[0].max_bytes == 8 * unit
    objs = sm.allocate_many((unit,), torch.uint8, 16, 1)
    assert len(objs) == 16
    sm.put([bytes([i]) * 16 for i in range(16)], objs)
    Lease(objs).release()
    more = sm.allocate_many((unit,), torch.uint8, 4, 1)
    assert len(more) == 4, "every L1 chunk was held by the write-behind queue"
    Lease(more).release()
    sm.close()
    q = sm.queues[0]
    if q._thread is not None:
        q._thread.join()
    assert pool.used_bytes == 0
    pool.close()


# ------------------------------------------------------------------------ tier_build
class _ToyTier(StorageBackend):
    """A lower tier holding copies in a dict: the smallest real tier, for the builder."""

    def __init__(self, spec: str, *, config: CacheConfig, pool, depth: int = 1,
                 **_: object) -> None:
        self.spec, self.pool, self.depth = spec, pool, depth
        self.data: dict[bytes, tuple[tuple, torch.dtype, int, bytes]] = {}

    def contains(self, keys):
        return [k in self.data for k in keys]

    def get(self, keys):
        out = []
        for k in keys:
            v = self.data.get(k)
            o = None if v is None else self.pool.allocate(v[0], v[1], v[2])
            if o is not None:
                o.byte_view()[:] = v[3]
            out.append(o)
        return out

    def put(self, keys, objs):
        for k, o in zip(keys, objs, strict=True):
            self.data[k] = (o.shape, o.dtype, o.num_tokens, bytes(o.byte_view()))
        return len(keys)

    def delete(self, keys):
        return sum(self.data.pop(k, None) is not None for k in keys)


def _toy_factory():
    from lmc.storage.tier import register_backend

    return register_backend("toy-build", schemes=("toy-build",))(_ToyTier)


def test_build_tiers_orders_tiers_and_passes_remote_options(tmp_path):
    from lmc.storage.backends.cpu import CPUBackend
    from lmc.storage.backends.disk.backend import DiskBackend
    from lmc.storage.chain import build_tiers
    from lmc.storage.manager import TierPool

    _toy_factory()
    cfg = CacheConfig(local_cpu_size=1 << 20, local_disk=str(tmp_path / "d"),
                      local_disk_size="1MiB", remote_url="toy-build://x",
                      remote_options={"depth": 3})
    pool = MemoryPool(1 << 20, pin_memory=False)
    extra = _ToyTier("extra", config=cfg, pool=pool)
    tiers = build_tiers(cfg, pool, [lambda c, p: extra])
    try:
        assert [type(t) for t in tiers] == [CPUBackend, DiskBackend, _ToyTier, _ToyTier]
        assert tiers[2].depth == 3 and tiers[2].spec == "toy-build://x"
        assert isinstance(tiers[1].pool, TierPool) and tiers[1].pool.raw is pool
        sm = StorageManager(tiers)
        key, o = b"k" * 16, pool.allocate((1, 2, 4, 8), torch.float16, 4)
        o.tensor.fill_(2.5)  # 4-D: [layers, planes, tokens, width], as disk stores chunks
        sm.put([key], [o])
        o.release()
        assert sm.flush(10)
        assert tiers[2].contains([key]) == [True] and tiers[1].contains([key]) == [True]
    finally:
        for t in reversed(tiers):
            t.close()
        pool.close()
    assert pool.leaks == []


def test_build_tiers_refuses_an_option_the_backend_does_not_take():
    from lmc.storage.chain import build_tiers

    _toy_factory()
    cfg = CacheConfig(local_cpu_size=1 << 20, remote_url="toy-build://x",
                      remote_options={"dpth": 3})
    pool = MemoryPool(1 << 20, pin_memory=False)
    with pytest.raises(ValueError, match=r"remote_options: _ToyTier has no option 'dpth'; "
                                         r"did you mean 'depth'\?"):
        build_tiers(cfg, pool)
    pool.close()
    assert pool.leaks == []  # the L1 made before the failure was closed


def test_tier_pool_offers_allocation_not_the_pool_internals():
    from lmc.storage.manager import TierPool

    l1, pool = _tier(64 << 10)
    tp = TierPool(l1)
    held = [_obj(pool, i) for i in range(3)]
    l1.put([bytes([i]) * 16 for i in range(3)], held)
    for o in held:
        o.release()
    big = tp.allocate((60 << 10,), torch.uint8)  # only fits by evicting L1's chunks
    assert big is not None and len(l1) == 0
    assert tp.used_bytes == pool.used_bytes and tp.size == pool.size
    for name in ("buffer", "allocator", "byte_buffer", "view"):
        assert not hasattr(tp, name), name
    big.release()
    l1.close()
    pool.close()


def test_a_backend_is_found_by_module_path_without_entry_points(tmp_path, monkeypatch):
    """``register_backend_module``: a tier module found by name and by its URL scheme with
    no package metadata at all (no entry points, no reinstall)."""
    import sys
    from importlib import metadata

    import lmc.storage.tier as sb

    mod = "lmc_test_toy_tier_mod"
    (tmp_path / f"{mod}.py").write_text(
        "from lmc.storage.tier import register_backend\n"
        "from tests.storage.test_storage_manager import _ToyTier\n"
        "@register_backend('toy-mod', schemes=('toymod',))\n"
        "class ModTier(_ToyTier):\n"
        "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(metadata, "entry_points", lambda **_: [])
    monkeypatch.setattr(sb, "BUILTIN_BACKENDS", dict(sb.BUILTIN_BACKENDS))
    monkeypatch.setattr(sb, "_by_name", dict(sb._by_name))
    monkeypatch.setattr(sb, "_by_scheme", dict(sb._by_scheme))
    monkeypatch.delitem(sys.modules, mod, raising=False)
    with pytest.raises(ValueError, match="unknown storage backend 'toy-mod'"):
        sb.backend_factory("toy-mod")
    sb.register_backend_module("toy-mod", mod)
    cls = sb.backend_factory("toy-mod")
    assert cls.__name__ == "ModTier" and sb.backend_factory("toymod://h") is cls
    monkeypatch.delitem(sys.modules, mod)


def test_an_entry_point_installed_before_a_builtin_moved_is_not_imported(monkeypatch, caplog):
    """Package metadata from an install older than a move of lmc's own tier module (the
    server tier's folder was ``daemon/``) names a module that is gone: it is not imported
    (the built-in of that name is, by module path) and no "failed to import" warning is
    logged; a third party's entry point is still imported."""
    from importlib import metadata

    import lmc.storage.tier as sb

    eps = [metadata.EntryPoint(name="server", value="lmc.storage.backends.daemon.backend",
                               group="lmc.storage.backends"),
           metadata.EntryPoint(name="toy", value="toy_plugin_module",
                               group="lmc.storage.backends")]
    imported: list[str] = []
    monkeypatch.setattr(metadata, "entry_points", lambda **_: eps)
    monkeypatch.setattr(sb, "_import_builtin", imported.append)
    monkeypatch.setattr(sb.importlib, "import_module", imported.append)
    monkeypatch.setattr(sb, "_loaded", False)
    with caplog.at_level(logging.WARNING, logger="lmc.storage.tier"):
        sb._load_plugins()
    assert "lmc.storage.backends.server.backend" in imported  # the built-in, by path
    assert "lmc.storage.backends.daemon.backend" not in imported
    assert imported[-1] == "toy_plugin_module"
    assert not [r for r in caplog.records if "failed to import" in r.getMessage()]


def test_a_url_lookup_imports_no_wrapper_module_and_wrappers_still_resolve(monkeypatch):
    """A URL lookup (``lmc config``'s remote_url) imports every module that may claim a
    scheme but not the built-in wrappers' (the codec's imports torch); a wrapper is still
    found by name after it, and no wrapper claims a scheme (so skipping them loses none)."""
    from importlib import metadata

    import lmc.storage.tier as sb

    imported: list[str] = []
    real = sb._import_builtin
    monkeypatch.setattr(metadata, "entry_points", lambda **_: [])
    monkeypatch.setattr(sb, "_import_builtin", lambda m: (imported.append(m), real(m)))
    monkeypatch.setattr(sb, "_loaded", False)
    sb._load_plugins()
    wrapper_modules = {sb.BUILTIN_BACKENDS[n] for n in sb.WRAPPER_BACKENDS}
    assert imported and not wrapper_modules & set(imported), imported
    assert "lmc.storage.backends.redis.backend" in imported
    for name in sorted(sb.WRAPPER_BACKENDS):
        cls = sb.backend_factory(name)
        assert getattr(cls, "wraps", False), name
        assert cls not in sb._by_scheme.values(), f"wrapper {name} claims a URL scheme"
