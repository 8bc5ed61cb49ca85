"""The tier chain as data: ``tiers:`` in any order and number, memory first; the shorthand
keys mean the chain they always built (docs/design.md, "The tier kit"). Malformed lists are
refused at start-up naming the entry (``tiers[2]``)."""

from __future__ import annotations

import pytest
import torch

from lmc.config import CacheConfig, TierEntry
from lmc.memory.pool import MemoryPool
from lmc.server.server_config import ServerConfig
from lmc.settings import ConfigError
from lmc.storage.chain import build_storage, build_tiers, check_chain
from lmc.storage.manager import StorageManager
from tests.kvutil import assert_bits_equal, random_bits

SHAPE = (2, 2, 16, 32)


def _describe(tiers) -> list[tuple]:
    """What makes two built chains the same: class, name and the settings each tier took."""
    out = []
    for t in tiers:
        attrs = ("path", "capacity", "fsync", "url", "timeout", "namespace", "size", "prefix")
        out.append((type(t).__name__, t.name,
                    tuple((a, getattr(t, a)) for a in attrs if hasattr(t, a))))
    return out


def test_shorthand_and_explicit_list_give_equal_chains(tmp_path):
    disk = str(tmp_path / "d")
    short = CacheConfig(local_cpu_size="1MiB", local_disk=disk, local_disk_size="8MiB",
                        remote_url="lmc://127.0.0.1:9/", remote_options={"connections": 2})
    explicit = CacheConfig(local_cpu_size="1MiB", tiers=[
        "memory", {"backend": "disk", "path": disk, "capacity": 8 << 20, "fsync": False},
        {"backend": "lmc://127.0.0.1:9/", "connections": 2}])
    assert short.tier_chain() == explicit.tier_chain()
    chains = []
    for cfg in (short, explicit):
        pool = MemoryPool(1 << 20, pin_memory=False)
        tiers = build_tiers(cfg, pool)
        chains.append(_describe(tiers))
        for t in reversed(tiers):
            t.close()
    assert chains[0] == chains[1]
    assert [c[0] for c in chains[0]] == ["CPUBackend", "DiskBackend", "ServerBackend"]
    assert chains[0][2][2][-1] == ("size", 2)  # remote_options reached the backend both ways


def test_no_lower_tier_and_memory_alone_agree():
    assert CacheConfig().tier_chain() == CacheConfig(tiers=["memory"]).tier_chain()
    assert CacheConfig(tiers=["cpu"]).tier_chain() == (TierEntry("cpu"),)


@pytest.mark.parametrize("tiers, message", [
    ([], "the first tier must be memory"),
    (["disk", "memory"], "the first tier must be memory"),
    (["memory", "memory"], r"tiers\[1\]: only the first tier is memory"),
    (["memory", "tape"], r"tiers\[1\]: unknown storage backend 'tape'"),
    (["memory", "ftp://host"], r"tiers\[1\]: no storage backend handles URL scheme 'ftp'"),
    (["memory", {"path": "/x"}], r"tiers\[1\]: a tier needs 'backend:'"),
    (["memory", 7], r"tiers\[1\]: expected a backend name or URL"),
    (["memory", {"backend": "disk", "bad key": 1}], r"tiers\[1\]: option name 'bad key'"),
    ([{"backend": "memory", "size": 3}], r"tiers\[0\]: the memory tier takes no options"),
    ({"memory": 1}, "expected a list of tiers"),
    ("memory: [", "expected a list"),
    (["memory", {"wrap": "counting"}], r"tiers\[1\]: 'wrap: counting' needs 'tier:'"),
])
def test_malformed_chains_are_refused_naming_the_entry(tiers, message):
    with pytest.raises(ConfigError, match=message):
        check_chain(CacheConfig(tiers=tiers))


