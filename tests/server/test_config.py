"""The daemon's config: the shipped file loads, precedence YAML < env < flags, errors name
the key, every key has a flag, and the ``lmc server`` subcommand is registered."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmc.cli import build_parser
from lmc.server.cli import config_from_args
from lmc.server.config import ServerConfig

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "configs" / "server").glob("*.yaml"))


def test_shipped_server_configs_load():
    assert SHIPPED, "configs/server/ must ship the daemon's example config"
    for path in SHIPPED:
        cfg = ServerConfig.load(path, environ={})
        assert cfg.host == "127.0.0.1"
        cfg.cache_config()  # the storage keys it carries are valid CacheConfig keys


def test_precedence_yaml_env_flags(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("size: 64MiB\nport: 1234\nmax_batch: 10\n")
    env = {"LMC_SERVER_PORT": "2345", "LMC_SERVER_MAX_BATCH": "20"}
    cfg = ServerConfig.load(f, overrides={"max_batch": "30"}, environ=env)
    assert (cfg.size, cfg.port, cfg.max_batch) == (64 << 20, 2345, 30)


@pytest.mark.parametrize("kv,match", [
    ({"size": "lots"}, "size"), ({"port": 70000}, "port"), ({"max_batch": 0}, "max_batch"),
    ({"sise": "1GiB"}, "did you mean 'size'"), ({"cache": {"chunk_sise": 3}}, "cache"),
    ({"port": None, "unix_socket": None}, "nothing to listen on"),
    ({"redis": "http://x"}, "redis: .*known schemes: .*lmc.*redis"),
    ({"unix_socket_mode": "rw"}, "unix_socket_mode"),
    ({"quotas": {"a": "big"}}, "quotas.a"),
])
def test_bad_values_name_the_key(kv, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig.load(overrides=kv, environ={})


def test_every_key_is_a_flag_and_cli_is_registered(tmp_path):
    parser = build_parser()
    tok = tmp_path / "tok"
    tok.write_text("s3cret\n")
    args = parser.parse_args([
        "server", "--host", "127.0.0.1", "--port", "0", "--unix-socket", str(tmp_path / "s"),
        "--size", "32MiB", "--disk", str(tmp_path / "d"), "--token-file", str(tok),
        "--metrics-port", "0", "--quota", "a=1MiB", "--cache", "write_policy=write_on_evict",
        "--max-payload", "64MiB"])
    assert callable(args.func)
    cfg = config_from_args(args)
    assert cfg.size == 32 << 20 and cfg.disk == str(tmp_path / "d")
    assert cfg.quotas == {"a": 1 << 20} and cfg.cache == {"write_policy": "write_on_evict"}
    assert cfg.resolved_token() == "s3cret" and cfg.metrics_port == 0
    assert cfg.cache_config().write_policy == "write_on_evict"
    flags = {a.dest for a in parser._subparsers._group_actions[0].choices["server"]._actions}
    assert set(ServerConfig.field_names()) <= flags


def test_max_value_never_exceeds_max_payload():
    cfg = ServerConfig.load(overrides={"max_payload": "1MiB", "max_value": "2MiB"}, environ={})
    assert cfg.limits.max_value == 1 << 20


def test_documented_multi_tenant_yaml_loads():
    """The tokens examples in the README and docs/protocol.md are valid daemon config."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text().split("**Multi-tenant.**", 1)[1]
    protocol = (root / "docs" / "protocol.md").read_text().split(
        "## Authentication and namespaces", 1)[1]
    for text in (readme, protocol):
        block = text.split("```yaml", 1)[1].split("```", 1)[0]
        cfg = ServerConfig.load(overrides=yaml.safe_load(block), environ={})
        assert cfg.tokens and any(t.admin for t in cfg.tokens)
        assert all(t.admin or t.namespaces for t in cfg.tokens)
