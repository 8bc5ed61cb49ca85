"""The tier interface every storage backend implements, and the registry that finds them.

The core never imports a backend module by name: backends register themselves with
:func:`register_backend` when their module is imported, and modules are found through the
``lmc.storage_backends`` entry-point group (pyproject.toml), so a third-party tier plugs in the
same way as ours. A backend is named in config by its name (``"cpu"``) or by a URL whose
scheme it claims (``redis://``, ``lmc://``...).

All calls are batched: one call per prompt, never one per chunk, so a remote tier answers a
whole prompt in one round trip.
"""

from __future__ import annotations

import abc
import importlib
import logging
import threading
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmc.config import CacheConfig
    from lmc.memory import MemoryObj, MemoryPool

log = logging.getLogger(__name__)
Key = bytes


class StorageBackend(abc.ABC):
    """A tier. Keys are 16-byte content addresses; values are ``MemoryObj`` chunks.

    Contract:
    * ``get`` returns objects holding a reference for the caller (release them), or ``None``
      for a miss. A tier that fails returns misses; it never raises into the engine for I/O.
    * ``put`` never keeps the caller's reference; a tier that keeps the object acquires its own.
      It returns how many keys it stored (already-present keys count as stored).
    * Nothing is visible to ``contains``/``get`` before it is completely written.
    """

    name: str = "?"

    @abc.abstractmethod
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """Presence of each key (one batched call)."""

    def prefix_hits(self, keys: Sequence[Key]) -> int:
        """How many leading keys are present."""
        n = 0
        for present in self.contains(keys):
            if not present:
                break
            n += 1
        return n

    @abc.abstractmethod
    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        """The chunks, each holding one reference for the caller, ``None`` where missing."""

    @abc.abstractmethod
    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        """Store fully written chunks."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[Key]) -> int:
        """Remove keys; returns how many were present."""

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing
        """Release resources; further calls may fail."""

    def stats(self) -> dict[str, Any]:
        return {}


BackendFactory = Callable[..., StorageBackend]
_by_name: dict[str, BackendFactory] = {}
_by_scheme: dict[str, BackendFactory] = {}
_loaded = False
_load_lock = threading.Lock()


def register_backend(name: str, schemes: Sequence[str] = ()) -> Callable[[type], type]:
    """Class decorator: make a backend creatable by ``name`` and by URL ``schemes``."""

    def deco(cls: type) -> type:
        _by_name[name] = cls
        for s in schemes:
            _by_scheme[s] = cls
        cls.name = name
        return cls

    return deco


def _load_plugins(name: str | None = None) -> None:
    """Import backend modules from the entry-point group: the one called ``name`` when given
    (a backend asked for by name), else all of them (a URL: any module may claim the scheme)."""
    global _loaded
    with _load_lock:
        if _loaded:
            return
        eps = metadata.entry_points(group="lmc.storage_backends")
        if name is not None:
            eps = [ep for ep in eps if ep.name == name]
        for ep in eps:
            try:
                importlib.import_module(ep.value.split(":")[0])
            except Exception as e:  # a broken plugin must not take the others down
                log.warning("storage backend plugin %s (%s) failed to import: %s",
                            ep.name, ep.value, e)
        if name is None:
            _loaded = True


def _lookup(spec: str) -> BackendFactory | None:
    if "://" in spec:
        return _by_scheme.get(spec.split("://", 1)[0])
    return _by_name.get(spec)


def backend_factory(spec: str) -> BackendFactory:
    """The backend class for a name (``"cpu"``) or a URL (``"redis://host:6379"``)."""
    factory = _lookup(spec)
    if factory is None and "://" not in spec:
        _load_plugins(spec)
        factory = _lookup(spec)
    if factory is None:
        _load_plugins()
        factory = _lookup(spec)
    if factory is not None:
        return factory
    if "://" in spec:
        raise ValueError(f"no storage backend handles URL scheme {spec.split('://', 1)[0]!r} "
                         f"(in {spec!r}); known schemes: {', '.join(sorted(_by_scheme)) or 'none'}")
    raise ValueError(f"unknown storage backend {spec!r}; known: {', '.join(sorted(_by_name))}")


def create_backend(spec: str, config: CacheConfig, pool: MemoryPool, **kwargs: Any
                   ) -> StorageBackend:
    """Instantiate a backend: ``factory(spec, config=..., pool=..., **kwargs)``."""
    return backend_factory(spec)(spec, config=config, pool=pool, **kwargs)
