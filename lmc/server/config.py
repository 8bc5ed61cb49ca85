"""The daemon's configuration: one schema, loaded from YAML < ``LMC_SERVER_<KEY>`` environment
< command-line flags, validated at start-up with messages that name the key.

Why its own schema rather than ``CacheConfig``: the daemon's keys (listen addresses, frame
bounds, quotas) mean nothing to an engine, and an engine's keys (chunk size, tenant) mean
nothing to the daemon. The storage inside the daemon is still configured with a
``CacheConfig``, built by :meth:`ServerConfig.cache_config` from ``size``/``disk``/``redis``
plus the free-form ``cache`` mapping (validated by ``CacheConfig`` itself).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from lmc.config import (
    CacheConfig,
    _parse_bool,
    _parse_choice,
    _parse_float,
    _parse_int,
    _parse_opt_str,
    check_known_keys,
    parse_size,
)
from lmc.server.auth import Authenticator, TokenSpec, nonempty_secret, parse_tokens
from lmc.server.protocol import Limits

DEFAULT_PORT = 7451
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _opt_port(v: Any, k: str) -> int | None:
    if v is None or v == "" or (isinstance(v, str) and v.lower() in ("none", "off", "null")):
        return None
    p = _parse_int(v, k, minimum=0)
    if p > 65535:
        raise ValueError(f"{k}: port must be <= 65535, got {p}")
    return p


def _opt_size(v: Any, k: str) -> int | None:
    return None if v is None or v == "" else parse_size(v, k)


def _quotas(v: Any, k: str) -> dict[str, int]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"{k}: expected a mapping of namespace to size, got {v!r}")
    return {str(ns): parse_size(size, f"{k}.{ns}") for ns, size in v.items()}


def _mapping(v: Any, k: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"{k}: expected a mapping, got {v!r}")
    return dict(v)


def _mode(v: Any, k: str) -> int:
    if isinstance(v, str):
        try:
            v = int(v, 8)
        except ValueError:
            raise ValueError(f"{k}: expected an octal file mode like 0600, got {v!r}") from None
    return _parse_int(v, k, minimum=0)


def _field(default: Any, parse, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"parse": parse, "doc": doc})


def _pos(v: Any, k: str) -> int:
    return _parse_int(v, k, minimum=1)


def _pos_size(v: Any, k: str) -> int:
    n = parse_size(v, k)
    if n <= 0:
        raise ValueError(f"{k}: must be > 0")
    return n


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Every daemon setting; ``lmc server --help`` lists them as flags."""

    # ---- listening
    host: str = _field("127.0.0.1", lambda v, k: _parse_opt_str(v, k) or "127.0.0.1",
                       "TCP address; anything but loopback must be asked for explicitly")
    port: int | None = _field(DEFAULT_PORT, _opt_port, "TCP port (0 = any free port, null = no TCP)")
    unix_socket: str | None = _field(None, _parse_opt_str, "path of a Unix socket to listen on")
    unix_socket_mode: int = _field("0600", _mode, "file mode of the Unix socket (octal)")
    token: str | None = _field(None, nonempty_secret,
                               "admin token every client must present first (never logged); "
                               "an admin token grants every namespace")
    token_file: str | None = _field(None, nonempty_secret,
                                    "file holding the admin token (keeps it out of argv and YAML)")
    tokens: tuple[TokenSpec, ...] = _field(None, parse_tokens,
                                           "tenant tokens: [{token_file, namespaces: [a, b]}, "
                                           "{token_file, admin: true}]; flag form FILE:ns1,ns2 "
                                           "or FILE:admin (repeatable)")
    hello_timeout: float = _field(5.0, lambda v, k: _parse_float(v, k, minimum=0.01),
                                  "seconds a new connection has to authenticate (HELLO) "
                                  "before it is closed")
    # ---- storage
    size: int = _field("1GiB", _pos_size, "memory pool (L1) size; the daemon never exceeds it")
    prefault: bool = _field(True, _parse_bool, "touch the whole pool at start-up so that no "
                            "request pays for page faults")
    hugepages: bool = _field(True, _parse_bool, "back the pool with transparent huge pages")
    eviction_policy: str = _field("lru", lambda v, k: _parse_choice(v, k, ("lru", "fifo")),
                                  "which unreferenced chunk the memory tier evicts first")
    disk: str | None = _field(None, _parse_opt_str,
                              "directory of a disk tier behind memory (persists across restarts)")
    disk_size: int = _field("16GiB", _pos_size, "bytes the disk tier may use")
    redis: str | None = _field(None, _parse_opt_str, "redis:// URL of a Redis tier behind disk")
    cache: dict[str, Any] = _field(None, _mapping,
                                   "extra CacheConfig keys for the storage (write_policy, ...)")
    # ---- tenants
    quota_default: int | None = _field(None, _opt_size,
                                       "memory bytes each namespace may hold (null = no limit)")
    quotas: dict[str, int] = _field(None, _quotas, "per-namespace memory quotas: {ns: size}")
    max_namespaces: int = _field(4096, _pos, "namespaces tracked for quotas at once")
    # ---- bounds
    max_meta: int = _field("1MiB", _pos_size, "bytes of metadata in one frame")
    max_payload: int = _field("256MiB", _pos_size, "bytes of payload in one frame")
    max_value: int = _field("256MiB", _pos_size, "bytes of one value")
    max_batch: int = _field(4096, _pos, "keys or values in one request")
    max_namespace: int = _field(64, lambda v, k: min(_pos(v, k), 64),
                                "bytes of a namespace name (at most 64)")
    max_connections: int = _field(1024, _pos, "open client connections; more are refused")
    max_unauthenticated: int | None = _field(
        None, lambda v, k: None if v is None or v == "" else _pos(v, k),
        "connections still before their HELLO (null = a quarter of max_connections); the "
        "rest of max_connections is kept for authenticated clients")
    frame_timeout: float = _field(30.0, lambda v, k: _parse_float(v, k, minimum=0.01),
                                  "seconds a half-received frame may stall before the "
                                  "connection is dropped")
    drain_timeout: float = _field(10.0, lambda v, k: _parse_float(v, k, minimum=0),
                                  "seconds SIGTERM waits for in-flight requests")
    io_threads: int = _field(2, _pos, "threads for lower-tier (disk, Redis) calls")
    # ---- operations
    metrics_host: str = _field("127.0.0.1", lambda v, k: _parse_opt_str(v, k) or "127.0.0.1",
                               "address of the /metrics and /healthz HTTP listener")
    metrics_port: int | None = _field(None, _opt_port,
                                      "port of /metrics and /healthz (0 = any, null = off)")
    log_level: str = _field("INFO", lambda v, k: _parse_choice(
        str(v).upper(), k, ("DEBUG", "INFO", "WARNING", "ERROR")), "logging level")
    ready_file: str | None = _field(None, _parse_opt_str,
                                    "write {pid, port, unix_socket, metrics_port} JSON here "
                                    "once listening (for supervisors and tests)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["parse"](getattr(self, f.name), f.name))
        if self.port is None and self.unix_socket is None:
            raise ValueError("port: no TCP port and no unix_socket: nothing to listen on")
        if self.redis and not self.redis.startswith(("redis://", "rediss://", "redis+")):
            raise ValueError(f"redis: expected a redis:// URL, got {self.redis!r}")
        if self.max_value > self.max_payload:
            object.__setattr__(self, "max_value", self.max_payload)
        for spec in self.tokens:
            for ns in spec.namespaces:
                if len(ns.encode()) > self.max_namespace:
                    raise ValueError(f"tokens[{spec.name}].namespaces: {ns!r} is longer than "
                                     f"max_namespace {self.max_namespace} bytes")
        if self.port is not None and not self.is_loopback() and not self.has_credentials:
            raise ValueError(f"host: {self.host} is not loopback and no token is configured: "
                             "anyone who can reach it could read and write the cache; set "
                             "token_file or tokens")
        self.cache_config()  # unknown or bad storage keys fail here, at start-up

    # ------------------------------------------------------------- derived
    @property
    def limits(self) -> Limits:
        return Limits(self.max_meta, self.max_payload, self.max_value, self.max_batch,
                      self.max_namespace)

    @property
    def has_credentials(self) -> bool:
        return bool(self.token or self.token_file or self.tokens)

    @property
    def unauthenticated_limit(self) -> int:
        """Connections allowed before HELLO: always below ``max_connections`` (when that is
        above 1), so authenticated clients keep a reserve nobody else can fill."""
        n = self.max_unauthenticated or max(1, self.max_connections // 4)
        return max(1, min(n, self.max_connections - 1))

    def authenticator(self) -> Authenticator:
        """The tokens, read from their files now (a missing or empty file fails start-up)."""
        return Authenticator.from_config(self.resolved_token(), self.tokens)

    def resolved_token(self) -> str | None:
        """The token, read from ``token_file`` when that is set."""
        if self.token_file:
            tok = Path(self.token_file).read_text().strip()
            if not tok:
                raise ValueError(f"token_file: {self.token_file} is empty")
            return tok
        return self.token

    def cache_config(self) -> CacheConfig:
        base = {"local_cpu_size": self.size, "pin_memory": "false",
                "eviction_policy": self.eviction_policy, "local_disk": self.disk,
                "local_disk_size": self.disk_size, "remote_url": self.redis}
        try:
            return CacheConfig(**{**base, **self.cache})
        except TypeError as e:  # an unknown key in `cache`
            raise ValueError(f"cache: {e}") from None

    # ------------------------------------------------------------- loading
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def check_keys(cls, data: Mapping[str, Any], origin: str) -> None:
        check_known_keys(data, cls.field_names(), origin, "server config")

    @classmethod
    def load(cls, path: str | os.PathLike | None = None,
             overrides: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> ServerConfig:
        """Defaults < YAML file < ``LMC_SERVER_<KEY>`` environment < ``overrides`` (flags)."""
        merged: dict[str, Any] = {}
        if path is not None:
            data = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{path}: top level must be a mapping of server config keys")
            cls.check_keys(data, str(path))
            merged.update(data)
        environ = os.environ if environ is None else environ
        for key in cls.field_names():
            var = f"LMC_SERVER_{key.upper()}"
            if var in environ:
                merged[key] = environ[var]
        if overrides:
            cls.check_keys(overrides, "flags")
            merged.update(overrides)
        return cls(**merged)

    @classmethod
    def describe(cls) -> list[tuple[str, Any, str]]:
        return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(cls)]

    def is_loopback(self) -> bool:
        return self.host in LOOPBACK
