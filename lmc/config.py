"""Typed configuration of an lmc engine: YAML file, then ``LMC_<KEY>`` environment variables,
then an explicit dict (loaded by :mod:`lmc.settings`, like every lmc schema).

One schema (``CacheConfig``) is the single source of truth for every key, its type, its default
and what values are allowed, so that a bad key or value fails at start-up with a message that
names it, rather than deep inside a tier at the first request.

Its keys are generic: what every engine has (chunking, L1), the built-in disk tier, and what
any remote tier needs (where it is, a deadline, a namespace, a credential -- a secret, kept
out of printed mappings -- and integrity). What only one backend means (Redis's ``ttl``,
connection counts) is that backend's option, declared by the backend and given under
``remote_options`` (:mod:`lmc.storage.tier`); keys that were such options are kept as
deprecated aliases (:data:`DEPRECATED_KEYS`).

A plain schema: values are checked here for what they are (a size, a URL, a list of tiers
shaped as a chain); what needs the storage registries -- that a backend of that name, or
claiming that URL scheme, exists, is or is not a wrapper, takes those options; that an
eviction policy is registered -- is checked by the chain that builds the tiers
(:func:`lmc.storage.chain.check_chain`), before any is built, naming the key and where it was
given (:meth:`lmc.settings.Settings.origin`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any, TypeVar

import yaml

from lmc.events.events_config import EventsConfig
from lmc.settings import (
    ConfigError,
    Layer,
    Parser,
    Settings,
    check_known_keys,
    check_secret,
    parse_bool,
    parse_choice,
    parse_duration,
    parse_float,
    parse_int,
    parse_mapping,
    parse_opt_str,
    parse_positive_size,
    parse_size,
    read_yaml,
    setting,
)

__all__ = ["DEPRECATED_KEYS", "CacheConfig", "ConfigError", "TierEntry", "check_known_keys",
           "load_connector_settings", "parse_remote_url", "parse_size", "parse_tiers"]
log = logging.getLogger(__name__)
Opts = TypeVar("Opts", bound=Settings)
EXTRA_PREFIX = "lmc."


def parse_remote_url(value: Any, key: str) -> str | None:
    """A URL (``scheme://...``). Whether a registered backend claims its scheme is the tier
    chain's check (:func:`lmc.storage.chain.check_chain`), made before any tier is built."""
    url = parse_opt_str(value, key)
    if url is None:
        return None
    if "://" not in url:
        raise ConfigError(f"{key}: expected a URL such as redis://host:6379 or lmc://host:7451, "
                          f"got {url!r}")
    return url


def _options(value: Any, key: str) -> dict[str, Any]:
    """Keyword options for one backend: names must be usable as Python keywords."""
    out = parse_mapping(value, key)
    for name in out:
        if not name.isidentifier():
            raise ConfigError(f"{key}: option name {name!r} is not a valid keyword name")
    return out


def _kv_events(value: Any, key: str) -> dict[str, Any] | None:
    """The ``kv_events`` mapping (vLLM's ``--kv-events-config`` keys and lmc's), checked by
    its own schema, :class:`lmc.events.events_config.EventsConfig`."""
    if value is None:
        return None
    out = parse_mapping(value, key)
    try:
        EventsConfig.from_mapping(out)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from None
    return out


def _fraction(value: Any, key: str) -> float:
    v = parse_float(value, key, minimum=0.0)
    if v > 1:
        raise ConfigError(f"{key} must be a fraction in [0, 1], got {value!r}")
    return v


DEPRECATED_KEYS: dict[str, str] = {"remote_ttl": "ttl", "remote_connections": "connections"}
"""Core keys that were options of particular backends -> the option's name now. They still
work (a warning, once per process, names the new spelling), passed to the remote backend if
it declares that option -- as before, when other backends ignored them."""
_warned: set[str] = set()


def _deprecated(parse: Parser) -> Parser:
    """A deprecated key's parser: unset (``None``) stays unset, a value is checked as before."""
    return lambda v, k: None if v is None else parse(v, k)


def _warn_deprecated(key: str, value: Any) -> None:
    if key in _warned:
        return
    _warned.add(key)
    option = DEPRECATED_KEYS[key]
    log.warning("config key %s is deprecated: it is an option of the remote tier's backend "
                "now; write remote_options: {%s: %s} (or LMC_REMOTE_OPTIONS='{%s: %s}', or "
                "?%s=%s in remote_url)", key, option, value, option, value, option, value)



def _parse_secret(value: Any, key: str) -> str | None:
    """``integrity_secret`` checked when loaded, by the rule the tiers use
    (:func:`lmc.settings.check_secret`), so a bad one is refused naming where it came from
    (``c.yaml:3``, ``environment variable LMC_INTEGRITY_SECRET``)."""
    text = parse_opt_str(value, key)
    if text is not None:
        try:
            check_secret(text, key)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return text


# ------------------------------------------------------------------------ the tier chain
MEMORY_NAMES = ("memory", "cpu")
"""What the first entry of ``tiers`` may be called (the L1 backend is registered as ``cpu``)."""
TIER_CONFIG_KEYS = ("remote_timeout", "remote_key_prefix", "remote_token", "integrity_secret",
                    "integrity_secret_file")
"""Core keys an entry of ``tiers`` may set for its own tier only (two remote tiers with two
deadlines, tokens or secrets); every other name in an entry is an option of its backend."""


@dataclasses.dataclass(frozen=True)
class TierEntry:
    """One tier of the chain: a backend (a name such as ``disk`` or a URL), its own options
    (checked and parsed by the backend's ``OPTIONS`` when built), core keys set for this tier
    only, and -- for a wrapper tier (``wrap:``) -- the tier it wraps."""

    backend: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inner: TierEntry | None = None
    where: str = dataclasses.field(default="tiers", compare=False)
    """Where config gave it (``tiers[2]``): named in every error about it."""
    shorthand: bool = dataclasses.field(default=False, compare=False)
    """Translated from ``remote_url``: its options also come from the URL's query and the
    deprecated keys, as they always did."""


    def __repr__(self) -> str:  # a config is logged: a token set for one tier stays hidden
        return f"TierEntry({self.as_config(public=True)!r})"

    def as_config(self, *, public: bool = False) -> str | dict[str, Any]:
        """The entry as ``tiers:`` takes it (what ``lmc config`` prints and reads back);
        ``public``: secrets this entry sets shown as ``***``."""
        conf = {k: ("***" if public and v is not None and k in _SECRET_TIER_KEYS else v)
                for k, v in self.config.items()}
        if self.inner is not None:
            return {"wrap": self.backend, "tier": self.inner.as_config(public=public),
                    **self.options, **conf}
        if not self.options and not conf:
            return "memory" if self.backend == "cpu" else self.backend
        return {"backend": self.backend, **self.options, **conf}


_SECRET_TIER_KEYS = ("remote_token", "integrity_secret")
CODEC_KEYS = ("codec", "head_size", "gate", "verdicts")
"""Keys of a ``tiers:`` entry that configure its codec stage rather than its backend."""


def _tier_entry(value: Any, where: str) -> TierEntry:
    """An entry: a name or URL, ``{backend: ..., <option>: ...}`` or ``{wrap: <wrapper>,
    tier: <entry>, <option>: ...}``."""
    if isinstance(value, TierEntry):
        return value
    if isinstance(value, str):
        value = {"backend": value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a backend name or URL, or a mapping with "
                          f"'backend:' (or 'wrap:' and 'tier:'), got {value!r}")
    rest = dict(value)
    for k in rest:
        if not isinstance(k, str) or not k.isidentifier():
            raise ConfigError(f"{where}: option name {k!r} is not a valid keyword name")
    if "codec" in rest and rest.get("wrap") != "codec":
        # a codec is a stage of this tier: {backend: disk, ..., codec: fp8} is the disk tier
        # wrapped by the codec tier (lmc.storage.kvcodecs.tier), its options beside it
        stage = {k: rest.pop(k) for k in CODEC_KEYS if k in rest}
        return TierEntry("codec", stage, {}, _tier_entry(rest, where), where)
    inner = None
    if "wrap" in rest:
        backend = rest.pop("wrap")
        if "tier" not in rest:
            raise ConfigError(f"{where}: 'wrap: {backend}' needs 'tier:', the tier it wraps")
        inner = _tier_entry(rest.pop("tier"), f"{where}.tier")
    elif "backend" in rest:
        backend = rest.pop("backend")
    else:
        raise ConfigError(f"{where}: a tier needs 'backend:' (a name such as disk, or a URL) "
                          f"or 'wrap:' (got keys {', '.join(map(str, rest)) or 'none'})")
    if not isinstance(backend, str) or not backend:
        raise ConfigError(f"{where}: the backend must be a name or URL, got {backend!r}")
    conf = {k: rest.pop(k) for k in TIER_CONFIG_KEYS if k in rest}
    return TierEntry(backend, rest, conf, inner, where)


def _is_memory(e: TierEntry) -> bool:
    return e.inner is None and e.backend in MEMORY_NAMES


def parse_tiers(value: Any, key: str) -> tuple[TierEntry, ...] | None:
    """The ``tiers`` list (or, from an environment variable, its YAML text): memory first,
    then any tiers in any order and number. The list's shape is checked now; backend names,
    URL schemes and each backend's options by the registries, when the chain is checked or
    built (:mod:`lmc.storage.chain`)."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"{key}: expected a list such as '[memory, disk]', cannot parse "
                              f"{value!r}: {err}") from None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected a list of tiers, memory first, got {value!r}")
    entries = [_tier_entry(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if not entries or not _is_memory(entries[0]):
        raise ConfigError(f"{key}: the first tier must be memory (the pool, sized by "
                          f"local_cpu_size), e.g. [memory, disk, 'redis://host:6379']")
    if entries[0].options or entries[0].config:
        raise ConfigError(f"{key}[0]: the memory tier takes no options here (its size is "
                          f"local_cpu_size, its policy eviction_policy)")
    for e in entries[1:]:
        if _is_memory(e):
            raise ConfigError(f"{e.where}: only the first tier is memory")
        while e.inner is not None:
            if _is_memory(e.inner):
                raise ConfigError(f"{e.where}.tier: the memory tier cannot be wrapped")
            e = e.inner
    return (TierEntry("cpu", where=f"{key}[0]"), *entries[1:])


def _speed_priors(value: Any, key: str) -> dict[str, float]:
    """``load_policy_priors``: bytes per second (a size such as ``2GiB``) by tier name or
    medium, and ``prefill`` in tokens per second."""
    out: dict[str, float] = {}
    for name, v in parse_mapping(value, key).items():
        where = f"{key}.{name}"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}: keys are tier names or media, got {name!r}")
        n = parse_int(v, where, minimum=1) if name == "prefill" else parse_positive_size(v, where)
        top = MAX_PREFILL_PRIOR if name == "prefill" else MAX_SPEED_PRIOR
        if n > top:  # also keeps a 400-digit integer from overflowing a float
            shown = repr(v) if len(repr(v)) <= 24 else repr(v)[:20] + "..."
            raise ConfigError(f"{where}: {shown} is beyond any machine (at most {top:.0e} "
                              f"{'tokens' if name == 'prefill' else 'bytes'} per second)")
        out[name] = float(n)
    return out


MAX_PREFILL_PRIOR = 10**12  # tokens per second
MAX_SPEED_PRIOR = 1 << 60  # bytes per second


def _policy_name(value: Any, key: str) -> str:
    """An eviction policy's name; that a policy of that name is registered is checked with
    the tier chain (policies are registered objects of the storage layer)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected the name of an eviction policy, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class CacheConfig(Settings):
    """Every lmc setting. Construct directly, or with :meth:`load` / :meth:`from_yaml`."""

    ENV_PREFIX = "LMC_"

    chunk_size: int = setting(
        256, lambda v, k: parse_int(v, k, minimum=1),
        "tokens per chunk; each chunk is one content-addressed object")
    local_cpu_size: int = setting(
        "2GiB", parse_positive_size, "bytes of the pinned/plain CPU pool that backs the L1 tier",
        unit="size")
    save_unfull_chunk: bool = setting(
        True, parse_bool, "also key and store the last partial chunk of a prompt")
    tenant: str | None = setting(
        None, parse_opt_str, "salt mixed into every key: tenants never share KV")
    model_revision: str | None = setting(
        None, parse_opt_str, "the checkpoint's revision as you name it (a tag, a commit): "
        "replaces the digest of every weight byte in the model identity, so start-up reads no "
        "weights; weights changed without a new revision are served the old ones' KV")
    eviction_policy: str = setting(
        "lru", _policy_name,
        "which unreferenced chunk the L1 tier evicts first (lmc.storage.eviction's registered "
        "policies; checked with the tier chain)")
    pin_memory: str = setting(
        "auto", lambda v, k: parse_choice(str(v).lower(), k, ("auto", "true", "false")),
        "page-lock the pool: auto = when CUDA is available")
    local_cpu_prefault: str = setting(
        "background", lambda v, k: parse_choice(str(v).lower(), k, ("background", "off")),
        "prepare the pool from start-up in a background thread: an unpinned pool's pages are "
        "populated so stores do not pay first-touch faults (off: pages fault on first write); "
        "a pinned pool is page-locked in steps ahead of allocation (off: all of it at start)")
    debug_leaks: bool = setting(
        False, parse_bool, "record allocation sites of memory objects and report leaks")
    max_pinned_chunks: int = setting(
        4096, lambda v, k: parse_int(v, k, minimum=0),
        "chunks lookup(pin=True) may hold pinned at once; further pins are refused")
    pin_timeout: float = setting(
        60.0, lambda v, k: parse_duration(v, k, minimum=0.001),
        "seconds (or '500ms', '5m') a pin lives if no retrieve or unpin releases it first",
        unit="duration")
    max_ttl_pins: int = setting(
        65536, lambda v, k: parse_int(v, k, minimum=0),
        "chunks CacheEngine.pin (and requests' session hints) may hold pinned at once, per "
        "namespace; a pin past it is refused (PinLimitError)")
    max_pin_share: float = setting(
        0.5, lambda v, k: _fraction(v, k),
        "share of local_cpu_size those pins may hold; a pin past it is refused")
    max_pin_ttl: float = setting(
        3600.0, lambda v, k: parse_duration(v, k, minimum=0.001),
        "the longest TTL a pin may ask for (seconds, or '5m', '1h'); longer is refused "
        "(TTLError)", unit="duration")
    funnel: bool = setting(
        True, parse_bool, "classify every lookup for the hit-rate funnel (best possible, "
        "found per tier, misses by reason: lmc.storage.funnel); costs one more hash of the "
        "prompt per lookup")
    # ---- lower tiers
    local_disk: str | None = setting(
        None, parse_opt_str, "directory of the local disk tier; unset = no disk tier")
    local_disk_size: int = setting(
        "16GiB", parse_positive_size,
        "bytes the disk tier may use; least recently used chunks go first", unit="size")
    disk_fsync: bool = setting(
        False, parse_bool, "fsync each disk value before it becomes visible (power-loss safe)")
    remote_url: str | None = setting(
        None, parse_remote_url,
        "remote tier: redis://, rediss://, redis+cluster://host:port,..., lmc://host:port, or "
        "any scheme a registered backend claims (unset = none)")
    remote_options: dict[str, Any] = setting(
        None, _options,
        "options of the remote tier's backend (each backend declares its own: connections, "
        "ttl, ...), also given as the URL's query (a mapping; LMC_REMOTE_OPTIONS takes YAML "
        "such as '{connections: 8}')", hashed=False)
    remote_token: str | None = setting(
        None, parse_opt_str, "shared token sent to an lmc:// cache server (never logged)",
        secret=True)
    integrity_secret: str | None = setting(
        None, _parse_secret,
        "secret (>= 16 bytes, surrounding whitespace not counted) keying a tag on every value "
        "of a shared tier (Redis, lmc://); values without a valid tag are misses (never "
        "logged; docs/integrity.md)", secret=True)
    integrity_secret_file: str | None = setting(
        None, parse_opt_str,
        "file holding integrity_secret (instead of the value itself; same rule; mode 600: "
        "readable by others warns, writable by others is refused)")
    remote_timeout: float = setting(
        1.0, lambda v, k: parse_duration(v, k, minimum=0.001),
        "seconds (or '500ms') any remote call may take before it counts as a miss", unit="duration")
    remote_key_prefix: str = setting(
        "lmc", lambda v, k: parse_opt_str(v, k) or "lmc",
        "prefix of every remote key, so deployments can share a server")
    # ---- deprecated: options of one backend, now under remote_options (see DEPRECATED_KEYS)
    remote_ttl: float | None = setting(
        None, _deprecated(lambda v, k: parse_duration(v, k, minimum=0)),
        "deprecated: remote_options: {ttl: ...} (Redis)", unit="duration")
    remote_connections: int | None = setting(
        None, _deprecated(lambda v, k: parse_int(v, k, minimum=1)),
        "deprecated: remote_options: {connections: ...} (Redis, lmc://)")
    tiers: tuple[TierEntry, ...] | None = setting(
        None, parse_tiers,
        "the tier chain as a list, memory first, then any backends in any order: a name or "
        "URL, or {backend: <name or URL>, <option>: <value>} (its own options, and "
        "remote_timeout/remote_key_prefix/remote_token/integrity_secret for that tier only), or "
        "{wrap: <wrapper>, tier: <entry>}; codec: <codec> on an entry stores that tier's KV "
        "coded (fp8-e4m3, int8, int4-kivi, +zstd/+lz4: docs/codecs.md); unset = built from "
        "local_disk and remote_url",
        hashed=False)
    write_policy: str = setting(
        "write_through", lambda v, k: parse_choice(v, k, ("write_through", "write_on_evict")),
        "when L1 chunks flow to lower tiers: on every store, or when evicted from L1")
    write_queue_size: int = setting(
        "1GiB", parse_size,
        "bytes of chunks waiting to be written to lower tiers, per tier, at most half the pool "
        "(a quarter under write_on_evict); beyond it writes are dropped", unit="size")
    write_quiet_ms: int = setting(
        0, lambda v, k: parse_int(v, k, minimum=0),
        "milliseconds the engine must have stopped saving before lower-tier writes start "
        "(a GPU engine's cold prefill then runs without disk or network writes beside it); "
        "a write still waits at most 2 s at a time, and never once its queue is half full; "
        "0 = write at once", hashed=False)
    hybrid_checkpoint_interval: int = setting(
        0, lambda v, k: parse_int(v, k, minimum=0),
        "hybrid models (sliding-window or state-space layers beside full attention): tokens "
        "between the points where their sliding-window and state parts are kept, a multiple "
        "of chunk_size (besides each prompt's end); 0 = lmc picks (8 chunks, or two windows "
        "if wider)")
    load_policy: str = setting(
        "auto", lambda v, k: parse_choice(v, k, ("auto", "load_all")),
        "how much of a hit the connector loads: auto = the part that beats recomputing at "
        "the measured tier and engine speeds (the rest is recomputed), load_all = the whole "
        "hit (for comparison, and for engines whose step times lmc cannot see)", hashed=False)
    lookup_min_wait: float = setting(
        0.02, lambda v, k: parse_duration(v, k, minimum=0.001),
        "seconds (or '20ms') a lookup waits at least for each lower tier's existence check; "
        "it waits the larger of this and a tenth of recomputing the looked-up tokens, then "
        "that tier's keys are misses for the lookup (lookup_late); raise it for a far remote "
        "tier, or where hits must not depend on a loaded host's scheduling (tests)",
        unit="duration")
    load_policy_priors: dict[str, float] = setting(
        None, _speed_priors,
        "speeds assumed before they are measured: bytes per second by tier name or medium "
        "(memory, local_storage, remote, peer; e.g. {local_storage: 2GiB}) and prefill in "
        "tokens per second (unset: loads are not cut until a forward has been timed)",
        hashed=False)
    kv_events: dict[str, Any] | None = setting(
        None, _kv_events,
        "publish the tiers' chunks as KV-cache events in vLLM's wire format, for KV-aware "
        "routers (lmc/events/events_config.py): a mapping of vLLM's --kv-events-config keys "
        "(enable_kv_cache_events, endpoint, replay_endpoint, topic, buffer_steps, hwm, "
        "max_queue_size; unset endpoints bind loopback) and lmc's (block_size, pod, "
        "model_name, heartbeat, max_chunks, publish_remote, buffer_max_bytes, pub_max_bytes, "
        "replay_max_bytes); unset = off", hashed=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tiers is not None:
            given = [k for k in ("local_disk", "remote_url", "remote_options")
                     if getattr(self, k)]
            if given:
                raise ConfigError(f"tiers: given together with {', '.join(given)}; write the "
                                  f"whole chain in tiers (e.g. {{backend: disk, path: ...}}) "
                                  f"or use the shorthand keys alone")
        if self.remote_options and not self.remote_url:
            raise ConfigError("remote_options: given, but there is no remote_url whose backend "
                              "would take them")
        interval = self.hybrid_checkpoint_interval
        if interval and interval % self.chunk_size:
            raise ConfigError(f"hybrid_checkpoint_interval: {interval} is not a multiple of "
                              f"chunk_size {self.chunk_size}")
        for key in DEPRECATED_KEYS:
            if getattr(self, key) is not None:
                _warn_deprecated(key, getattr(self, key))

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.tiers is not None:
            out["tiers"] = [e.as_config() for e in self.tiers]
        return out

    def public_dict(self) -> dict[str, Any]:
        out = super().public_dict()
        if self.tiers is not None:  # a token or secret set for one tier is still a secret
            out["tiers"] = [e.as_config(public=True) for e in self.tiers]
        return out

    def tier_chain(self) -> tuple[TierEntry, ...]:
        """The chain this config builds: ``tiers`` as given, or the shorthand keys translated
        (memory; the disk tier at ``local_disk``; the backend of ``remote_url`` with
        ``remote_options``) -- the chain they have always built."""
        if self.tiers is not None:
            return self.tiers
        chain = [TierEntry("cpu", where="local_cpu_size")]
        if self.local_disk:
            chain.append(TierEntry("disk", {"path": self.local_disk,
                                            "capacity": self.local_disk_size,
                                            "fsync": self.disk_fsync}, where="local_disk"))
        if self.remote_url:
            chain.append(TierEntry(self.remote_url, dict(self.remote_options or {}),
                                   where="remote_url", shorthand=True))
        return tuple(chain)

    def legacy_options(self) -> dict[str, tuple[str, Any]]:
        """``{option: (deprecated key, value)}`` for each deprecated key that is set."""
        return {opt: (key, getattr(self, key)) for key, opt in DEPRECATED_KEYS.items()
                if getattr(self, key) is not None}

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The ``LMC_<KEY>`` variables that name a known key (misspelled ones are reported)."""
        return dict(cls.env_layer(environ).values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Mapping[str, Any] | None = None
                  ) -> CacheConfig:
        return cls.load(path, overrides=overrides)

    def replace(self, **changes: Any) -> CacheConfig:
        self.check_keys(changes, "replace()")
        return dataclasses.replace(self, **changes)


def load_connector_settings(extra: Mapping[str, Any] | None, section: str, options: type[Opts],
                            origin: str, environ: Mapping[str, str] | None = None
                            ) -> tuple[CacheConfig, Opts]:
    """lmc's part of an engine's extra config (vLLM's ``kv_connector_extra_config``, ...).

    Keys starting with ``lmc.`` are lmc's: ``lmc.config_file`` names a YAML file of cache keys
    whose ``<section>:`` mapping holds the connector's ``options``; ``lmc.<key>`` overrides a
    cache key and ``lmc.<section>.<option>`` an option. Precedence, lowest first: defaults,
    YAML, ``LMC_<KEY>`` variables, extra-config keys. Other keys are the engine's and ignored.
    Every message names the key as the user wrote it (``lmc.chunk_sise``) and where."""
    ours = {k[len(EXTRA_PREFIX):]: v for k, v in (extra or {}).items()
            if isinstance(k, str) and k.startswith(EXTRA_PREFIX)}
    path = ours.pop("config_file", None)
    sub = f"{section}."
    cache_layers: list[Layer] = []
    opt_layers: list[Layer] = []
    if path:
        file = read_yaml(path, "lmc config")
        data = dict(file.data)
        nested = data.pop(section, None) or {}
        if not isinstance(nested, dict):
            raise ConfigError(f"{file.where(section)}: '{section}' must be a mapping of "
                              "connector options")
        cache_layers.append(Layer.from_yaml(file, data))
        opt_layers.append(Layer.from_yaml(file, nested, section=sub, prefix=sub))
    cache_layers.append(CacheConfig.env_layer(environ))
    cache_layers.append(Layer({k: v for k, v in ours.items() if not k.startswith(sub)},
                              origin, prefix=EXTRA_PREFIX))
    opt_layers.append(Layer({k[len(sub):]: v for k, v in ours.items() if k.startswith(sub)},
                            origin, prefix=EXTRA_PREFIX + sub))
    return CacheConfig.from_layers(cache_layers), options.from_layers(opt_layers)
