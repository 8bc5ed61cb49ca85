"""One settings loader for every lmc schema: YAML file < ``LMC_*`` environment < overrides.

The engine (``lmc.config.CacheConfig``), the daemon
(``lmc.server.server_config.ServerConfig``) and the vLLM connector
(``lmc.connectors.vllm.extra_config``) all read settings the same way and fail the same way,
so that a person meets one set of messages wherever they configure lmc:

* malformed YAML names the file, the line and the column (never a parser traceback);
* an unknown key names where it was found and the closest valid key;
* a bad value names the key, the value, what is allowed, and where the value came from
  (``c.yaml:3``, the environment variable, the flags);
* an ``LMC_*`` environment variable no part of lmc reads is reported with the closest
  valid name, instead of being silently ignored.

A schema is a frozen dataclass deriving :class:`Settings` whose fields are made with
:func:`setting` (default, parser, one-line doc); the parsers below turn YAML, environment
strings and Python values alike into the typed value or a message naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

log = logging.getLogger(__name__)
S = TypeVar("S", bound="Settings")
Parser = Callable[[Any, str], Any]


class ConfigError(ValueError):
    """A setting lmc cannot use; the message names it, where it came from and what would do.

    ``key`` is the dotted path of a nested value at fault (``cache.chunk_sise``), so that the
    loader can point at its own line rather than at its parent's."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# ------------------------------------------------------------------------ value parsers
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0,
                   "h": 3600.0}


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string like ``"4GiB"``, ``"512MB"``, ``"1.5 GiB"``, ``"1048576"``.

    SI suffixes (kB, MB, GB) are powers of 1000, IEC suffixes (KiB, MiB, GiB) powers of 1024.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '4GiB' or a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must be >= 0, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _NUMBER_UNIT.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            n = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
            if not math.isfinite(n):
                raise ConfigError(f"{key}: size {value!r} is not a finite number of bytes")
            return int(n)
    raise ConfigError(
        f"{key}: cannot parse size {value!r}; use bytes or a number with one of "
        "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '4GiB', '512MB')"
    )


def parse_positive_size(value: Any, key: str) -> int:
    """A size that must hold something: 0 bytes of pool or disk is a mistake, not a mode."""
    n = parse_size(value, key)
    if n <= 0:
        raise ConfigError(f"{key}: must be > 0, got {value!r}")
    return n


def parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected true/false, got {value!r}")


def parse_int(value: Any, key: str, minimum: int | None = None) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    try:
        out = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        out = None
    if out is None:
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if minimum is not None and out < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {out}")
    return out


def parse_float(value: Any, key: str, minimum: float | None = None) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(out):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    if minimum is not None and out < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {out}")
    return out


def parse_duration(value: Any, key: str, minimum: float | None = None) -> float:
    """Seconds from a number or a string with a unit: ``"500ms"``, ``"2s"``, ``"5m"``, ``"1h"``."""
    if isinstance(value, str):
        m = _NUMBER_UNIT.match(value)
        unit = m.group(2).lower() if m else None
        if unit not in _DURATION_UNITS:
            raise ConfigError(f"{key}: cannot parse duration {value!r}; use seconds or a number "
                              "with ms, s, m or h (e.g. '500ms', '2s', '5m')")
        assert m is not None
        value = float(m.group(1)) * _DURATION_UNITS[unit]
    return parse_float(value, key, minimum)


def parse_choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in choices:
        return value
    raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(choices)}")


def parse_opt_str(value: Any, key: str) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected a string, got {value!r}")


def parse_opt_path(value: Any, key: str) -> str | None:
    """A path, ``~`` expanded (a YAML file has no shell to do it), or ``None``."""
    s = parse_opt_str(value, key)
    return None if s is None else os.path.expanduser(s)


