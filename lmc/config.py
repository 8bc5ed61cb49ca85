"""Typed configuration: YAML file, then ``LMC_<KEY>`` environment variables, then an explicit dict.

One schema (``CacheConfig``) is the single source of truth for every key, its type, its default
and what values are allowed, so that a bad key or value fails at start-up with a message that
names it, rather than deep inside a tier at the first request.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string like ``"4GiB"``, ``"512MB"``, ``"1.5 GiB"``, ``"1048576"``.

    SI suffixes (kB, MB, GB) are powers of 1000, IEC suffixes (KiB, MiB, GiB) powers of 1024.
    """
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a size like '4GiB' or a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{key}: size must be >= 0, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ValueError(
        f"{key}: cannot parse size {value!r}; use bytes or a number with one of "
        "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '4GiB', '512MB')"
    )


def _parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key}: expected true/false, got {value!r}")


def _parse_int(value: Any, key: str, minimum: int | None = None) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    try:
        out = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        out = None
    if out is None:
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    if minimum is not None and out < minimum:
        raise ValueError(f"{key}: must be >= {minimum}, got {out}")
    return out


def _parse_float(value: Any, key: str, minimum: float | None = None) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or out != out:
        raise ValueError(f"{key}: expected a number, got {value!r}")
    if minimum is not None and out < minimum:
        raise ValueError(f"{key}: must be >= {minimum}, got {out}")
    return out


def _parse_choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in choices:
        return value
    raise ValueError(f"{key}: {value!r} is not allowed; choose one of {', '.join(choices)}")


def _parse_opt_str(value: Any, key: str) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{key}: expected a string, got {value!r}")


def check_known_keys(data: Mapping[str, Any], valid: tuple[str, ...], origin: str,
                     what: str) -> None:
    """``ValueError`` naming the first unknown key in ``data`` and the closest valid one."""
    for key in data:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {what} key {key!r} in {origin}{hint}")


def _field(default: Any, parse, doc: str, secret: bool = False) -> Any:
    """A config key; a ``secret`` one is left out of the config's repr (so never logged)."""
    return dataclasses.field(default=default, repr=not secret,
                             metadata={"parse": parse, "doc": doc})


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Every lmc setting. Construct directly, or with :meth:`load` / :meth:`from_yaml`."""

    chunk_size: int = _field(
        256, lambda v, k: _parse_int(v, k, minimum=1),
        "tokens per chunk; each chunk is one content-addressed object")
    local_cpu_size: int = _field(
        "2GiB", parse_size, "bytes of the pinned/plain CPU pool that backs the L1 tier")
    save_unfull_chunk: bool = _field(
        True, _parse_bool, "also key and store the last partial chunk of a prompt")
    tenant: str | None = _field(
        None, _parse_opt_str, "salt mixed into every key: tenants never share KV")
    eviction_policy: str = _field(
        "lru", lambda v, k: _parse_choice(v, k, ("lru", "fifo")),
        "which unreferenced chunk the L1 tier evicts first")
    pin_memory: str = _field(
        "auto", lambda v, k: _parse_choice(str(v).lower(), k, ("auto", "true", "false")),
        "page-lock the pool: auto = when CUDA is available")
    debug_leaks: bool = _field(
        False, _parse_bool, "record allocation sites of memory objects and report leaks")
    max_pinned_chunks: int = _field(
        4096, lambda v, k: _parse_int(v, k, minimum=0),
        "chunks lookup(pin=True) may hold pinned at once; further pins are refused")
    pin_timeout: float = _field(
        60.0, lambda v, k: _parse_float(v, k, minimum=0.001),
        "seconds a pin lives if no retrieve or unpin releases it first")
    # ---- lower tiers
    local_disk: str | None = _field(
        None, _parse_opt_str, "directory of the local disk tier; unset = no disk tier")
    local_disk_size: int = _field(
        "16GiB", parse_size, "bytes the disk tier may use; least recently used chunks go first")
    disk_fsync: bool = _field(
        False, _parse_bool, "fsync each disk value before it becomes visible (power-loss safe)")
    remote_url: str | None = _field(
        None, _parse_opt_str,
        "remote tier: redis://, rediss://, redis+cluster://host:port,... (unset = none)")
    remote_token: str | None = _field(
        None, _parse_opt_str, "shared token sent to an lmc:// cache server (never logged)",
        secret=True)
    integrity_secret: str | None = _field(
        None, _parse_opt_str,
        "secret (>= 16 bytes) keying a tag on every value of a shared tier (Redis, lmc://); "
        "values without a valid tag are misses (never logged; docs/integrity.md)", secret=True)
    integrity_secret_file: str | None = _field(
        None, _parse_opt_str, "file holding integrity_secret (instead of the value itself)")
    remote_timeout: float = _field(
        1.0, lambda v, k: _parse_float(v, k, minimum=0.001),
        "seconds any remote call may take before it counts as a miss")
    remote_key_prefix: str = _field(
        "lmc", lambda v, k: _parse_opt_str(v, k) or "lmc",
        "prefix of every remote key, so deployments can share a server")
    remote_ttl: float = _field(
        0, lambda v, k: _parse_float(v, k, minimum=0),
        "seconds a remote value lives (0 = no expiry)")
    remote_connections: int = _field(
        4, lambda v, k: _parse_int(v, k, minimum=1),
        "parallel connections to the remote tier for large values")
    write_policy: str = _field(
        "write_through", lambda v, k: _parse_choice(v, k, ("write_through", "write_on_evict")),
        "when L1 chunks flow to lower tiers: on every store, or when evicted from L1")
    write_queue_size: int = _field(
        "1GiB", parse_size,
        "bytes of chunks waiting to be written to lower tiers, per tier, at most half the pool "
        "(a quarter under write_on_evict); beyond it writes are dropped")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            parsed = f.metadata["parse"](getattr(self, f.name), f.name)
            object.__setattr__(self, f.name, parsed)

    # ----------------------------------------------------------------- loading
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def _check_keys(cls, data: Mapping[str, Any], origin: str) -> None:
        check_known_keys(data, cls.field_names(), origin, "config")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The ``LMC_<KEY>`` variables that name a known key (others are left alone)."""
        environ = os.environ if environ is None else environ
        out = {}
        for key in cls.field_names():
            var = f"LMC_{key.upper()}"
            if var in environ:
                out[key] = environ[var]
        return out

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        overrides: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> CacheConfig:
        """Defaults < YAML file < ``LMC_<KEY>`` environment < ``overrides``."""
        merged: dict[str, Any] = {}
        if path is not None:
            text = Path(path).read_text()
            data = yaml.safe_load(text) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{path}: top level must be a mapping of config keys")
            cls._check_keys(data, str(path))
            merged.update(data)
        merged.update(cls.from_env(environ))
        if overrides:
            cls._check_keys(overrides, "overrides")
            merged.update(overrides)
        return cls(**merged)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Mapping[str, Any] | None = None
                  ) -> CacheConfig:
        return cls.load(path, overrides=overrides)

    def replace(self, **changes: Any) -> CacheConfig:
        self._check_keys(changes, "replace()")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def describe(cls) -> list[tuple[str, Any, str]]:
        """(key, default, doc) for each key: the README's config reference is made from this."""
        return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(cls)]