def test_tiers_and_shorthand_keys_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="tiers: given together with local_disk"):
        CacheConfig(tiers=["memory"], local_disk=str(tmp_path))
    with pytest.raises(ConfigError, match="remote_url"):
        CacheConfig(tiers=["memory"], remote_url="lmc://127.0.0.1:9")


def test_an_option_the_backend_does_not_take_is_refused_naming_the_entry(tmp_path):
    cfg = CacheConfig(local_cpu_size="1MiB", tiers=[
        "memory", {"backend": "lmc://127.0.0.1:9", "conections": 2}])
    pool = MemoryPool(1 << 20, pin_memory=False)
    with pytest.raises(ConfigError, match=r"tiers\[1\].*'conections'.*did you mean 'connections'"):
        build_tiers(cfg, pool)


def test_from_the_environment_as_yaml_text(tmp_path):
    env = {"LMC_TIERS": f"[memory, {{backend: disk, path: '{tmp_path}'}}]"}
    cfg = CacheConfig.load(environ=env)
    assert [e.backend for e in cfg.tier_chain()] == ["cpu", "disk"]
    assert cfg.tier_chain()[1].options == {"path": str(tmp_path)}


def test_core_keys_set_per_tier_reach_only_that_tier():
    cfg = CacheConfig(local_cpu_size="1MiB", remote_timeout=1.0, tiers=[
        "memory", {"backend": "lmc://127.0.0.1:9", "remote_timeout": "200ms",
                   "remote_key_prefix": "a"},
        {"backend": "lmc://127.0.0.1:8", "namespace": "b"}])
    pool = MemoryPool(1 << 20, pin_memory=False)
    tiers = build_tiers(cfg, pool)
    try:
        assert (tiers[1].timeout, tiers[1].namespace) == (0.2, "a")
        assert (tiers[2].timeout, tiers[2].namespace) == (1.0, "b")
    finally:
        for t in reversed(tiers):
            t.close()
    bad = CacheConfig(tiers=["memory", {"backend": "lmc://127.0.0.1:9", "remote_timeout": -1}])
    with pytest.raises(ConfigError, match=r"tiers\[1\]: remote_timeout"):
        build_tiers(bad, MemoryPool(1 << 20, pin_memory=False))


def _put(sm: StorageManager, keys, gen) -> list[torch.Tensor]:
    objs = sm.allocate_many(SHAPE, torch.float16, len(keys), 16)
    want = []
    for o in objs:
        o.tensor.copy_(random_bits(SHAPE, torch.float16, gen))
        want.append(o.tensor.clone())
    assert sm.put(keys, objs) == len(keys)
    for o in objs:
        o.release()
    return want


def test_two_disk_tiers_in_a_chain_promote_and_look_up_through_any_depth(tmp_path):
    """memory -> disk A -> disk B: stores reach both; a chunk only B holds is found by the
    prefix lookup at level 2, loaded bit-exact, promoted into memory and written back to A."""
    cfg = CacheConfig(local_cpu_size="256KiB", tiers=[
        "memory", {"backend": "disk", "path": str(tmp_path / "a")},
        {"backend": "disk", "path": str(tmp_path / "b")}])
    sm = build_storage(cfg, MemoryPool(256 << 10, pin_memory=False))
    keys = [bytes([7, i]) * 8 for i in range(3)]
    try:
        want = _put(sm, keys, torch.Generator().manual_seed(3))
        assert sm.flush(10)
        assert sm.tiers[1].contains(keys) == sm.tiers[2].contains(keys) == [True] * 3
        sm.clear_l1()
        sm.tiers[1].delete(keys[1:])
        assert sm.prefix_sources(keys) == [1, 2, 2]
        got, where = sm.fetch_prefix(keys)
        assert where == [1, 2, 2]
        for g, w in zip(got, want):
            assert_bits_equal(g.tensor, w, "through memory -> disk -> disk")
            g.release()
        assert sm.flush(10)
        assert sm.tiers[1].contains(keys) == [True] * 3  # promoted chunks written back up
        assert sm.prefix_sources(keys) == [0, 0, 0]
    finally:
        sm.close()


