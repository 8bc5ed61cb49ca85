"""Every read path of every shared tier goes through its framing (:mod:`lmc.storage.framing`).

For disk, Redis and ``lmc://`` (plain and with ``integrity_secret``), whole reads and, where
the tier has them, layered reads: with a counting framing every hit was verified by it; with a
framing that refuses, every value is a miss, counted and deleted like any bad value. The P2P
tier's read is checked the same way in ``test_contract_p2p.py`` (NIXL runs in a child).
"""

from __future__ import annotations

import contextlib
import uuid

import pytest
import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.backends.disk.backend import DiskBackend
from lmc.storage.integrity import Geometry, expect_geometry
from lmc.storage.serde import CorruptValue
from lmc.storage.tier import create_backend
from lmc.testing.harness import check_hit, fill, key_of, release
from tests.server.daemon_proc import DaemonProc

from .conftest import redis_server  # noqa: F401 - a real redis-server
from .framings import CountingFraming, RejectingFraming

pytestmark = pytest.mark.integration

SECRET = "framing-stage-secret-0123456789abcdef"
SHAPE = (4, 2, 16, 32)
N = 3


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProc(tmp_path_factory.mktemp("daemon"), ["--size", "64MiB"])
    d.start()
    yield d
    d.kill()


@pytest.fixture(params=["disk", "redis", "server"])
def kind(request):
    return request.param


@pytest.fixture(params=["plain", "keyed"])
def keyed(request):
    return request.param == "keyed"


@pytest.fixture
def make(kind, keyed, tmp_path, redis_server, daemon):  # noqa: F811
    """``make()`` -> a fresh tier of ``kind`` over its own pool (the same store each time)."""
    if kind == "disk" and keyed:
        pytest.skip("the disk tier carries no keyed tag (its directory is one process's)")
    prefix = f"c{uuid.uuid4().hex[:10]}"
    url = {"redis": redis_server.url, "server": daemon.url}.get(kind)
    made = []

    def build():
        cfg = {"remote_key_prefix": prefix, "remote_timeout": 5.0,
               **({"integrity_secret": SECRET} if keyed else {})}
        pool = MemoryPool(16 << 20, pin_memory="false")
        if kind == "disk":
            tier = DiskBackend(config=CacheConfig(local_disk=str(tmp_path / "disk"),
                                                  local_disk_size="64MiB", **cfg), pool=pool)
        else:
            tier = create_backend(url, CacheConfig(remote_url=url, **cfg), pool)
        expect_geometry([tier], Geometry(SHAPE[0], SHAPE[1], SHAPE[3], torch.float16,
                                         max_tokens=SHAPE[2]))
        made.append(tier)
        return tier

    yield build
    for t in made:
        t.close()
        assert t.pool.used_bytes == 0, "the tier kept pool memory"
        t.pool.close()


def _store(tier, keys) -> None:
    objs = [fill(o, k) for o, k in zip(
        tier.pool.allocate_many(SHAPE, torch.float16, len(keys), SHAPE[2]), keys)]
    try:
        assert tier.put(keys, objs) == len(keys)
    finally:
        release(objs)


def _layered(tier, keys):
    """``get_layers`` to its end: (objects, per-key verified)."""
    read = tier.get_layers(keys)
    assert read is not None
    with contextlib.suppress(CorruptValue):  # a refused value fails the wait; ok says which
        read.wait_verified(timeout=30)
    return read.objs, read.ok


def _read(tier, keys, path):
    if path == "whole":
        return tier.get(keys), None
    return _layered(tier, keys)


@pytest.mark.parametrize("path", ["whole", "layered"])
def test_every_hit_is_verified_by_the_codec_and_a_refusing_codec_makes_misses(make, kind,
                                                                              path):
    if path == "layered" and kind == "server":
        pytest.skip("the lmc:// tier reads whole chunks only")
    keys = [key_of(f"framing-{kind}-{i}") for i in range(N)]
    writer = make()
    _store(writer, keys)
    writer.close()

    tier = make()
    tier.framing = counting = CountingFraming(tier.framing)
    objs, ok = _read(tier, keys, path)
    try:
        for k, o in zip(keys, objs):
            check_hit(o, k, SHAPE)
        assert ok is None or all(ok)
        assert counting.verified == N, f"{kind} {path}: {counting.verified} of {N} hits " \
                                       "went through the framing"
    finally:
        release(objs)

    tier.framing = refusing = RejectingFraming(tier.framing)
    objs, ok = _read(tier, keys, path)
    try:
        if ok is None:
            assert objs == [None] * N, f"{kind} {path}: a value the framing refused was served"
        else:
            assert not any(ok), f"{kind} {path}: a value the framing refused verified"
        assert refusing.verified == N
    finally:
        release(objs)
    assert not any(tier.contains(keys)), f"{kind} {path}: refused values were not deleted"