def parse_mapping(value: Any, key: str) -> dict[str, Any]:
    """A mapping, or (from an environment variable) its YAML/JSON text; ``None`` is empty."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"{key}: expected a mapping such as '{{a: 1}}', "
                              f"cannot parse {value!r}: {_yaml_problem(e)}") from None
        except RecursionError:
            raise ConfigError(f"{key}: expected a mapping such as '{{a: 1}}', got YAML "
                              f"nested too deeply") from None
        if value is None:
            return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    for k in value:
        if not isinstance(k, str):
            raise ConfigError(f"{key}: keys must be strings, got {k!r}")
    return dict(value)


# --------------------------------------------------------------------- schema fields
def setting(default: Any, parse: Parser, doc: str, *, secret: bool = False,
            hashed: bool = True, unit: str | None = None) -> Any:
    """A schema field. ``secret`` keeps it out of the repr (so never logged); ``hashed=False``
    for mappings, which cannot be part of the frozen config's hash; ``unit`` (``"size"``:
    bytes, ``"duration"``: seconds) lets tools show the value as ``2GiB`` / ``500ms``."""
    return dataclasses.field(default=default, repr=not secret, hash=None if hashed else False,
                             metadata={"parse": parse, "doc": doc, "unit": unit})


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The most similar candidate, if any is similar enough to be the intended one."""
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def check_known_keys(data: Iterable[Any], valid: Iterable[str], origin: str,
                     what: str = "config", prefix: str = "",
                     where: Callable[[str], str] | None = None) -> None:
    """``ConfigError`` naming the first unknown key, where it is, and the closest valid one.

    ``prefix`` is how the user wrote the key's parent (``lmc.`` in vLLM's extra config), and
    ``where(key)`` may refine ``origin`` to a line (``c.yaml:3``)."""
    valid = tuple(valid)
    for key in data:
        if key not in valid:
            close = closest(str(key), valid)
            hint = f"; did you mean '{prefix}{close}'?" if close else ""
            at = where(str(key)) if where else origin
            raise ConfigError(f"unknown {what} key '{prefix}{key}' in {at}{hint}")


# ---------------------------------------------------------------------------- YAML
def _yaml_problem(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.MarkedYAMLError):
        text = e.problem or e.context or "not valid YAML"
        if e.context and e.problem and e.context_mark is not None:
            text += f" ({e.context} at line {e.context_mark.line + 1})"
        return text
    return str(e).splitlines()[0] if str(e) else type(e).__name__


@dataclasses.dataclass(frozen=True)
class YamlFile:
    """A config file's top-level mapping and the line of every key in it (dotted for nested
    keys: ``vllm.lookup_timeout``), so that messages can point at the line to fix."""

    path: str
    data: dict[str, Any]
    lines: dict[str, int]

    def where(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.path}:{line}" if line else self.path


def _key_lines(node: yaml.Node, path: str, lines: dict[str, int], file: str) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
            continue  # a complex key, or a ``<<: *anchor`` merge (its keys may be overridden)
        name = f"{path}{key_node.value}"
        line = key_node.start_mark.line + 1
        if name in lines:
            raise ConfigError(f"{file}:{line}: key '{name}' is given twice (first at line "
                              f"{lines[name]}); YAML would silently keep only the last one")
        lines[name] = line
        _key_lines(value_node, f"{name}.", lines, file)


def read_yaml(path: str | os.PathLike, what: str = "config") -> YamlFile:
    """A YAML config file as a mapping; ``ConfigError`` names the file and the line of any
    syntax error, duplicate key, or a top level that is not a mapping."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: not a UTF-8 text file (byte {e.start}); expected YAML "
                          f"{what} keys") from None
    except OSError as e:
        raise ConfigError(f"{name}: cannot read the {what} file: {e.strerror or e}") from None
    loader = yaml.SafeLoader(text)
    lines: dict[str, int] = {}
    try:
        node = loader.get_single_node()
        if node is not None:  # lines before constructing, which flattens ``<<`` merges
            _key_lines(node, "", lines, name)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        shown = ""
        if mark is not None and mark.line < len(text.splitlines()):
            shown = f"\n    {text.splitlines()[mark.line]}\n    {' ' * mark.column}^"
        raise ConfigError(f"{at}: malformed YAML: {_yaml_problem(e)}{shown}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{name}: YAML nested too deeply to be a {what} file") from None
    finally:
        loader.dispose()
    if data is None:
        return YamlFile(name, {}, {})
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: top level must be a mapping of {what} keys "
                          f"(key: value lines), got a {type(data).__name__}")
    return YamlFile(name, data, lines)


# --------------------------------------------------------------------- environment
ENV_NAMESPACES: dict[str, str] = {"LMC_SERVER_": "lmc.server.server_config.ServerConfig"}
"""Prefixes of ``LMC_*`` names that belong to another schema than the engine's: that schema's
loader reports its own misspellings, the engine's leaves them alone."""

