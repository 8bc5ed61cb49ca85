"""The daemon's configuration: one schema, loaded from YAML < ``LMC_SERVER_<KEY>`` environment
< command-line flags by :mod:`lmc.settings` (the loader every lmc schema uses), validated at
start-up with messages that name the key and where it came from.

Why its own schema rather than ``CacheConfig``: the daemon's keys (listen addresses, frame
bounds, quotas) mean nothing to an engine, and an engine's keys (chunk size, tenant) mean
nothing to the daemon. The storage inside the daemon is still configured with a
``CacheConfig``, built by :meth:`ServerConfig.cache_config` from ``size``/``disk``/``redis``
plus the free-form ``cache`` mapping, whose keys and values are checked here, when the
config is loaded, against ``CacheConfig``'s own schema.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmc.config import CacheConfig, parse_remote_url
from lmc.server.auth import Authenticator, TokenSpec, nonempty_secret, parse_tokens, secret_file
from lmc.settings import (
    ConfigError,
    Settings,
    closest,
    parse_bool,
    parse_choice,
    parse_duration,
    parse_float,
    parse_int,
    parse_mapping,
    parse_opt_path,
    parse_opt_str,
    parse_positive_size,
    parse_size,
    setting,
)
from lmc.storage.backends.server.protocol import DEFAULT_PORT, Limits

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _opt_port(v: Any, k: str) -> int | None:
    if v is None or v == "" or (isinstance(v, str) and v.lower() in ("none", "off", "null")):
        return None
    p = parse_int(v, k, minimum=0)
    if p > 65535:
        raise ConfigError(f"{k}: port must be <= 65535, got {p}")
    return p


def _opt_size(v: Any, k: str) -> int | None:
    return None if v is None or v == "" else parse_size(v, k)


def _quotas(v: Any, k: str) -> dict[str, int]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ConfigError(f"{k}: expected a mapping of namespace to size, got {v!r}")
    return {str(ns): parse_size(size, f"{k}.{ns}") for ns, size in v.items()}


OWNED_CACHE_KEYS: dict[str, str] = {
    "local_cpu_size": "set by the daemon's own key 'size'",
    "local_disk": "set by the daemon's own key 'disk'",
    "local_disk_size": "set by the daemon's own key 'disk_size'",
    "remote_url": "set by the daemon's own key 'redis'",
    "eviction_policy": "set by the daemon's own key 'eviction_policy'",
    "local_cpu_prefault": "set by the daemon's own key 'prefault'",
    "pin_memory": "fixed: the daemon's pool is never page-locked",
}
"""CacheConfig keys the daemon sets itself: given under ``cache`` they would contradict what
``size``/``disk``/... say, so they are refused, naming the key to use."""


def _cache(v: Any, k: str) -> dict[str, Any]:
    """Extra CacheConfig keys for the daemon's storage, each key and value checked against
    CacheConfig's schema now (an unknown key names the closest one)."""
    out = parse_mapping(v, k)
    fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
    for key, value in out.items():
        if key in OWNED_CACHE_KEYS:
            raise ConfigError(f"{k}.{key}: not a daemon setting ({OWNED_CACHE_KEYS[key]})",
                              f"{k}.{key}")
        if key not in fields:
            close = closest(key, fields)
            hint = f"; did you mean {close!r}?" if close else ""
            if close in OWNED_CACHE_KEYS:
                hint += f" ({OWNED_CACHE_KEYS[close]})"
            raise ConfigError(f"{k}: unknown config key {key!r}{hint}", f"{k}.{key}")
        try:
            parsed = fields[key].metadata["parse"](value, f"{k}.{key}")
            if key == "tiers" and parsed:
                _check_registered(parsed[1:])
        except ValueError as e:
            raise ConfigError(str(e), f"{k}.{key}") from None
    return out


def _check_registered(entries: Any) -> None:
    """The registries' check of tier entries (:func:`lmc.storage.chain.check_entry`), made
    when the daemon's config loads: it is the daemon's start-up, and its file's line is
    named. Imported here, not at load: ``lmc stats`` reads this module without torch."""
    from lmc.storage.chain import check_entry

    for entry in entries:
        check_entry(entry)


def _backend_url(v: Any, k: str) -> str | None:
    """A URL whose scheme a registered backend claims (checked now, naming the key)."""
    url = parse_remote_url(v, k)
    if url is not None:
        from lmc.storage.tier import backend_factory

        try:
            backend_factory(url)
        except ValueError as e:
            raise ConfigError(f"{k}: {e}") from None
    return url


