"""Config: YAML < LMC_* env < explicit overrides; clear errors naming the key; every shipped
file under configs/ loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmc.config import CacheConfig, parse_size

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", int(1.5 * 2**30)),
    ("1048576", 2**20), (4096, 4096), ("64kib", 65536), ("2 g", 2 * 10**9),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["4 GiBs", "-1", "lots", True, [1], -3, "1e9"])
def test_bad_sizes_name_the_key(bad):
    with pytest.raises(ValueError, match="local_cpu_size"):
        CacheConfig(local_cpu_size=bad)


def test_precedence_yaml_env_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 128\nlocal_cpu_size: 1GiB\ntenant: alpha\n")
    env = {"LMC_CHUNK_SIZE": "64", "LMC_TENANT": "beta", "UNRELATED": "x"}
    cfg = CacheConfig.load(f, overrides={"tenant": "gamma"}, environ=env)
    assert cfg.chunk_size == 64           # env beats YAML
    assert cfg.tenant == "gamma"          # explicit dict beats env
    assert cfg.local_cpu_size == 2**30    # YAML beats default
    assert CacheConfig.from_yaml(f).chunk_size in (128, 64)


def test_unknown_key_names_the_closest(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_sise: 128\n")
    with pytest.raises(ValueError, match=r"unknown config key 'chunk_sise'.*'chunk_size'"):
        CacheConfig.load(f, environ={})
    with pytest.raises(ValueError, match="'evicton_policy'.*'eviction_policy'"):
        CacheConfig.load(overrides={"evicton_policy": "lru"}, environ={})


@pytest.mark.parametrize("key,value,needle", [
    ("chunk_size", 0, "chunk_size: must be >= 1"),
    ("chunk_size", "many", "chunk_size: expected an integer"),
    ("save_unfull_chunk", "maybe", "save_unfull_chunk: expected true/false"),
    ("pin_memory", "always", "pin_memory: 'always'"),
])
def test_bad_values_name_key_value_and_choices(key, value, needle):
    with pytest.raises(ValueError, match=needle):
        CacheConfig(**{key: value})


def test_env_values_are_parsed():
    cfg = CacheConfig.load(environ={"LMC_SAVE_UNFULL_CHUNK": "false", "LMC_LOCAL_CPU_SIZE": "3MiB"})
    assert cfg.save_unfull_chunk is False and cfg.local_cpu_size == 3 * 2**20


def test_non_mapping_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        CacheConfig.load(f, environ={})


def test_shipped_configs_exist():
    assert CONFIGS, "configs/ must ship example YAML files"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    CacheConfig.load(path, environ={})


def test_describe_covers_every_key():
    assert [k for k, _, _ in CacheConfig.describe()] == list(CacheConfig.field_names())
    assert all(doc for _, _, doc in CacheConfig.describe())


def test_zero_sized_pool_or_disk_is_refused():
    with pytest.raises(ValueError, match="local_cpu_size: must be > 0"):
        CacheConfig(local_cpu_size=0)
    with pytest.raises(ValueError, match="local_disk_size: must be > 0"):
        CacheConfig(local_disk_size="0GiB")


def test_remote_url_must_be_a_url():
    """Only the shape: which schemes a backend claims is the tier chain's check
    (tests/storage/test_tier_chain.py)."""
    with pytest.raises(ValueError, match="remote_url: expected a URL such as redis://"):
        CacheConfig(remote_url="cache:80")
    for url in ("redis://h:6379/0", "rediss+cluster://a:1,b:2", "lmc://h:7451?ns=a",
                "lmc+unix:///run/lmc.sock"):
        assert CacheConfig(remote_url=url).remote_url == url


def test_remote_options_from_yaml_env_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("remote_url: redis://h:6379\nremote_options:\n  get_piece: 65536\n"
                 "  ssl_ca_certs: /etc/ca.pem\n")
    cfg = CacheConfig.load(f, environ={})
    assert cfg.remote_options == {"get_piece": 65536, "ssl_ca_certs": "/etc/ca.pem"}
    env = {"LMC_REMOTE_OPTIONS": "{get_piece: 1024, breaker_threshold: 5}"}
    assert CacheConfig.load(f, environ=env).remote_options == {"get_piece": 1024,
                                                               "breaker_threshold": 5}
    cfg2 = CacheConfig.load(f, overrides={"remote_options": {"x": [1, 2]}}, environ={})
    assert cfg2.remote_options == {"x": [1, 2]}      # replaced as a whole, passed verbatim
    assert hash(cfg) == hash(cfg.replace(remote_options={"other": 1}))  # hashable, unhashed
    assert cfg != cfg.replace(remote_options={"other": 1})              # but compared
    assert CacheConfig().remote_options == {} and cfg.to_dict()["remote_options"]["get_piece"]


@pytest.mark.parametrize("value,needle", [
    ("[a, b]", "remote_options: expected a mapping"),
    ("{a: [1", "remote_options: expected a mapping such as '{a: 1}', cannot parse"),
    ({"not-a-name": 1}, "option name 'not-a-name' is not a valid keyword name"),
    ({1: 2}, "keys must be strings"),
])
def test_bad_remote_options_are_named(value, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        CacheConfig(remote_url="redis://h:1", remote_options=value)


@pytest.mark.parametrize("priors,needle", [
    ({"prefill": 10**400}, r"load_policy_priors\.prefill: 1000.*\.\.\. is beyond any machine"),
    ({"remote": 10**400}, r"load_policy_priors\.remote: .* is beyond any machine"),
    ({"local_storage": "1e999GiB"}, r"load_policy_priors\.local_storage: cannot parse size"),
    ({"disk": "1e400 B"}, r"load_policy_priors\.disk"),
])
def test_speed_priors_beyond_any_machine_are_refused_by_name(priors, needle):
    """A huge number is a ConfigError naming the key, never an OverflowError's traceback."""
    with pytest.raises(ValueError, match=needle):
        CacheConfig(load_policy_priors=priors)


def test_a_size_that_overflows_a_float_is_refused_by_name():
    with pytest.raises(ValueError, match="local_cpu_size"):
        CacheConfig(local_cpu_size="1e308TiB")