OTHER_ENV: dict[str, str] = {
    "LMC_DEBUG_INVARIANTS": "pool invariant checks (lmc.memory.invariants)",
    "LMC_STRICT_COPIES": "strict copy completion checks (lmc.transfer.completion)",
    "LMC_CUDA_GATHER_MODE": "the CUDA gather kernel variant (lmc.transfer.cuda_copy)",
    "LMC_CUDA_SCATTER_MODE": "the CUDA scatter kernel variant (lmc.transfer.cuda_copy)",
    "LMC_CUDA_GATHER_BLOCKS": "the CUDA gathers' grid cap in thread blocks "
                              "(lmc.transfer.cuda_copy)",
    "LMC_FUZZ_SEED": "the daemon's stateful fuzz test",
    "LMC_FUZZ_SECONDS": "the daemon's stateful fuzz test",
    "LMC_CONTRACT_SEED": "the tier contract suite",
    "LMC_LATE_SEED": "the late-copy test harness",
    "LMC_PLAIN_VENV": "the plain-install CLI test",
    "LMC_TEST_SEED": "the seed of randomized tests (tests/workloads, tests/planner)",
}
"""``LMC_*`` variables read outside the config schemas (debug switches, tests, CI): known, so
never reported as misspellings. ``tests/core/test_settings.py`` greps the tree for reads."""

OTHER_ENV_PREFIXES: dict[str, str] = {
    "LMC_HYPOTHESIS_": "the test suite's hypothesis profiles",
    "LMC_VLLM_": "the vLLM venv used by CI and benchmarks",
    "LMC_SGLANG_": "the SGLang venv used by its integration tests",
    "LMC_DYNAMO_": "the Dynamo KV indexer venv used by the KV-event tests",
}


def env_name(prefix: str, key: str) -> str:
    return f"{prefix}{key.upper()}"


def unknown_env(environ: Mapping[str, str], prefix: str, keys: Iterable[str]) -> list[str]:
    """One message per variable under ``prefix`` that names no key of the schema (nor anything
    else lmc reads), with the closest valid name."""
    own = {env_name(prefix, k) for k in keys}
    foreign = tuple(p for p in (*ENV_NAMESPACES, *OTHER_ENV_PREFIXES)
                    if p.startswith(prefix) and p != prefix)
    out = []
    for var in sorted(environ):
        if (not var.startswith(prefix) or var in own or var in OTHER_ENV
                or var.startswith(foreign)):
            continue
        close = closest(var, sorted(own | set(OTHER_ENV)))
        hint = f"; did you mean {close}?" if close else ""
        out.append(f"environment variable {var} is not an lmc setting and is ignored{hint}")
    return out


MIN_SECRET_BYTES = 16
SECRET_HINT = 'e.g. python3 -c "import secrets; print(secrets.token_hex(32))"'


def check_secret(secret: bytes | str, setting: str = "integrity_secret") -> bytes:
    """The secret as used: stripped of surrounding whitespace, at least ``MIN_SECRET_BYTES``
    long (the same rule inline and in a file, each refusal naming ``setting``)."""
    if not isinstance(secret, (bytes, bytearray, memoryview, str)):
        raise ValueError(f"{setting}: expected a string, got {type(secret).__name__}")
    raw = (secret.encode() if isinstance(secret, str) else bytes(secret)).strip()
    if not raw:
        raise ValueError(f"{setting} is empty or only whitespace ({SECRET_HINT})")
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{setting}: at least {MIN_SECRET_BYTES} bytes of random secret are "
                         f"needed (surrounding whitespace does not count), got {len(raw)} "
                         f"({SECRET_HINT})")
    return raw


# ---------------------------------------------------------------------- the loader
@dataclasses.dataclass(frozen=True)
class Layer:
    """One source of settings and where each of its values came from, for messages."""

    values: Mapping[str, Any]
    origin: str                                   # "c.yaml", "the environment", "flags"
    lines: Mapping[str, int] = dataclasses.field(default_factory=dict)
    env_vars: Mapping[str, str] = dataclasses.field(default_factory=dict)  # key -> variable
    prefix: str = ""                              # written before every key ("lmc.")

    def where(self, key: str) -> str:
        if key in self.env_vars:
            return f"environment variable {self.env_vars[key]}"
        line = self.lines.get(key)
        return f"{self.origin}:{line}" if line else self.origin

    def label(self, key: str) -> str:
        return f"{self.prefix}{key}"

    @classmethod
    def from_yaml(cls, file: YamlFile, data: Mapping[str, Any] | None = None,
                  section: str = "", prefix: str = "") -> Layer:
        """``data`` (default: the whole file) as a layer; ``section`` is its dotted path."""
        lines = {k[len(section):]: n for k, n in file.lines.items() if k.startswith(section)}
        return cls(file.data if data is None else data, file.path, lines, prefix=prefix)