def _mode(v: Any, k: str) -> int:
    if isinstance(v, str):
        try:
            v = int(v, 8)
        except ValueError:
            raise ConfigError(f"{k}: expected an octal file mode like 0600, got {v!r}") from None
    return parse_int(v, k, minimum=0)


def _kv_events(v: Any, k: str) -> dict[str, Any] | None:
    """The ``kv_events`` mapping: the engine's keys (vLLM's ``--kv-events-config`` and
    lmc's), checked by :class:`lmc.events.events_config.EventsConfig`; null = off."""
    if v is None or v == "":
        return None
    out = parse_mapping(v, k)
    from lmc.events.events_config import EventsConfig
    try:
        EventsConfig.from_mapping(out)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{k}: {e}") from None
    return out


def _share(v: Any, k: str) -> float:
    out = parse_float(v, k, minimum=0.0)
    if out > 1:
        raise ConfigError(f"{k} must be a fraction in [0, 1], got {v!r}")
    return out


def _pos(v: Any, k: str) -> int:
    return parse_int(v, k, minimum=1)


def _seconds(minimum: float):
    return lambda v, k: parse_duration(v, k, minimum=minimum)


@dataclasses.dataclass(frozen=True)
class ServerConfig(Settings):
    """Every daemon setting; ``lmc server --help`` lists them as flags."""

    ENV_PREFIX = "LMC_SERVER_"
    WHAT = "server config"
    OVERRIDES = "flags"

    # ---- listening
    host: str = setting("127.0.0.1", lambda v, k: parse_opt_str(v, k) or "127.0.0.1",
                        "TCP address; anything but loopback must be asked for explicitly")
    port: int | None = setting(DEFAULT_PORT, _opt_port,
                               "TCP port (0 = any free port, null = no TCP)")
    unix_socket: str | None = setting(None, parse_opt_path, "path of a Unix socket to listen on")
    unix_socket_mode: int = setting("0600", _mode, "file mode of the Unix socket (octal)")
    token: str | None = setting(None, nonempty_secret,
                                "admin token every client must present first (never logged); "
                                "an admin token grants every namespace")
    token_file: str | None = setting(None, secret_file,
                                     "file holding the admin token (keeps it out of argv "
                                     "and YAML)")
    tokens: tuple[TokenSpec, ...] = setting(None, parse_tokens,
                                            "tenant tokens: [{token_file, namespaces: [a, b]}, "
                                            "{token_file, admin: true}]; flag form FILE:ns1,ns2 "
                                            "or FILE:admin (repeatable)")
    hello_timeout: float = setting(5.0, _seconds(0.01),
                                   "seconds a new connection has to authenticate (HELLO) "
                                   "before it is closed", unit="duration")
    # ---- storage
    size: int = setting("1GiB", parse_positive_size,
                        "memory pool (L1) size; the daemon never exceeds it", unit="size")
    prefault: bool = setting(True, parse_bool, "touch the whole pool at start-up so that no "
                             "request pays for page faults")
    hugepages: bool = setting(True, parse_bool, "back the pool with transparent huge pages")
    eviction_policy: str = setting("lru", lambda v, k: parse_choice(v, k, ("lru", "fifo")),
                                   "which unreferenced chunk the memory tier evicts first")
    disk: str | None = setting(None, parse_opt_path,
                               "directory of a disk tier behind memory (persists across restarts)")
    disk_size: int = setting("16GiB", parse_positive_size, "bytes the disk tier may use",
                             unit="size")
    redis: str | None = setting(None, _backend_url,
                                "URL of a shared tier behind disk: redis://, rediss://, "
                                "redis+cluster://, lmc://, or any scheme a registered "
                                "backend claims (as an engine's remote_url)")
    write_retry: float = setting(10.0, _seconds(0),
                                 "seconds a failed write to a lower tier is retried (doubling "
                                 "backoff from 0.25 s) while memory keeps the value; 0 = drop "
                                 "it at once", unit="duration")
    write_wait: float = setting(0.5, _seconds(0),
                                "seconds a PUT waits for room in a full write-behind queue "
                                "(a lower tier slower than the writers) before it is answered "
                                "and the tier misses those values (dropped, counted)",
                                unit="duration")
    cache: dict[str, Any] = setting(None, _cache,
                                    "extra CacheConfig keys for the storage (write_policy, ...)")
    # ---- tenants
    quota_default: int | None = setting(None, _opt_size,
                                        "memory bytes each namespace may hold (null = no limit)",
                                        unit="size")
    quotas: dict[str, int] = setting(None, _quotas, "per-namespace memory quotas: {ns: size}")
    max_namespaces: int = setting(4096, _pos, "namespaces tracked for quotas at once")
    max_pins: int = setting(65536, lambda v, k: parse_int(v, k, minimum=0),
                            "chunks one namespace may hold pinned (PIN) at once; a PIN past "
                            "it is refused")
    max_pin_share: float = setting(0.5, lambda v, k: _share(v, k),
                                   "share of the pool one namespace's pins may hold (and never "
                                   "more than its quota); a PIN past it is refused")
    max_pin_ttl: float = setting(3600.0, _seconds(0.001),
                                 "the longest TTL a PIN may ask for; longer is refused",
                                 unit="duration")
    # ---- bounds
    max_meta: int = setting("1MiB", parse_positive_size, "bytes of metadata in one frame",
                            unit="size")
    max_payload: int = setting("256MiB", parse_positive_size, "bytes of payload in one frame",
                               unit="size")
    max_value: int = setting("256MiB", parse_positive_size, "bytes of one value", unit="size")
    max_batch: int = setting(4096, _pos, "keys or values in one request")
    max_namespace: int = setting(64, lambda v, k: min(_pos(v, k), 64),
                                 "bytes of a namespace name (at most 64)")
    max_connections: int = setting(1024, _pos, "open client connections; more are refused")
    max_unauthenticated: int | None = setting(
        None, lambda v, k: None if v is None or v == "" else _pos(v, k),
        "connections still before their HELLO (null = a quarter of max_connections); the "
        "rest of max_connections is kept for authenticated clients")
    fd_reserve: int = setting(64, lambda v, k: parse_int(v, k, minimum=0),
                              "file descriptors kept below RLIMIT_NOFILE for the tiers (disk "
                              "files, Redis connections) and the /metrics listener (32): "
                              "max_connections is lowered so that accepting never takes them")
    frame_timeout: float = setting(30.0, _seconds(0.01),
                                   "seconds a half-received frame may stall before the "
                                   "connection is dropped", unit="duration")
    drain_timeout: float = setting(10.0, _seconds(0),
                                   "seconds SIGTERM waits for in-flight requests", unit="duration")
    io_threads: int = setting(2, _pos, "threads for lower-tier (disk, Redis) calls")
    # ---- KV events (docs/events.md): what this daemon holds, for routers
    kv_events: dict[str, Any] | None = setting(
        None, _kv_events, "publish KV events for the chunks held: the engine's kv_events "
        "keys, e.g. {enable_kv_cache_events: true, endpoint: 'tcp://*:5557', block_size: 16} "
        "(null = off)")
    # ---- operations
    metrics_host: str = setting("127.0.0.1", lambda v, k: parse_opt_str(v, k) or "127.0.0.1",
                                "address of the /metrics and /healthz HTTP listener")
    metrics_port: int | None = setting(None, _opt_port,
                                       "port of /metrics and /healthz (0 = any, null = off)")
    log_level: str = setting("INFO", lambda v, k: parse_choice(
        str(v).upper(), k, ("DEBUG", "INFO", "WARNING", "ERROR")), "logging level")
    ready_file: str | None = setting(None, parse_opt_path,
                                     "write {pid, port, unix_socket, metrics_port} JSON here "
                                     "once listening (for supervisors and tests)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.port is None and self.unix_socket is None:
            raise ConfigError("port: no TCP port and no unix_socket: nothing to listen on")
        if self.max_value > self.max_payload:
            object.__setattr__(self, "max_value", self.max_payload)
        for spec in self.tokens:
            for ns in spec.namespaces:
                if len(ns.encode()) > self.max_namespace:
                    raise ConfigError(f"tokens[{spec.name}].namespaces: {ns!r} is longer than "
                                     f"max_namespace {self.max_namespace} bytes")
        if self.port is not None and not self.is_loopback() and not self.has_credentials:
            raise ConfigError(f"host: {self.host} is not loopback and no token is configured: "
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
                raise ConfigError(f"token_file: {self.token_file} is empty")
            return tok
        return self.token

    def cache_config(self) -> CacheConfig:
        base = {"local_cpu_size": self.size, "pin_memory": "false",
                "eviction_policy": self.eviction_policy, "local_disk": self.disk,
                "local_disk_size": self.disk_size, "remote_url": self.redis}
        if self.cache.get("tiers") is not None and (self.disk or self.redis):
            both = " and ".join(k for k in ("disk", "redis") if getattr(self, k))
            raise ConfigError(f"cache.tiers: given together with {both}; write the whole "
                              f"chain in cache.tiers or use {both} alone", "cache.tiers")
        return CacheConfig(**{**base, **self.cache})

    def is_loopback(self) -> bool:
        return self.host in LOOPBACK
