"""The tier chain from a ``CacheConfig``: built here once, for the engine and the daemon alike.

The chain is data (:meth:`lmc.config.CacheConfig.tier_chain`): the ``tiers`` list -- memory
first, then any backends in any order and number, each with its own options, wrappers
around any of them -- or, without it, the shorthand keys translated into the chain they have
always meant: L1 (the ``cpu`` memory tier over the pool), the disk tier when ``local_disk`` is
set, then the backend claiming ``remote_url``'s scheme. Extra tiers the caller hands in come
last. Lower tiers get a :class:`lmc.storage.manager.TierPool`, so their reads may evict L1
exactly as a store does.

Per-backend options live under the backend's own key, not as core settings: the remote
backend gets ``remote_options`` (and its URL's query) as the keyword options it declares,
checked and parsed by :func:`lmc.storage.tier.create_backend`, which every tier here is
made with -- so a tier built by hand in a test gets exactly what the engine's would.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from lmc.config import CacheConfig, TierEntry
from lmc.memory.pool import MemoryPool
from lmc.settings import ConfigError, parse_choice
from lmc.storage.eviction import policy_names
from lmc.storage.integrity import Integrity
from lmc.storage.manager import StorageManager, TierPool
from lmc.storage.tier import (
    BackendFactory,
    Medium,
    MemoryTier,
    StorageBackend,
    backend_factory,
    backend_options,
    configured_options,
    create_backend,
    tier_medium,
)

TierFactory = Callable[[CacheConfig, TierPool], StorageBackend]
TierSpec = StorageBackend | TierFactory
"""An extra lower tier: an instance, or a factory ``(config, pool) -> tier``."""


def lower_tier_specs(config: CacheConfig) -> list[str]:
    """The configured lower tiers, top down, as backend specs (a wrapper by its name)."""
    return [e.backend for e in config.tier_chain()[1:]]


def _leaf(entry: TierEntry) -> TierEntry:
    """The tier a chain of wrappers finally wraps."""
    while entry.inner is not None:
        entry = entry.inner
    return entry


def chain_media(config: CacheConfig) -> dict[str, Medium]:
    """Tier name -> declared medium for the chain ``config`` builds, L1 first, read from the
    backend classes without building anything (a scheduler process that holds no tier still
    knows where its hits lie). A wrapper is its wrapped tier (same name, same medium); a
    backend that cannot be imported here counts as remote."""
    out: dict[str, Medium] = {}
    for entry in config.tier_chain():
        spec = _leaf(entry).backend
        try:
            factory = backend_factory(spec)
        except ValueError:
            out.setdefault(spec.split("://", 1)[0], Medium.REMOTE)
            continue
        out.setdefault(str(getattr(factory, "name", spec)), tier_medium(factory))
    return out


def _entry_config(entry: TierEntry, config: CacheConfig) -> CacheConfig:
    """``config`` with the core keys this entry sets for its own tier."""
    if not entry.config:
        return config
    try:
        return config.replace(**entry.config)
    except ConfigError as e:
        raise ConfigError(f"{entry.where}: {e}") from None


def _options(factory: BackendFactory, entry: TierEntry, config: CacheConfig
             ) -> tuple[str, dict]:
    if entry.shorthand:  # remote_url: remote_options, the URL's query, the deprecated keys
        return configured_options(factory, entry.backend, config)
    return backend_options(factory, entry.backend, entry.options, where=entry.where)


def _given_at(config: CacheConfig, key: str, e: Exception) -> ConfigError:
    """``e`` as a :class:`ConfigError` that says where ``key`` was given, as loading does."""
    at = config.origin(key)
    return ConfigError(f"{e} (in {at})" if at else str(e))


def check_entry(e: TierEntry) -> None:
    """The entry's backend (and each wrapped one) is registered, by name or URL scheme; a
    wrapper wraps a tier and nothing else does; the disk tier has its directory."""
    try:
        factory = backend_factory(e.backend)
    except ValueError as err:
        raise ConfigError(f"{e.where}: {err}") from None
    wrapper = bool(getattr(factory, "wraps", False))
    if wrapper and e.inner is None:
        raise ConfigError(f"{e.where}: {e.backend!r} is a wrapper tier: write "
                          f"{{wrap: {e.backend}, tier: <the tier it wraps>}}")
    if not wrapper and e.inner is not None:
        raise ConfigError(f"{e.where}: {e.backend!r} is not a wrapper tier (wrap: takes "
                          f"counting, rate_limit or another registered wrapper)")
    if e.backend == "disk" and "path" not in e.options:
        raise ConfigError(f"{e.where}: the disk tier needs its directory: "
                          f"{{backend: disk, path: /var/cache/lmc}}")
    if e.inner is not None:
        check_entry(e.inner)


def check_registered(config: CacheConfig) -> None:
    """What the config schema leaves to the registries, checked before any tier is built:
    the eviction policy is registered, and every tier's backend (see :func:`check_entry`).
    Raises :class:`ConfigError` naming the key and where it was given."""
    try:
        parse_choice(config.eviction_policy, "eviction_policy", policy_names())
    except ConfigError as e:
        raise _given_at(config, "eviction_policy", e) from None
    for top in config.tier_chain()[1:]:
        try:
            check_entry(top)
        except ConfigError as e:
            raise _given_at(config, top.where.split("[", 1)[0], e) from None


def check_chain(config: CacheConfig, where: Mapping[str, str] | None = None) -> None:
    """What building the chain would refuse, without building it (``lmc config``, and every
    server before its slow start-up work): the registries' checks (:func:`check_registered`),
    the integrity secret (its file read and checked), each entry's options (names and
    values, against what its backend declares), the core keys it sets for its tier, a remote
    URL's own options (a backend's ``check_spec``) and every directory a tier would create.
    Raises :class:`ConfigError` naming the entry (``where`` renames it: ``{"local_disk":
    "--disk"}``)."""
    check_registered(config)
    try:
        Integrity.from_config(config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for top in config.tier_chain()[1:]:
        entry: TierEntry | None = top
        while entry is not None:
            _entry_config(entry, config)
            factory = backend_factory(entry.backend)
            spec, options = _options(factory, entry, config)
            name = (where or {}).get(entry.where, entry.where)
            check_spec = getattr(factory, "check_spec", None)
            if check_spec is not None:
                try:
                    check_spec(spec)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
            path = options.get("path")
            if isinstance(path, str) and path:
                check_directory(path, name)
            entry = entry.inner


def check_directory(path: str, where: str) -> None:
    """A directory a tier will create and write: it exists and takes a new entry, or its
    nearest existing parent does (tried with a temporary directory, removed at once: a
    permission check alone passes root on /proc). ``ConfigError`` names ``where``."""
    p = Path(path).expanduser()
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(f"{probe} is not a directory")
        tempfile.TemporaryDirectory(dir=probe, prefix=".lmc-check-").cleanup()
    except OSError as e:
        why = e.strerror or str(e)
        fs = filesystem_type(probe)
        if fs in VIRTUAL_FILESYSTEMS:  # the kernel's: mkdir says ENOENT of a parent that is there
            why = f"{probe} is the kernel's {fs} filesystem, which holds no files of yours"
        at = "" if probe == p else f" (its nearest existing parent {probe})"
        raise ConfigError(f"{where} {path!r}: cannot create or write a directory there{at}: "
                          f"{why}") from None


VIRTUAL_FILESYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs",
                                 "securityfs", "configfs", "devpts", "bpf", "pstore",
                                 "efivarfs", "fusectl", "mqueue", "hugetlbfs"})


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` (``/proc/self/mounts``' longest mount
    point above it), or ``None`` where that cannot be read."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    target = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def create_tier(entry: TierEntry, config: CacheConfig, pool: TierPool) -> StorageBackend:
    """One lower tier of the chain (a wrapper: its wrapped tier first, handed in as
    ``inner``). Its options are checked against what its backend declares, naming
    ``entry.where`` (``tiers[2]``) in any error."""
    factory = backend_factory(entry.backend)
    tier_config = _entry_config(entry, config)
    spec, options = _options(factory, entry, config)
    if entry.inner is None:
        return _make(factory, entry, spec, config=tier_config, pool=pool, **options)
    inner = create_tier(entry.inner, config, pool)
    try:
        return _make(factory, entry, spec, config=tier_config, pool=pool, inner=inner,
                     **options)
    except BaseException:
        inner.close()
        raise


def _make(factory: BackendFactory, entry: TierEntry, spec: str, **kw: object
          ) -> StorageBackend:
    """The backend's constructor; a value it refuses is a config error naming the entry."""
    try:
        return factory(spec, **kw)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError) or entry.shorthand:
            raise
        raise ConfigError(f"{entry.where} ({entry.backend}): {e}") from None
    except OSError as e:  # a directory it cannot make, a file it cannot open: no traceback
        raise ConfigError(f"{entry.where} ({entry.backend}): {e}") from None


