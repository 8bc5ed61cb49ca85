"""The daemon's config: the shipped file loads, precedence YAML < env < flags, errors name
the key, every key has a flag, and the ``lmc server`` subcommand is registered."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmc.cli import build_parser
from lmc.server.cli import config_from_args
from lmc.server.server_config import ServerConfig

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


def _server_cli(capsys, *flags: str) -> str:
    """``lmc server FLAGS`` must refuse at config time (exit 2) with one line on stderr."""
    from lmc.cli import main

    assert main(["server", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_cache_flag_typo_names_the_closest_key(capsys):
    err = _server_cli(capsys, "--cache", "local_cpu_sise=1GiB")
    assert "unexpected keyword argument" not in err and "CacheConfig.__init__" not in err
    assert "cache: unknown config key 'local_cpu_sise'; did you mean 'local_cpu_size'?" in err
    assert "the daemon's own key 'size'" in err and "(in flags)" in err
    err = _server_cli(capsys, "--cache", "write_polcy=write_on_evict")
    assert "did you mean 'write_policy'?" in err


def test_cache_keys_the_daemon_sets_itself_are_refused(capsys):
    err = _server_cli(capsys, "--cache", "local_cpu_size=1GiB")
    assert "cache.local_cpu_size: not a daemon setting (set by the daemon's own key 'size')" in err
    with pytest.raises(ValueError, match="cache.remote_url: .*own key 'redis'"):
        ServerConfig.load(overrides={"cache": {"remote_url": "redis://h:1"}}, environ={})


def test_cache_values_are_checked_with_their_key(capsys):
    err = _server_cli(capsys, "--cache", "write_policy=sometimes")
    assert "cache.write_policy: 'sometimes' is not allowed; choose one of" in err


def test_lower_tier_is_any_backend_url():
    for url in ("redis://h:6379", "rediss+cluster://a:1,b:2", "lmc://other:7451?ns=a",
                "lmc+unix:///run/other.sock"):
        cfg = ServerConfig.load(overrides={"redis": url}, environ={})
        assert cfg.cache_config().remote_url == url
    with pytest.raises(ValueError, match="redis: expected a URL"):
        ServerConfig.load(overrides={"redis": "cpu"}, environ={})


def test_remote_options_reach_the_storage_config():
    cfg = ServerConfig.load(overrides={"redis": "redis://h:1",
                                       "cache": {"remote_options": {"get_piece": 4096}}},
                            environ={"LMC_SERVER_MAX_BATCH": "8"})
    assert cfg.cache_config().remote_options == {"get_piece": 4096}
    env = {"LMC_SERVER_CACHE": "{write_policy: write_on_evict}"}  # a mapping as YAML text
    assert ServerConfig.load(environ=env).cache_config().write_policy == "write_on_evict"


def test_misspelled_server_variable_is_reported(caplog):
    with caplog.at_level("WARNING", logger="lmc.settings"):
        ServerConfig.load(environ={"LMC_SERVER_MAX_BACTH": "3", "LMC_CHUNK_SISE": "1"})
    msgs = [r.getMessage() for r in caplog.records if r.name == "lmc.settings"]
    assert msgs == ["environment variable LMC_SERVER_MAX_BACTH is not an lmc setting and is "
                    "ignored; did you mean LMC_SERVER_MAX_BATCH?"]
