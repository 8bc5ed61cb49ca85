"""The one settings loader (``lmc.settings``) behind every lmc config: the engine's
``CacheConfig``, the daemon's ``ServerConfig`` and the vLLM connector's settings fail the same
way, with messages that name the file and line, the closest valid key, and misspelled
``LMC_*`` variables. Each case here came from a person meeting the raw error first."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lmc.cli import main as lmc_main
from lmc.config import CacheConfig, load_connector_settings
from lmc.connectors.vllm.extra_config import VllmOptions, load_settings
from lmc.server.server_config import ServerConfig
from lmc.settings import (
    ENV_NAMESPACES,
    OTHER_ENV,
    OTHER_ENV_PREFIXES,
    ConfigError,
    Settings,
    parse_duration,
    parse_int,
    read_yaml,
    setting,
    unknown_env,
)

ROOT = Path(__file__).resolve().parents[2]

# each loader given a YAML file and an environment; the key every one of them knows
LOADERS: dict[str, Callable[[Path, dict[str, str]], Any]] = {
    "engine": lambda p, env: CacheConfig.load(p, environ=env),
    "daemon": lambda p, env: ServerConfig.load(p, environ=env),
    "vllm": lambda p, env: load_settings({"lmc.config_file": str(p)}, environ=env),
}
GOOD_KEY = {"engine": "eviction_policy: lru", "daemon": "eviction_policy: lru",
            "vllm": "eviction_policy: lru"}


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


# ------------------------------------------------------------------------ malformed YAML
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("text,line,col", [
    ("eviction_policy: lru\nchunk_size: [1, 2\n", 3, 1),         # unclosed flow sequence
    ("eviction_policy: lru\n  bad: indent: here\n", 2, 6),        # mapping value not allowed
    ("eviction_policy: lru\n\tchunk_size: 1\n", 2, 1),            # a tab
    ("a: 1\n---\nb: 2\n", 2, 1),                                  # two documents
])
def test_malformed_yaml_names_file_line_and_column(tmp_path, loader, text, line, col):
    f = _write(tmp_path, text, "broken.yaml")
    with pytest.raises(ConfigError) as e:
        LOADERS[loader](f, {})
    msg = str(e.value)
    assert msg.startswith(f"{f}:{line}:{col}: malformed YAML: "), msg
    assert "<unicode string>" not in msg and "Traceback" not in msg
    assert len(msg.splitlines()) <= 3  # the problem, the offending line and a caret
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained traceback


def test_lmc_config_prints_one_line_for_malformed_yaml(tmp_path, capsys):
    f = _write(tmp_path, "chunk_size: 256\nlocal_cpu_size: [1GiB\n")
    assert lmc_main(["config", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmc config: {f}:3:1: malformed YAML") and "Traceback" not in err


@pytest.mark.parametrize("loader", LOADERS)
def test_duplicate_keys_name_both_lines(tmp_path, loader):
    f = _write(tmp_path, f"{GOOD_KEY[loader]}\n# note\n{GOOD_KEY[loader]}\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(f))}:3: key 'eviction_policy' is "
                                          r"given twice \(first at line 1\)"):
        LOADERS[loader](f, {})


@pytest.mark.parametrize("loader", LOADERS)
def test_unreadable_files_are_named(tmp_path, loader):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"{re.escape(str(missing))}: cannot read"):
        LOADERS[loader](missing, {})
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"chunk_size: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"bin\.yaml: not a UTF-8 text file"):
        LOADERS[loader](binary, {})
    listing = _write(tmp_path, "- a\n- b\n", "list.yaml")
    with pytest.raises(ConfigError, match=r"list\.yaml: top level must be a mapping"):
        LOADERS[loader](listing, {})


def test_empty_file_is_all_defaults(tmp_path):
    f = _write(tmp_path, "# nothing set yet\n")
    assert read_yaml(f).data == {}
    assert CacheConfig.load(f, environ={}) == CacheConfig()


# --------------------------------------------------------------------------- unknown keys
@pytest.mark.parametrize("loader,typo,valid", [
    ("engine", "local_cpu_sise", "local_cpu_size"),
    ("daemon", "disk_sise", "disk_size"),
    ("vllm", "local_cpu_sise", "local_cpu_size"),
])
def test_unknown_key_names_its_line_and_the_closest_key(tmp_path, loader, typo, valid):
    f = _write(tmp_path, f"{GOOD_KEY[loader]}\n{typo}: 1GiB\n")
    with pytest.raises(ConfigError, match=rf"unknown .*key '{typo}' in {re.escape(str(f))}:2; "
                                          rf"did you mean '{valid}'\?"):
        LOADERS[loader](f, {})


def test_nested_section_keys_point_at_their_own_line(tmp_path):
    f = _write(tmp_path, "chunk_size: 256\nvllm:\n  layerwise: true\n  lookup_timout: 2\n")
    with pytest.raises(ConfigError, match=rf"'vllm.lookup_timout' in {re.escape(str(f))}:4; "
                                          r"did you mean 'vllm.lookup_timeout'"):
        load_settings({"lmc.config_file": str(f)}, environ={})
    f = _write(tmp_path, "size: 64MiB\ncache:\n  write_policy: write_through\n  chunk_sise: 3\n")
    with pytest.raises(ConfigError, match=rf"unknown config key 'chunk_sise'; did you mean "
                                          rf"'chunk_size'\? \(in {re.escape(str(f))}:4\)"):
        ServerConfig.load(f, environ={})


# ---------------------------------------------------------------- values and their origin
def test_bad_value_says_where_it_came_from(tmp_path):
    f = _write(tmp_path, "chunk_size: 256\nlocal_cpu_size: lots\n")
    with pytest.raises(ConfigError, match=rf"local_cpu_size: cannot parse size 'lots'.*"
                                          rf"\(in {re.escape(str(f))}:2\)"):
        CacheConfig.load(f, environ={})
    with pytest.raises(ConfigError, match=r"remote_timeout: cannot parse duration 'soon'.*"
                                          r"\(in environment variable LMC_REMOTE_TIMEOUT\)"):
        CacheConfig.load(environ={"LMC_REMOTE_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match=r"frame_timeout: must be >= 0.01.*\(in flags\)"):
        ServerConfig.load(overrides={"frame_timeout": "1ms"}, environ={})
    with pytest.raises(ConfigError, match=r"lmc.chunk_size: expected an integer.*"
                                          r"\(in kv_connector_extra_config\)"):
        load_settings({"lmc.chunk_size": "many"}, environ={})


@pytest.mark.parametrize("text,seconds", [
    (2, 2.0), ("2", 2.0), ("1.5", 1.5), ("500ms", 0.5), ("2s", 2.0), ("5m", 300.0),
    ("1h", 3600.0), (" 250 ms ", 0.25),
])
def test_durations(text, seconds):
    assert parse_duration(text, "t") == seconds
    assert CacheConfig(remote_timeout=text).remote_timeout == seconds


@pytest.mark.parametrize("bad", ["soon", "5 days", "-1s", "inf", "nan", float("inf"), True, [1]])
def test_bad_durations_name_the_key(bad):
    with pytest.raises(ConfigError, match="pin_timeout: "):
        CacheConfig(pin_timeout=bad)


# ------------------------------------------------------------------- environment variables
def _env_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lmc.settings"]


@pytest.mark.parametrize("loader,var,valid", [
    ("engine", "LMC_CHUNK_SISE", "LMC_CHUNK_SIZE"),
    ("engine", "LMC_LOCAL_CPU_SZE", "LMC_LOCAL_CPU_SIZE"),
    ("engine", "LMC_DEBUG_INVARIANT", "LMC_DEBUG_INVARIANTS"),
    ("daemon", "LMC_SERVER_PROT", "LMC_SERVER_PORT"),
    ("vllm", "LMC_REMOTE_URLL", "LMC_REMOTE_URL"),
])
def test_misspelled_environment_variable_is_reported(tmp_path, caplog, loader, var, valid):
    f = _write(tmp_path, f"{GOOD_KEY[loader]}\n")
    with caplog.at_level(logging.WARNING, logger="lmc.settings"):
        LOADERS[loader](f, {var: "1"})
    assert _env_warnings(caplog) == [
        f"environment variable {var} is not an lmc setting and is ignored; did you mean "
        f"{valid}?"]


def test_each_schema_reports_only_its_own_namespace(caplog):
    env = {"LMC_SERVER_PROT": "1", "LMC_CHUNK_SISE": "1"}
    with caplog.at_level(logging.WARNING, logger="lmc.settings"):
        CacheConfig.load(environ=env)
        assert [m.split()[2] for m in _env_warnings(caplog)] == ["LMC_CHUNK_SISE"]
        caplog.clear()
        ServerConfig.load(environ=env)
        assert [m.split()[2] for m in _env_warnings(caplog)] == ["LMC_SERVER_PROT"]


def _env_reads() -> set[str]:
    """Every ``LMC_*`` name the tree reads from the environment (Python and CI scripts); an
    f-string part becomes a regex."""
    py = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\(|environ\[|getenv\(|ENV\s*=)"""
                    r"""\s*f?["'](LMC_[A-Za-z0-9_{}().]*)["']""")
    sh = re.compile(r"\$\{?(LMC_[A-Z0-9_]+)")
    found: set[str] = set()
    for path in [*ROOT.glob("**/*.py"), ROOT / ".ci" / "run", ROOT / "Makefile"]:
        if ".git" in path.parts or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found.update(py.findall(text))
        if path.suffix != ".py":
            found.update(sh.findall(text))
    return found


