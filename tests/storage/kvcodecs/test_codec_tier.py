"""The codec tier over a real disk directory: a reader configured with another codec (or none)
misses and never misreads, a value whose header names another stage or whose compressed body
is damaged is a miss and is deleted, the tier below's evictions reach the engine under its
own keys, and stats and Prometheus say the bytes before and after."""

import os

import pytest
import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.metrics import CODEC_BYTES
from lmc.settings import ConfigError
from lmc.storage.chain import build_tiers
from lmc.storage.integrity import Geometry
from lmc.storage.kvcodecs.stage import HEADER, parse_stage
from lmc.storage.tier import create_backend
from lmc.testing import key_of

SHAPE = (2, 2, 16, 64)


@pytest.fixture
def pool():
    p = MemoryPool(32 << 20, pin_memory="false")
    yield p
    p.close()


def disk_tier(pool, path, codec=None, **opts):
    cfg = CacheConfig(local_disk=str(path), local_disk_size=opts.pop("size", "64MiB"))
    inner = create_backend("disk", cfg, pool)
    if codec is None:
        return inner
    return create_backend("codec", cfg, pool, inner=inner, codec=codec, gate="off", **opts)


def chunk(pool, key, shape=SHAPE, dtype=torch.bfloat16):
    o = pool.allocate(shape, dtype, shape[2])
    g = torch.Generator().manual_seed(int.from_bytes(key[:4], "little"))
    o.tensor.copy_(torch.randn(shape, generator=g))
    return o


def put(tier, pool, keys):
    objs = [chunk(pool, k) for k in keys]
    try:
        assert tier.put(keys, objs) == len(keys)
        return [o.tensor.clone() for o in objs]
    finally:
        for o in objs:
            o.release()


def read(tier, keys):
    got = tier.get(keys)
    out = [None if o is None else o.tensor.clone() for o in got]
    for o in got:
        if o is not None:
            o.release()
    return out


@pytest.mark.parametrize("other", [None, "fp8-e4m3", "int4-kivi+zstd", "int4-kivi.16"])
def test_a_reader_with_another_codec_setting_misses(pool, tmp_path, other):
    keys = [key_of(f"w{i}") for i in range(3)]
    writer = disk_tier(pool, tmp_path, "int4-kivi")
    put(writer, pool, keys)
    assert writer.contains(keys) == [True] * 3
    writer.close()
    codec = {"name": "int4-kivi", "group": 16} if other == "int4-kivi.16" else other
    reader = disk_tier(pool, tmp_path, codec)
    try:
        assert reader.contains(keys) == [False] * 3
        assert read(reader, keys) == [None] * 3
    finally:
        reader.close()


def test_a_reader_of_the_same_setting_reads_what_the_codec_kept(pool, tmp_path):
    keys = [key_of(f"s{i}") for i in range(2)]
    writer = disk_tier(pool, tmp_path, "int4-kivi+zstd")
    stored = put(writer, pool, keys)
    writer.close()
    reader = disk_tier(pool, tmp_path, "int4-kivi+zstd")
    try:
        for x, got in zip(stored, read(reader, keys)):
            assert torch.equal(got, reader.stage.round_trip(x))
    finally:
        reader.close()


def _put_coded(tier, pool, key, stage, x, damage=None):
    """Store under ``tier``'s namespace key a value ``stage`` coded (framed validly)."""
    c = stage.encode(x)
    value = bytearray(stage.header(c, tuple(x.shape), x.dtype))
    value += c.body if isinstance(c.body, bytes) else c.body.numpy().tobytes()
    if damage:
        damage(value)
    o = pool.allocate((1, 1, 1, len(value)), torch.uint8, 1)
    o.tensor.reshape(-1).copy_(torch.frombuffer(value, dtype=torch.uint8))
    try:
        assert tier.inner.put([tier.active.namespace(key)], [o]) == 1
    finally:
        o.release()


@pytest.mark.parametrize("case", ["other stage", "compressed body", "length", "shape"])
def test_a_bad_value_under_the_right_key_is_a_miss_and_deleted(pool, tmp_path, case):
    """Framing intact (checksums recomputed), the coded value itself wrong: misses."""
    tier = disk_tier(pool, tmp_path, "int4-kivi+zstd")
    key = key_of("bad")
    x = torch.randn(SHAPE).to(torch.bfloat16)
    stage = tier.stage
    damage = None
    if case == "other stage":
        # same lengths, another ident: only the header's stage name tells
        stage = parse_stage("int4-kivi+zstd", head_size=64)
    elif case == "compressed body":
        x = torch.zeros(SHAPE, dtype=torch.bfloat16)  # compressible: the body is zstd's
        x[:, :, ::4] = 1.0
        assert stage.encode(x).lossless

        def damage(v):
            for i in range(HEADER + 8, len(v), 5):
                v[i] ^= 0xA5
    elif case == "length":
        def damage(v):
            del v[-1]
    else:
        def damage(v):
            v[44] += 1  # the layer count in the header
    try:
        _put_coded(tier, pool, key, stage, x, damage)
        assert tier.contains([key]) == [True]
        assert read(tier, [key]) == [None]
        assert tier.contains([key]) == [False], "the bad value was not deleted"
        assert tier.stats()["codec_corrupt"] == 1
    finally:
        tier.close()