class Settings:
    """Base of a schema: parse every field, describe them, load them from layers.

    Subclasses are frozen dataclasses; ``ENV_PREFIX`` is how their environment variables
    start (``None``: none are read), ``WHAT`` names the schema in messages, ``OVERRIDES``
    names where :meth:`load`'s ``overrides`` come from."""

    ENV_PREFIX: ClassVar[str | None] = None
    WHAT: ClassVar[str] = "config"
    OVERRIDES: ClassVar[str] = "overrides"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # an unknown keyword would otherwise be the dataclass's raw TypeError
        # ("__init__() got an unexpected keyword argument"), with no hint
        check_known_keys(kwargs, cls.field_names(), f"{cls.__name__}()", cls.WHAT)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            object.__setattr__(self, f.name, f.metadata["parse"](getattr(self, f.name), f.name))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def describe(cls) -> list[tuple[str, Any, str]]:
        """(key, default, doc) for each key: references and ``--help`` are made from this."""
        return [(f.name, f.default, f.metadata["doc"])
                for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def check_keys(cls, data: Mapping[str, Any], origin: str) -> None:
        check_known_keys(data, cls.field_names(), origin, cls.WHAT)

    # ---------------------------------------------------------------- layers
    @classmethod
    def yaml_layer(cls, path: str | os.PathLike) -> Layer:
        return Layer.from_yaml(read_yaml(path, cls.WHAT))

    @classmethod
    def env_layer(cls, environ: Mapping[str, str] | None = None, report: bool = True) -> Layer:
        """The variables naming a key of this schema; with ``report``, warn about each
        ``LMC_*`` variable under this schema's prefix that nothing in lmc reads."""
        environ = os.environ if environ is None else environ
        prefix = cls.ENV_PREFIX
        if prefix is None:
            return Layer({}, "the environment")
        values, env_vars = {}, {}
        for key in cls.field_names():
            var = env_name(prefix, key)
            if var in environ:
                values[key], env_vars[key] = environ[var], var
        if report:
            for msg in unknown_env(environ, prefix, cls.field_names()):
                log.warning("%s", msg)
        return Layer(values, "the environment", env_vars=env_vars)

    @classmethod
    def from_layers(cls: type[S], layers: Iterable[Layer]) -> S:
        """Later layers win. Every key is checked against the schema and every value parsed
        before the object is built, so that a message can say where the bad one came from."""
        merged: dict[str, Any] = {}
        source: dict[str, Layer] = {}
        valid = cls.field_names()
        for layer in layers:
            check_known_keys(layer.values, valid, layer.origin, cls.WHAT, layer.prefix,
                             layer.where)
            for key, value in layer.values.items():
                merged[key], source[key] = value, layer
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        for key, value in merged.items():
            layer = source[key]
            try:
                fields[key].metadata["parse"](value, layer.label(key))
            except ValueError as e:
                nested = getattr(e, "key", None)
                at = layer.where(nested if isinstance(nested, str) and nested in layer.lines
                                 else key)
                raise ConfigError(f"{e} (in {at})", nested or key) from None
        out = cls(**merged)
        object.__setattr__(out, "_origins", {key: source[key].where(key) for key in merged})
        return out

    def origin(self, key: str) -> str | None:
        """Where ``key``'s value came from (``c.yaml:3``, ``environment variable
        LMC_REMOTE_URL``), for checks made after loading (the tier chain's); None for a
        default or a value given in code."""
        origins: Mapping[str, str] = getattr(self, "_origins", {})
        return origins.get(key)

    @classmethod
    def load(cls: type[S], path: str | os.PathLike | None = None,
             overrides: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> S:
        """Defaults < YAML file < environment (``ENV_PREFIX<KEY>``) < ``overrides``."""
        layers = [] if path is None else [cls.yaml_layer(path)]
        layers.append(cls.env_layer(environ))
        if overrides:
            layers.append(Layer(overrides, cls.OVERRIDES))
        return cls.from_layers(layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def public_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with every secret that is set shown as ``"***"``: safe to print."""
        out = self.to_dict()
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if not f.repr and out.get(f.name) is not None:
                out[f.name] = "***"
        return out
