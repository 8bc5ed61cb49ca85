"""The tier stack from a ``CacheConfig``: built here once, for the engine and the daemon alike.

Order: L1 (the ``cpu`` memory tier over the pool), then the disk tier when ``local_disk`` is
set, then the backend claiming ``remote_url``'s scheme (any registered backend: Redis, an
``lmc://`` daemon, a third-party tier), then extra tiers the caller hands in. Lower tiers get
a :class:`lmc.storage_manager.TierPool`, so their reads may evict L1 exactly as a store does.

Per-backend options live under the backend's own key, not as core settings:
``remote_options`` (a mapping, merged by the backend with its URL's query) is passed to the
remote backend's constructor as keyword arguments. Names the constructor does not take are
refused here, naming the closest one, instead of being swallowed by its ``**kwargs``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmc.config import CacheConfig
from lmc.memory import MemoryPool
from lmc.storage_backend import MemoryTier, StorageBackend, backend_factory, create_backend
from lmc.storage_manager import StorageManager, TierPool

TierFactory = Callable[[CacheConfig, TierPool], StorageBackend]
TierSpec = StorageBackend | TierFactory
"""An extra lower tier: an instance, or a factory ``(config, pool) -> tier``."""

_BUILT_IN_ARGS = ("self", "spec", "config", "pool")


def backend_options(factory: Callable[..., Any], options: Mapping[str, Any], where: str
                    ) -> dict[str, Any]:
    """``options`` checked against the keyword parameters ``factory`` declares; a name it does
    not declare raises ``ValueError`` naming ``where`` and the closest declared name."""
    if not options:
        return {}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C factory: nothing to check against
        return dict(options)
    known = [n for n, p in params.items() if n not in _BUILT_IN_ARGS
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    name = getattr(factory, "__name__", repr(factory))
    for key in options:
        if key in _BUILT_IN_ARGS:
            raise ValueError(f"{where}: {key!r} is set by lmc itself, not an option of {name}")
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"{where}: {name} has no option {key!r}{hint} "
                             f"(its options: {', '.join(known) or 'none'})")
    return dict(options)


def lower_tier_specs(config: CacheConfig) -> list[str]:
    """The configured lower tiers, top down, as backend specs."""
    specs = []
    if config.local_disk:
        specs.append("disk")
    if config.remote_url:
        specs.append(config.remote_url)
    return specs


def build_lower_tiers(config: CacheConfig, l1: MemoryTier,
                      extra: Sequence[TierSpec] = ()) -> list[StorageBackend]:
    """Disk, remote, then ``extra``, all allocating through ``TierPool(l1)``. On failure every
    tier already made is closed before the error propagates."""
    pool = TierPool(l1)
    out: list[StorageBackend] = []
    try:
        for spec in lower_tier_specs(config):
            kwargs: dict[str, Any] = {}
            if spec == config.remote_url:
                options = getattr(config, "remote_options", None) or {}
                kwargs = backend_options(backend_factory(spec), options, "remote_options")
            out.append(create_backend(spec, config, pool, **kwargs))
        for t in extra:
            out.append(t if isinstance(t, StorageBackend) else t(config, pool))
    except BaseException:
        for t in out:
            t.close()
        raise
    return out


def build_tiers(config: CacheConfig, pool: MemoryPool, extra: Sequence[TierSpec] = ()
                ) -> list[StorageBackend]:
    """``[L1, *lower tiers]`` over ``pool``: what :func:`build_storage` hands the manager."""
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
                              queue_bytes=config.write_queue_size)
    except BaseException:
        for t in reversed(tiers):
            t.close()
        raise