def test_the_daemon_takes_a_tier_list_too(tmp_path):
    """The daemon's chain: ``cache: {tiers: [...]}`` (its memory sized by ``size``)."""
    cfg = ServerConfig(size="8MiB", cache={"tiers": [
        "memory", {"backend": "disk", "path": str(tmp_path)}, "redis://127.0.0.1:9/0"]})
    cache = cfg.cache_config()
    assert cache.local_cpu_size == 8 << 20
    assert [e.backend for e in cache.tier_chain()] == ["cpu", "disk", "redis://127.0.0.1:9/0"]
    with pytest.raises(ConfigError, match="cache.tiers: given together with disk"):
        ServerConfig(cache={"tiers": ["memory"]}, disk=str(tmp_path))
    with pytest.raises(ConfigError, match=r"cache.tiers\[1\]: unknown storage backend"):
        ServerConfig(cache={"tiers": ["memory", "tape"]})


def test_printed_chain_reads_back_the_same_and_hides_per_tier_secrets(tmp_path):
    cfg = CacheConfig(tiers=["memory", {"backend": "disk", "path": str(tmp_path)},
                             {"backend": "lmc://127.0.0.1:9", "remote_token": "tok-123456",
                              "connections": 2}])
    assert CacheConfig(**cfg.to_dict()) == cfg
    shown = cfg.public_dict()["tiers"]
    assert shown[0] == "memory" and shown[2]["remote_token"] == "***"
    assert "tok-123456" not in repr(cfg.public_dict())
    assert "tok-123456" not in repr(cfg) and "tok-123456" not in str(cfg.tiers)


def test_check_chain_checks_each_entrys_options_without_building(tmp_path):
    """``lmc config`` (``check_chain``) refuses what building would, naming the entry; nothing
    is created (the disk directory stays absent)."""
    path = tmp_path / "never"
    bad = CacheConfig(tiers=["memory", {"backend": "disk", "path": str(path)},
                             {"wrap": "counting", "log_cals": True,
                              "tier": "redis://127.0.0.1:9"}])
    with pytest.raises(ConfigError, match=r"tiers\[2\].*'log_cals'.*'log_calls'"):
        check_chain(bad)
    inner = CacheConfig(tiers=["memory", {"wrap": "counting", "tier": {
        "backend": "redis://127.0.0.1:9", "ttl": "forever"}}])
    with pytest.raises(ConfigError, match=r"ttl"):
        check_chain(inner)
    check_chain(CacheConfig(tiers=["memory", {"backend": "disk", "path": str(path)}]))
    assert not path.exists()


def test_the_registries_checks_name_the_key_and_where_it_was_given(tmp_path):
    """config.py is a plain schema: a scheme no backend claims, an unknown backend or an
    eviction policy nobody registered is refused by the chain (before any tier is built, by
    ``check_chain`` and by building alike), naming the key and the file line it came from."""
    with pytest.raises(ConfigError, match=r"remote_url: no storage backend handles URL scheme "
                                          r"'http'.*known schemes: .*lmc\b.*redis\b"):
        check_chain(CacheConfig(remote_url="http://cache:80"))
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 16\neviction_policy: random\n")
    cfg = CacheConfig.load(f, environ={})  # a plain schema: the name is a string
    with pytest.raises(ConfigError, match=r"eviction_policy: 'random' is not allowed; choose "
                                          rf"one of lru.* \(in {f}:2\)$"):
        check_chain(cfg)
    with pytest.raises(ConfigError, match=rf"tiers\[1\]: unknown storage backend 'tape'.*\(in {f}:1\)$"):
        build_tiers(CacheConfig.load(overrides={}, path=_yaml(f, "tiers: [memory, tape]\n"),
                                     environ={}), MemoryPool(1 << 20, pin_memory=False))


def _yaml(f, text):
    f.write_text(text)
    return f