def test_a_flipped_stored_bit_is_a_miss(pool, tmp_path):
    tier = disk_tier(pool, tmp_path, "fp8-e4m3+lz4")
    key = key_of("flip")
    try:
        put(tier, pool, [key])
        name = next(n for n in os.listdir(tmp_path) if n.endswith(".kv"))
        with open(tmp_path / name, "r+b") as f:
            f.seek(4096 + 200)
            b = f.read(1)
            f.seek(4096 + 200)
            f.write(bytes([b[0] ^ 1]))
        assert read(tier, [key]) == [None]
        assert tier.contains([key]) == [False]
    finally:
        tier.close()


def test_the_engine_geometry_bounds_coded_values_below(pool, tmp_path):
    """With the engine's geometry, the tier below refuses a value larger than any coded
    chunk before allocating, and the codec takes its head size."""
    tier = disk_tier(pool, tmp_path, "int8")
    try:
        tier.expected_geometry = Geometry(2, 2, 64, torch.bfloat16, 16, head_size=32)
        assert tier.stage.ident == "int8.h32"
        below = tier.inner.expected_geometry
        assert below.max_bytes == HEADER + 2 * 2 * 16 * 64 * 2
        with pytest.raises(ValueError, match="coded chunks"):
            below.check((1, 1, 1, below.max_bytes + 1), torch.uint8)
        key = key_of("geo")
        put(tier, pool, [key])
        assert read(tier, [key])[0] is not None
    finally:
        tier.close()


def test_evictions_below_reach_the_engine_under_its_keys(pool, tmp_path):
    tier = disk_tier(pool, tmp_path, "int4-kivi", size="64KiB")
    seen = []
    tier.on_evicted = seen.extend
    keys = [key_of(f"ev{i}") for i in range(40)]
    try:
        for k in keys:
            put(tier, pool, [k])
        assert seen, "the disk tier evicted nothing: make it smaller"
        assert set(seen) <= set(keys), "evictions named keys the engine never stored"
    finally:
        tier.close()


def test_stats_and_prometheus_say_bytes_before_and_after(pool, tmp_path):
    tier = disk_tier(pool, tmp_path, "int4-kivi")
    keys = [key_of(f"st{i}") for i in range(2)]
    before = CODEC_BYTES.labels(tier.name, "write", "stored")._value.get()
    try:
        put(tier, pool, keys)
        read(tier, keys)
        s = tier.stats()
        raw = 2 * 2 * 2 * 16 * 64 * 2
        assert s["codec_raw_bytes_write"] == raw == s["codec_raw_bytes_read"]
        assert s["codec_stored_bytes_write"] < 0.4 * raw
        assert s["codec"] == "int4-kivi.g32.h0" and s["codec_active"]
        after = CODEC_BYTES.labels(tier.name, "write", "stored")._value.get()
        assert after - before == s["codec_stored_bytes_write"]
    finally:
        tier.close()


def test_a_codec_key_in_a_tiers_entry_builds_the_stage(pool, tmp_path):
    cfg = CacheConfig(tiers=["memory", {"backend": "disk", "path": str(tmp_path),
                                         "codec": "fp8+zstd", "gate": "off"}])
    entry = cfg.tier_chain()[1]
    assert entry.backend == "codec" and entry.inner.backend == "disk"
    assert CacheConfig(tiers=["memory", entry.as_config()]).tier_chain()[1] == entry
    tiers = build_tiers(cfg, pool)
    try:
        assert tiers[1].stage.ident == "fp8-e4m3.h0+zstd1" and tiers[1].name == "disk"
    finally:
        for t in reversed(tiers):
            t.close()


def test_a_bad_codec_in_config_is_named(pool, tmp_path):
    cfg = CacheConfig(tiers=["memory", {"backend": "disk", "path": str(tmp_path),
                                         "codec": "int5"}])
    with pytest.raises(ConfigError, match=r"tiers\[1\].*unknown codec 'int5'"):
        build_tiers(cfg, pool)


def test_priorities_and_prefix_clears_reach_the_coded_values(pool, tmp_path):
    """``set_priority`` and ``clear_namespace(prefix)`` name the engine's keys: the codec maps
    them to the keys it stored under (a prefix maps byte for byte), and the clear lists what
    went under the engine's names."""
    tier = disk_tier(pool, tmp_path, "int8")
    doomed = [b"\x01\x02" + key_of(f"p{i}")[2:] for i in range(3)]
    kept = [b"\x01\x03" + key_of(f"q{i}")[2:] for i in range(3)]
    try:
        put(tier, pool, doomed + kept)
        assert tier.set_priority(kept, 5) == 3
        assert tier.inner.priority_of(tier.active.namespace(kept[0])) == 5
        assert sorted(tier.clear_namespace(b"\x01\x02")) == sorted(doomed)
        assert tier.contains(doomed + kept) == [False] * 3 + [True] * 3
        assert all(x is not None for x in read(tier, kept))
    finally:
        tier.close()


@pytest.mark.parametrize("length", [1, 2, 16, 20])
def test_a_prefix_maps_as_the_keys_it_starts(length):
    stage = parse_stage("int4-kivi")
    key = bytes(range(7, 7 + max(length, 16)))
    assert stage.namespace(key).startswith(stage.namespace_prefix(key[:length]))