def _known(var: str) -> bool:
    return (not unknown_env({var: ""}, "LMC_", CacheConfig.field_names())
            and not unknown_env({var: ""}, "LMC_SERVER_", ServerConfig.field_names()))


def test_every_variable_lmc_reads_is_known():
    """A variable read anywhere in lmc (debug switches, tests, CI) must never be reported as
    a misspelling: register it in ``lmc.settings.OTHER_ENV`` (or a prefix)."""
    reads = _env_reads()
    assert {"LMC_DEBUG_INVARIANTS", "LMC_HYPOTHESIS_PROFILE", "LMC_VLLM_PYTHON",
            "LMC_FUZZ_SEED", "LMC_REMOTE_TOKEN"} <= reads  # the scan itself works
    candidates = [*OTHER_ENV, *(f"LMC_{k.upper()}" for k in CacheConfig.field_names()),
                  *(f"LMC_SERVER_{k.upper()}" for k in ServerConfig.field_names())]
    unknown = []
    for var in sorted(reads):
        if "{" in var:  # an f-string: some known variable must fit it
            pattern = re.sub(r"\\\{.*?\\\}", "[A-Z0-9_]+", re.escape(var))
            if not any(re.fullmatch(pattern, c) for c in candidates):
                unknown.append(var)
        elif not _known(var):
            unknown.append(var)
    assert not unknown, f"read from the environment but unknown to lmc.settings: {unknown}"


