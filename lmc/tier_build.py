"""The tier stack from a ``CacheConfig``: built here once, for the engine and the daemon alike.

Order: L1 (the ``cpu`` memory tier over the pool), then the disk tier when ``local_disk`` is
set, then the backend claiming ``remote_url``'s scheme (any registered backend: Redis, an
``lmc://`` daemon, a third-party tier), then extra tiers the caller hands in. Lower tiers get
a :class:`lmc.storage_manager.TierPool`, so their reads may evict L1 exactly as a store does.

Per-backend options live under the backend's own key, not as core settings: the remote
backend gets ``remote_options`` (and its URL's query) as the keyword options it declares,
checked and parsed by :func:`lmc.storage_backend.create_backend`, which every tier here is
made with -- so a tier built by hand in a test gets exactly what the engine's would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lmc.config import CacheConfig
from lmc.memory import MemoryPool
from lmc.storage_backend import (
    Medium,
    MemoryTier,
    StorageBackend,
    backend_factory,
    create_backend,
    tier_medium,
)
from lmc.storage_manager import StorageManager, TierPool

TierFactory = Callable[[CacheConfig, TierPool], StorageBackend]
TierSpec = StorageBackend | TierFactory
"""An extra lower tier: an instance, or a factory ``(config, pool) -> tier``."""


def lower_tier_specs(config: CacheConfig) -> list[str]:
    """The configured lower tiers, top down, as backend specs."""
    specs = []
    if config.local_disk:
        specs.append("disk")
    if config.remote_url:
        specs.append(config.remote_url)
    return specs


def chain_media(config: CacheConfig) -> dict[str, Medium]:
    """Tier name -> declared medium for the chain ``config`` builds, L1 first, read from the
    backend classes without building anything (a scheduler process that holds no tier still
    knows where its hits lie). A backend that cannot be imported here counts as remote."""
    out: dict[str, Medium] = {}
    for spec in ["cpu", *lower_tier_specs(config)]:
        try:
            factory = backend_factory(spec)
        except ValueError:
            out.setdefault(spec.split("://", 1)[0], Medium.REMOTE)
            continue
        out.setdefault(str(getattr(factory, "name", spec)), tier_medium(factory))
    return out


def build_lower_tiers(config: CacheConfig, l1: MemoryTier,
                      extra: Sequence[TierSpec] = ()) -> list[StorageBackend]:
    """Disk, remote, then ``extra``, all allocating through ``TierPool(l1)``. On failure every
    tier already made is closed before the error propagates."""
    pool = TierPool(l1)
    out: list[StorageBackend] = []
    try:
        for spec in lower_tier_specs(config):
            out.append(create_backend(spec, config, pool))
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