def build_lower_tiers(config: CacheConfig, l1: MemoryTier,
                      extra: Sequence[TierSpec] = ()) -> list[StorageBackend]:
    """The chain's lower tiers, then ``extra``, all allocating through ``TierPool(l1)``. On
    failure every tier already made is closed before the error propagates."""
    pool = TierPool(l1)
    out: list[StorageBackend] = []
    try:
        for entry in config.tier_chain()[1:]:
            out.append(create_tier(entry, config, pool))
        for t in extra:
            out.append(t if isinstance(t, StorageBackend) else t(config, pool))
    except BaseException:
        for t in out:
            t.close()
        raise
    return out


def build_tiers(config: CacheConfig, pool: MemoryPool, extra: Sequence[TierSpec] = ()
                ) -> list[StorageBackend]:
    """``[L1, *lower tiers]`` over ``pool``: what :func:`build_storage` hands the manager.
    The registries' checks come first, so a misspelt backend or policy is named as config
    gave it, before anything is built."""
    check_registered(config)
    l1 = create_backend("cpu", config, pool)
    if not isinstance(l1, MemoryTier):
        raise TypeError(f"the 'cpu' backend {type(l1).__name__} is not a MemoryTier")
    try:
        return [l1, *build_lower_tiers(config, l1, extra)]
    except BaseException:
        l1.close()
        raise


def build_storage(config: CacheConfig, pool: MemoryPool, extra: Sequence[TierSpec] = ()
                  ) -> StorageManager:
    """The tiers of :func:`build_tiers` in a :class:`StorageManager` with the config's write
    policy and queue bound. On failure the tiers are closed (the pool is the caller's)."""
    tiers = build_tiers(config, pool, extra)
    try:
        return StorageManager(tiers, write_policy=config.write_policy,
                              queue_bytes=config.write_queue_size,
                              write_quiet_s=config.write_quiet_ms / 1e3)
    except BaseException:
        for t in reversed(tiers):
            t.close()
        raise