def test_known_variables_are_never_reported(caplog):
    env = {v: "1" for v in OTHER_ENV}
    env.update({f"{p}ANYTHING": "1" for p in (*OTHER_ENV_PREFIXES, *ENV_NAMESPACES)})
    env.update({"LMC_LOCAL_CPU_SIZE": "1GiB", "LMC_REMOTE_OPTIONS": "", "LMC_TENANT": "t"})
    with caplog.at_level(logging.WARNING, logger="lmc.settings"):
        CacheConfig.load(environ=env)
    assert _env_warnings(caplog) == []


def test_engine_keys_never_collide_with_another_namespace():
    for key in CacheConfig.field_names():
        var = f"LMC_{key.upper()}"
        assert not var.startswith((*ENV_NAMESPACES, *OTHER_ENV_PREFIXES)) and var not in OTHER_ENV
    assert ServerConfig.ENV_PREFIX in ENV_NAMESPACES


# --------------------------------------------------------------------- lmc config validates
@pytest.mark.parametrize("text,needle", [
    ("local_cpu_size: 0\n", "local_cpu_size: must be > 0"),
    ("local_disk: /tmp/x\nlocal_disk_size: 0B\n", "local_disk_size: must be > 0"),
    ("local_cpu_size: 4 GiBs\n", "local_cpu_size: cannot parse size"),
    ("remote_url: http://cache.example:80\n",
     "remote_url: no storage backend handles URL scheme 'http'.*known schemes: .*lmc.*redis"),
    ("remote_url: cache.example:6379\n", "remote_url: expected a URL such as redis://"),
    ("remote_timeout: 5 days\n", "remote_timeout: cannot parse duration"),
    ("remote_ttl: -1\n", "remote_ttl: must be >= 0"),
    ("pin_timeout: .inf\n", "pin_timeout: expected a finite number"),
    ("remote_options: {a: 1}\n", "remote_options: given, but there is no remote_url"),
    ("remote_url: redis://h:1\nremote_options: [a]\n", "remote_options: expected a mapping"),
    ("remote_url: redis://h:1\nremote_options: {get_peice: 4}\n",
     "remote_options: RedisBackend has no option 'get_peice'; did you mean 'get_piece'"),
    ("remote_url: redis://h:1\nremote_options: {ttl: soon}\n",
     "remote_options.ttl: cannot parse duration 'soon'"),
    ("remote_url: redis://h:1?connections=0\n", r"remote_url's \?connections=: must be >= 1"),
    ("remote_url: lmc://h:1?conections=2\nremote_options: {conections: 2}\n",
     "ServerBackend has no option 'conections'; did you mean 'connections'"),
    ("remote_url: redis://h:1?ttl=1h\nremote_options: {ttl: 2h}\n",
     r"option 'ttl' is given twice: in remote_url's \?ttl= and in remote_options.ttl"),
    ("remote_url: redis://h:1\nremote_ttl: 1h\nremote_options: {ttl: 2h}\n",
     "remote_ttl \\(deprecated\\) and remote_options.ttl both set"),
    ("integrity_secret: short\n", "integrity_secret: at least 16 bytes"),
    ("integrity_secret_file: /nonexistent/lmc.key\n", "integrity_secret_file .*cannot read"),
    ("integrity_secret: 0123456789abcdef0\nintegrity_secret_file: /x\n", "not both"),
])
def test_lmc_config_refuses_what_would_fail_later(tmp_path, capsys, text, needle):
    f = _write(tmp_path, text)
    assert lmc_main(["config", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert re.search(needle, err), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_lmc_config_masks_secrets(tmp_path, capsys):
    f = _write(tmp_path, "remote_url: lmc://127.0.0.1:7451\nremote_token: tok-123\n"
                         "integrity_secret: 0123456789abcdef-secret\n")
    assert lmc_main(["config", "--config", str(f)]) == 0
    out = capsys.readouterr().out
    assert "tok-123" not in out and "0123456789abcdef-secret" not in out
    assert "remote_token: '***'" in out and "integrity_secret_file: null" in out


# -------------------------------------------------------------- a connector's extra config
@dataclasses.dataclass(frozen=True)
class _ToyOptions(Settings):
    """What a new engine adapter declares: its options, under its own section."""

    page_size: int = setting(16, lambda v, k: parse_int(v, k, minimum=1), "tokens per page")


def test_a_new_connector_reuses_the_extra_config_loader(tmp_path):
    f = _write(tmp_path, "chunk_size: 128\ntoy:\n  page_size: 32\n")
    extra = {"lmc.config_file": str(f), "lmc.toy.page_size": "64", "lmc.tenant": "a",
             "toy_engine_key": 1}  # not lmc's: ignored
    cache, opts = load_connector_settings(extra, "toy", _ToyOptions, "toy_extra",
                                          environ={"LMC_CHUNK_SIZE": "64"})
    assert (cache.chunk_size, cache.tenant, opts.page_size) == (64, "a", 64)
    with pytest.raises(ConfigError, match=r"unknown config key 'lmc.toy.page_sise' in toy_extra; "
                                          r"did you mean 'lmc.toy.page_size'\?"):
        load_connector_settings({"lmc.toy.page_sise": 1}, "toy", _ToyOptions, "toy_extra", {})
    f = _write(tmp_path, "toy:\n  page_size: 0\n")
    with pytest.raises(ConfigError, match=rf"toy.page_size: must be >= 1, got 0 "
                                          rf"\(in {re.escape(str(f))}:2\)"):
        load_connector_settings({"lmc.config_file": str(f)}, "toy", _ToyOptions, "x", {})
    f = _write(tmp_path, "toy: [1]\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:1: 'toy' must be a mapping"):
        load_connector_settings({"lmc.config_file": str(f)}, "toy", _ToyOptions, "x", {})


@pytest.mark.parametrize("schema", [CacheConfig, ServerConfig, VllmOptions],
                         ids=lambda s: s.__name__)
def test_units_are_declared_where_values_take_them(schema):
    """Tools show sizes as 2GiB and durations as 500ms from the ``unit`` a field declares:
    a field taking such a value must declare it, and a declared unit must be true."""
    for f in dataclasses.fields(schema):
        parse, unit = f.metadata["parse"], f.metadata["unit"]
        results = {}
        for text, value in (("1KiB", 1024), ("500ms", 0.5)):
            try:
                results[text] = parse(text, f.name) == value
            except ValueError:
                results[text] = False
        assert (unit == "size") == results["1KiB"], f.name
        assert (unit == "duration") == results["500ms"], f.name


def test_constructing_with_an_unknown_keyword_names_the_closest():
    """Not the dataclass's raw ``__init__() got an unexpected keyword argument``."""
    with pytest.raises(ConfigError, match=r"unknown config key 'chunk_sise' in CacheConfig\(\); "
                                          r"did you mean 'chunk_size'\?"):
        CacheConfig(chunk_sise=3)
    with pytest.raises(ConfigError, match=r"'sise' in ServerConfig\(\); did you mean 'size'"):
        ServerConfig(sise="1GiB")
    with pytest.raises(ConfigError, match=r"'chunk_sise' in replace\(\)"):
        CacheConfig().replace(chunk_sise=3)
    cfg = CacheConfig(remote_url="redis://h:1", remote_options={"get_piece": 4096})
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # engines ship configs to worker processes


def test_yaml_anchors_and_merges_are_not_duplicates(tmp_path):
    f = _write(tmp_path, "vllm: &opts\n  lookup_timeout: 2\n  layerwise: false\n"
                         "chunk_size: 128\n")
    assert load_settings({"lmc.config_file": str(f)}, environ={}).vllm.layerwise is False
    f = _write(tmp_path, "toy:\n  <<: {page_size: 8}\n  page_size: 32\n")
    _, opts = load_connector_settings({"lmc.config_file": str(f)}, "toy", _ToyOptions, "x", {})
    assert opts.page_size == 32  # an explicit key overrides the merged one, as YAML says


# ------------------------------------------------------------- per-backend options (issue 11)
def _builtin_backends() -> list[type]:
    """Every built-in backend class this install can import (p2p needs NIXL)."""
    import importlib

    from lmc.storage.tier import BUILTIN_BACKENDS, backend_factory

    out = []
    for name, module in BUILTIN_BACKENDS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        out.append(backend_factory(name))
    return out


def test_declared_backend_options_are_constructor_keywords_with_the_same_defaults():
    """A backend's ``OPTIONS`` and its constructor must not drift apart: config passes each
    option as a keyword, and code building a tier directly gets the documented default."""
    import inspect

    checked = 0
    for cls in _builtin_backends():
        params = inspect.signature(cls).parameters
        for name, opt in cls.OPTIONS.items():
            assert name in params, f"{cls.__name__}.OPTIONS[{name!r}] is no keyword of __init__"
            assert params[name].default == opt.default, (cls.__name__, name)
            assert opt.parse(opt.default, name) == opt.default, (cls.__name__, name)
            assert opt.doc, (cls.__name__, name)
            checked += 1
    assert checked >= 10  # redis, lmc:// (p2p where NIXL is installed)


def test_readme_lists_every_declared_backend_option():
    readme = (ROOT / "README.md").read_text()
    missing = [f"{cls.name}.{name}" for cls in _builtin_backends() for name in cls.OPTIONS
               if f"| `{cls.name}` | `{name}` |" not in readme]
    assert not missing, f"README's backend options table lacks {missing}"


def _built(cfg: CacheConfig) -> Any:
    from lmc.memory.pool import MemoryPool
    from lmc.storage.tier import create_backend

    pool = MemoryPool(1 << 20, pin_memory="false")
    tier = create_backend(cfg.remote_url, cfg, pool)  # no I/O: connections open on first use
    tier.close()
    pool.close()
    return tier


def test_backend_options_from_the_url_query_remote_options_or_deprecated_keys(caplog):
    """Three spellings, one result; the rest of a query stays the backend's own (redis-py's
    TLS options here), byte for byte."""
    url = "redis://127.0.0.1:1/0"
    new = _built(CacheConfig(remote_url=url, remote_options={"connections": 3, "ttl": "2h"}))
    query = _built(CacheConfig(remote_url=f"{url}?connections=3&ssl_cert_reqs=none&ttl=2h"))
    old = _built(CacheConfig(remote_url=url, remote_connections=3, remote_ttl="2h"))
    for t in (new, query, old):
        assert (t.connections, t.px) == (3, 7_200_000)
    assert query.target.options["ssl_cert_reqs"] == "none"
    assert "connections" not in query.target.options
    dflt = _built(CacheConfig(remote_url=url))
    assert (dflt.connections, dflt.px) == (4, 0)
    srv = _built(CacheConfig(remote_url="lmc://127.0.0.1:1?ns=a&connections=2"))
    assert (srv.size, srv.namespace) == (2, "a")
    # a deprecated key the backend never took is ignored, as it always was
    assert _built(CacheConfig(remote_url="lmc://127.0.0.1:1", remote_ttl=5)).size == 4
    # and one set in a config without remote_url reaches a tier built by hand, as it did
    from lmc.memory.pool import MemoryPool
    from lmc.storage.tier import create_backend

    pool = MemoryPool(1 << 20, pin_memory="false")
    tier = create_backend(url, CacheConfig(remote_connections=2), pool)
    assert tier.connections == 2
    tier.close()
    pool.close()


def test_a_deprecated_key_warns_once_naming_the_new_spelling(caplog, monkeypatch):
    from lmc import config as config_mod

    monkeypatch.setattr(config_mod, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="lmc.config"):
        for _ in range(3):
            cfg = CacheConfig.load(environ={"LMC_REMOTE_URL": "redis://127.0.0.1:1",
                                            "LMC_REMOTE_CONNECTIONS": "6"})
    msgs = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert "remote_connections is deprecated" in msgs[0]
    assert "remote_options: {connections: 6}" in msgs[0] and "?connections=6" in msgs[0]
    assert cfg.remote_connections == 6 and _built(cfg).connections == 6
    assert "remote_connections" not in [k for k, _, doc in CacheConfig.describe()
                                        if not doc.startswith("deprecated")]
