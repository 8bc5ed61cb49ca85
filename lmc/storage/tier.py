"""The tier contract every storage backend implements, and the registry that finds them.

A tier is one class deriving :class:`StorageBackend`, registered with
:func:`register_backend`. Config names it by name (``"disk"``) or by a URL whose scheme it
claims (``redis://``, ``lmc://``...). Lookup order for a name or scheme: backends already
imported, then lmc's own built-in modules (:data:`BUILTIN_BACKENDS`, found by module path, so
a source checkout works without reinstalling), then the ``lmc.storage.backends`` entry-point
group (how a third-party package plugs in).

Per-backend options are the backend's own, never new core keys: a backend declares them in
``OPTIONS`` (name -> :class:`BackendOption`: default, parser, one-line doc) and takes each
as a keyword argument of its constructor. Config gives them in the tier's ``tiers:`` entry
(``{backend: "redis://h:6379", connections: 8}``, :mod:`lmc.storage.chain`), or for the
shorthand ``remote_url`` under ``remote_options:`` or in the URL's query
(``redis://h:6379?connections=8``); :func:`create_backend` merges the two,
parses every value and refuses unknown names (naming the closest declared one). A backend
declaring no ``OPTIONS`` (a toy tier in a test) takes its constructor's keyword parameters
verbatim, from ``remote_options`` only.

The contract (:mod:`lmc.testing` checks it on every tier):

* **Batched.** ``contains``/``get``/``put``/``delete`` take a whole prompt's keys: one call per
  prompt, never one per chunk, so a remote tier answers in one round trip. Results are in key
  order, one per key, a key repeated in a batch answered in each place.
* **Ownership.** ``get`` returns objects each holding one reference owned by the caller (who
  releases it), allocated from the pool the tier was given (for lower tiers a
  :class:`lmc.storage.manager.TierPool`, whose ``allocate`` may evict L1). ``put`` never
  takes the caller's reference: a tier that keeps the object (L1) acquires its own; a tier
  that copies it out (disk, remote) reads its bytes through ``MemoryObj.byte_view()`` /
  ``io_spans()`` only during the call and keeps nothing.
* **Failure is a miss.** A tier never raises into the engine for I/O: a dead, slow or full
  backend answers ``False``/``None``/``0`` within a deadline (``remote_timeout`` for remote
  tiers), counted in its metrics. Only the caller's bugs raise, with ``ValueError``, before
  any I/O: keys and objects of different lengths, an object of another pool given to L1.
* **A chunk a tier cannot represent is skipped, never an error.** ``put`` stores what it
  can, counts the rest in its stats and returns how many it stored; ``contains``/``get``
  then answer a miss for the rest. L1 keeps any object; a tier that serializes (disk,
  Redis, ``lmc://``) represents 4-D ``[layers, planes, tokens, width]`` chunks of the dtypes
  in ``lmc.storage.serde.DTYPE_CODES`` only. A model whose KV one tier cannot hold still runs: that
  tier just never has it (raising would drop the batch's other chunks in the write-behind
  thread, on every store).
* **Corruption is a miss and a delete.** A value failing any check (the ``lmc.storage.serde`` header,
  checksums, a keyed tag) is released, counted, deleted from the backend and served as a miss
  (:class:`lmc.storage.remote.Rejects`).
* **Nothing half-written is visible.** ``contains``/``get`` see a value only once it is
  completely stored (rename into place, a single SET, an acknowledged PUT).
* **Optional: layer by layer.** ``get_layers`` (default ``None``: whole chunks through
  ``get``) returns the hits at once and fills them in layer order; the storage manager
  promotes a chunk read that way only after the whole value verified.
* **Close.** ``close()`` is idempotent and returns within the tier's deadline
  (``remote_timeout`` for remote tiers) even when its backend hangs. A call in flight on
  another thread is not waited for past that deadline; it returns on its own, within the
  same deadline, with what it completed: a ``get`` with right bytes or misses (each object
  it returns is the caller's and stays valid: memory belongs to the pool, not the tier), a
  ``put`` with the chunks it stored (each one whole or not visible at all), never an
  exception. Calls made after ``close()`` start no I/O and change nothing (the directory or
  namespace may already be the next tier's): ``contains`` all ``False``, ``get`` all
  ``None``, ``put`` and ``delete`` 0. Once every caller released what it got, the tier
  holds no pool memory. Remote tiers share one breaker
  (:class:`lmc.storage.breaker.CircuitBreaker`) and one batch splitter
  (:func:`lmc.storage.remote.split_batch`).

The first tier (L1) is different: it keeps the caller's objects themselves and owns
allocation, so it also implements :class:`MemoryTier`.

**Declared, not guessed.** Each tier class declares its ``medium`` (:class:`Medium`: memory,
local storage, remote, peer) and its ``capabilities`` (:class:`TierCapabilities`). Whatever
must know where a hit came from (vLLM's cache-hit sources, stats, tier events) reads these
declarations (:func:`tier_medium`), never the config keys that happened to build the tier.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import enum
import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable
from urllib.parse import unquote_plus

from lmc.settings import ConfigError

if TYPE_CHECKING:
    import torch

    from lmc.config import CacheConfig
    from lmc.memory.pool import MemoryObj, MemoryPool
    from lmc.storage.layered_read import LayeredRead
    from lmc.storage.manager import TierPool

log = logging.getLogger(__name__)
Key = bytes


@dataclasses.dataclass(frozen=True)
class BackendOption:
    """One option a backend declares: what it is when not given, how a value from YAML, an
    environment variable or a URL query (a string) becomes the typed value (``parse(value,
    key)`` raising ``ValueError`` that names ``key``), and a line for the docs."""

    default: Any
    parse: Callable[[Any, str], Any]
    doc: str


class Medium(str, enum.Enum):
    """Where a tier keeps its values: what a hit from it costs and who else can see it."""

    MEMORY = "memory"
    """This process's memory (L1)."""
    LOCAL_STORAGE = "local_storage"
    """A file system of this host (the disk tier)."""
    REMOTE = "remote"
    """A shared store reached over the network (Redis, an ``lmc://`` daemon); also what a
    tier declaring nothing is taken for."""
    PEER = "peer"
    """Another engine's memory, read directly (P2P)."""


@dataclasses.dataclass(frozen=True)
class TierCapabilities:
    """What a tier can do beyond the contract's minimum; the defaults promise nothing."""

    layered_reads: bool = False
    """``get_layers`` may answer (it can still answer ``None`` on any call)."""
    existence_without_reading: bool = False
    """``contains`` answers from an index or a length, without moving the values."""
    durable: bool = False
    """What it holds outlives the process that stored it (a file, another server)."""


class StorageBackend(abc.ABC):
    """A tier. Keys are 16-byte content addresses; values are ``MemoryObj`` chunks.

    See the module docstring for the whole contract: batched calls, the caller owns what
    ``get`` returns, ``put`` keeps no reference of the caller's, failure is a miss within a
    deadline, a corrupt value is a miss and is deleted, nothing half-written is visible.
    """

    name: str = "?"
    medium: Medium = Medium.REMOTE
    """Declared by each tier class: where its values live (:class:`Medium`); a wrapper
    tier's is the tier it wraps."""
    capabilities: TierCapabilities = TierCapabilities()
    """Declared by each tier class: what it can do (:class:`TierCapabilities`)."""
    wraps: ClassVar[bool] = False
    """True for a wrapper tier (:mod:`lmc.storage.wrappers`): built around another
    tier (``inner``), named in config as ``{wrap: <name>, tier: <entry>}``."""
    OPTIONS: ClassVar[Mapping[str, BackendOption]] = {}
    """The options config may give this backend (``remote_options:`` or the URL's query);
    each is also a keyword parameter of the constructor, with the same default."""

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

    def get_layers(self, keys: Sequence[Key]) -> LayeredRead | None:
        """Optional ranged fetch: open the hits now and read them layer by layer in the
        background (:mod:`lmc.storage.layered_read`), so a layer-wise retrieve's layer i waits only
        for layer i. ``None`` (the default, and a tier's answer whenever it cannot do it
        now) means: use :meth:`get`. The same contract as ``get`` otherwise: one reference
        per hit for the caller, failure is a miss (a failed read, not an exception), a value
        failing a check is deleted and reported not ok by the read, never promoted."""
        return None

    def clear_namespace(self, prefix: bytes = b"") -> list[Key] | None:
        """Remove every value of this tier's own namespace -- L1's pool, the disk tier's
        directory, a shared store's key prefix (``remote_key_prefix``), an ``lmc://`` tier's
        daemon namespace -- or, with ``prefix``, only the keys starting with it (the daemon
        tags its keys by namespace: :mod:`lmc.server.store`). Returns the keys removed, or
        ``None`` when they went without the tier being able to list them. Optional: a tier
        that cannot raises :class:`NotImplementedError` (the manager says so and goes on).
        Failure is the contract's: a dead backend removes nothing and answers ``[]``."""
        raise NotImplementedError(f"tier {self.name!r} cannot clear a namespace")

    def set_priority(self, keys: Sequence[Key], priority: int) -> int:
        """Optional: held keys of ``keys`` are evicted after lower priorities' and before
        higher ones' (:mod:`lmc.storage.eviction`); returns how many are held. A tier that
        evicts by its own rules (Redis, a daemon) keeps none and answers 0."""
        return 0

    def demote(self, keys: Sequence[Key]) -> None:  # noqa: B027 - optional hint
        """Optional, for a tier that orders its own evictions: held ``keys`` go first among
        their priority (L1 has just taken a copy of each and, under write-on-evict, writes it
        back when it evicts it: :meth:`lmc.storage.eviction.EvictionPolicy.demote`)."""

    def refresh(self, keys: Sequence[Key]) -> None:  # noqa: B027 - optional hint
        """Optional, for a tier that orders its own evictions: held ``keys`` count as just
        written (L1 evicted its copy of each under write-on-evict and skipped the write this
        tier would have taken, since it holds one: that copy stands for the write-back, so it
        must not stay demoted to the first victim)."""

    def rank_arrivals(self, source: Callable[[Key], int | None] | None) -> None:  # noqa: B027
        """Optional, for a tier that keeps priorities: a key stored from now on takes
        ``source(key)`` as its priority as it arrives (``None``: 0, the default), so it is
        never a victim at 0 before the manager's ``set_priority`` after the write
        (:attr:`lmc.storage.eviction.EvictionPolicy.arrival`)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing
        """Release resources, within the deadline; calls in flight return by themselves with
        what they completed, later calls are misses and 0 (module docstring: Close)."""

    def stats(self) -> dict[str, Any]:
        return {}

    on_evicted: Callable[[list[Key]], None] | None = None
    """Set by the storage manager while someone listens (:class:`TierListener`): a tier that
    drops values on its own (the disk tier's capacity eviction) calls it with their keys once
    they are gone, outside its locks where it can. A store that evicts out of lmc's sight
    (Redis ``maxmemory``, a daemon's own tiers) cannot, and does not."""


# ---------------------------------------------------------------------------- listeners
STORED, PROMOTED, EVICTED, DELETED = "stored", "promoted", "evicted", "deleted"
"""Event reasons: a chunk stored by a caller (or written down by write-behind), copied up
from a lower tier, dropped to make room, removed by a caller."""


@dataclasses.dataclass(frozen=True)
class TierInfo:
    """Which tier an event is about: its name, declared medium and place in the chain."""

    name: str
    medium: Medium
    level: int
    """Index in the chain: 0 is L1."""


class TierListener:
    """Observes the chain's stores, promotions, evictions, deletes and clears, tier by tier
    (:meth:`lmc.storage.manager.StorageManager.add_listener`). Override what you need; the
    rest are no-ops.

    Events are reported after the fact: a store once the chunk is readable from that tier
    (L1: after ``put``; a lower tier: after write-behind's ``put`` returned it stored), a
    removal once the key is gone. They arrive on the thread that caused them -- an engine's
    store, a write-behind writer, an eviction inside an allocation (under L1's lock) -- so a
    listener only records or queues, never blocks or calls back into the storage. An
    exception from a listener is logged and dropped, never the caller's.
    """

    observes_stores: ClassVar[bool] = True
    """False for a listener that only needs removals (write-on-evict): stores and
    promotions are then not looked at for it, which costs a presence check per store."""

    def on_stored(self, keys: Sequence[Key], tier: TierInfo, reason: str) -> None:
        """``keys`` became readable from ``tier`` (``reason``: ``stored`` or ``promoted``)."""

    def on_removed(self, keys: Sequence[Key], tier: TierInfo, reason: str,
                   objs: Sequence[MemoryObj] | None = None) -> None:
        """``keys`` are no longer in ``tier`` (``reason``: ``evicted`` or ``deleted``). For
        an L1 eviction ``objs`` are the victims, still valid during the call (a listener that
        keeps one acquires it: write-on-evict does); otherwise ``None``."""

    def on_cleared(self, tier: TierInfo) -> None:
        """Everything ``tier`` held is gone at once."""


def tier_medium(tier: object) -> Medium:
    """A tier's (or a tier class's) declared medium; :data:`Medium.REMOTE` for an object
    declaring none (a duck-typed tier), the one answer that claims nothing about locality."""
    m = getattr(tier, "medium", None)
    try:
        return Medium(m)
    except ValueError:
        return Medium.REMOTE


def tier_capabilities(tier: object) -> TierCapabilities:
    """A tier's (or tier class's) declared capabilities; none for an object declaring none."""
    c = getattr(tier, "capabilities", None)
    return c if isinstance(c, TierCapabilities) else TierCapabilities()


EvictListener = Callable[[list[tuple[Key, "MemoryObj"]]], None]


@runtime_checkable
class MemoryTier(Protocol):
    """L1: a tier over the process's pool that keeps the caller's objects themselves.

    What the storage manager needs beyond :class:`StorageBackend`: allocation that evicts
    unreferenced chunks to make room (stores and lower-tier reads allocate through it), a
    presence check that refreshes recency, and the eviction hook write-on-evict feeds lower
    tiers from. An object of another pool is refused by ``put`` (evicting it frees nothing).
    """

    name: str
    pool: MemoryPool
    on_evict: EvictListener | None
    """Called under the tier's lock with the victims, before their memory is released."""

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, num_tokens: int
                 ) -> MemoryObj | None:
        """One object holding a reference for the caller, evicting if needed; ``None`` when
        everything left is referenced."""

    def allocate_many(self, shape: Sequence[int], dtype: torch.dtype, count: int,
                      num_tokens: int) -> list[MemoryObj]:
        """Up to ``count`` objects (fewer, possibly none, when the rest is referenced)."""

    def touch(self, keys: Sequence[Key]) -> list[bool]:
        """Presence of each key; present ones count as just used."""

    def contains(self, keys: Sequence[Key]) -> list[bool]: ...

    def prefix_hits(self, keys: Sequence[Key]) -> int: ...

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]: ...

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int: ...

    def delete(self, keys: Sequence[Key]) -> int: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


BackendFactory = Callable[..., StorageBackend]
_by_name: dict[str, BackendFactory] = {}
_by_scheme: dict[str, BackendFactory] = {}
_loaded = False
_load_lock = threading.Lock()

BUILTIN_BACKENDS: dict[str, str] = {
    "cpu": "lmc.storage.backends.cpu",
    "disk": "lmc.storage.backends.disk.backend",
    "redis": "lmc.storage.backends.redis.backend",
    "server": "lmc.storage.backends.server.backend",
    "p2p": "lmc.storage.backends.p2p.backend",
    "mooncake": "lmc.storage.backends.mooncake.backend",
    "counting": "lmc.storage.wrappers",
    "rate_limit": "lmc.storage.wrappers",
    "codec": "lmc.storage.kvcodecs.tier",
}
"""Tiers by name, imported by module path on first use: lmc's own are found without package
metadata (a source checkout, an ``lmc`` copied into a container), unlike entry points.
:func:`register_backend_module` adds to it."""

WRAPPER_BACKENDS = frozenset({"counting", "rate_limit", "codec"})
"""Built-in wrapper tiers: built by name only (a ``tiers:`` entry's ``wrap:``), claiming no URL
scheme, so a URL lookup does not import their modules (the codec's imports torch, which a
lookup such as ``lmc config``'s must not pay for)."""


def register_backend_module(name: str, module: str) -> None:
    """Make backend ``name`` importable on demand from ``module`` (which registers it with
    :func:`register_backend` when imported): no package metadata, no reinstall. Its URL
    schemes are found too, since a URL lookup imports every module listed here (but the
    built-in wrappers')."""
    global _loaded
    with _load_lock:
        BUILTIN_BACKENDS[name] = module
        _loaded = False  # a URL lookup must import the new module as well


_Cls = TypeVar("_Cls", bound="type[StorageBackend]")


def register_backend(name: str, schemes: Sequence[str] = ()) -> Callable[[_Cls], _Cls]:
    """Class decorator: make a backend creatable by ``name`` and by URL ``schemes``."""

    def deco(cls: _Cls) -> _Cls:
        _by_name[name] = cls
        for s in schemes:
            _by_scheme[s] = cls
        cls.name = name
        return cls

    return deco


# optional packages of built-in backends -> the extra that installs them
OPTIONAL_EXTRAS = {"redis": "redis", "hiredis": "redis", "nixl": "nixl"}
_unavailable: dict[str, str] = {}  # built-in module -> why it could not be imported


def _import_builtin(module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as e:  # e.g. redis-py missing: the other tiers still work
        missing = (e.name or "").split(".")[0]
        if missing in OPTIONAL_EXTRAS:  # an extra not installed: said when its URL is used
            _unavailable[module] = (f"{module} needs the {missing!r} package: pip install "
                                    f"'lmc-kvcache[{OPTIONAL_EXTRAS[missing]}]'")
            log.debug("built-in storage backend %s not available: %s", module, e)
        else:
            _unavailable[module] = f"{module} failed to import: {e}"
            log.warning("built-in storage backend %s failed to import: %s", module, e)


def _load_plugins(name: str | None = None) -> None:
    """Import backend modules: for a backend asked for by ``name``, the built-in module or
    the entry point of that name; for a URL (``name=None``), every built-in module and every
    entry point (any module may claim the scheme) but the built-in wrappers' (which claim
    none)."""
    global _loaded
    with _load_lock:
        if name is not None and name in BUILTIN_BACKENDS:  # a wrapper's, even after a URL's
            _import_builtin(BUILTIN_BACKENDS[name])
            return
        if _loaded:
            return
        if name is None:
            for n, module in BUILTIN_BACKENDS.items():
                if n not in WRAPPER_BACKENDS:
                    _import_builtin(module)
        eps = list(metadata.entry_points(group="lmc.storage.backends"))
        if name is not None:
            eps = [ep for ep in eps if ep.name == name]
        for ep in eps:
            module = ep.value.split(":")[0]
            if module in BUILTIN_BACKENDS.values() or (
                    ep.name in BUILTIN_BACKENDS and module.startswith("lmc.")):
                # imported above: an installed copy of our own entry points, or one installed
                # before a built-in module moved (metadata refreshed only by a reinstall)
                continue
            try:
                importlib.import_module(module)
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
        why = "".join(f"; {msg}" for msg in _unavailable.values())
        raise ValueError(f"no storage backend handles URL scheme {spec.split('://', 1)[0]!r} "
                         f"(in {spec!r}); known schemes: {', '.join(sorted(_by_scheme)) or 'none'}"
                         f"{why}")
    raise ValueError(f"unknown storage backend {spec!r}; known: {', '.join(sorted(_by_name))}")


# ----------------------------------------------------------------------------- options
_SET_BY_LMC = ("self", "spec", "config", "pool")


def option_names(factory: BackendFactory) -> tuple[str, ...]:
    """What config may set on ``factory``: its declared ``OPTIONS``, or (declaring none) the
    keyword parameters of its constructor other than those lmc passes itself."""
    declared = getattr(factory, "OPTIONS", None)
    if declared:
        return tuple(declared)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C factory: nothing to check against
        return ()
    return tuple(n for n, p in params.items() if n not in _SET_BY_LMC
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _split_query(spec: str, names: Sequence[str]) -> tuple[str, dict[str, str]]:
    """``spec`` without the query parameters naming an option, and those parameters. The
    rest of the query is left byte for byte as written (it is the backend's: redis-py's TLS
    options, ``ns=``)."""
    base, sep, query = spec.partition("?")
    if not sep or not names:
        return spec, {}
    kept, taken = [], {}
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if unquote_plus(name) in names:
            taken[unquote_plus(name)] = unquote_plus(value)
        elif part:
            kept.append(part)
    return (f"{base}?{'&'.join(kept)}" if kept else base), taken


def backend_options(factory: BackendFactory, spec: str, options: Mapping[str, Any] | None = None,
                    *, where: str = "remote_options",
                    legacy: Mapping[str, tuple[str, Any]] | None = None
                    ) -> tuple[str, dict[str, Any]]:
    """The keyword options ``factory`` is built with for ``spec``, and ``spec`` with them
    taken out of its query.

    Sources: ``options`` (``remote_options``), the URL's query (declared options only: the
    rest of a query is the backend's) and ``legacy`` (``{option: (old core key, value)}``,
    from deprecated keys). An option given by two of them is refused rather than one
    silently winning; a name the backend does not take is refused naming the closest one;
    each value of a declared option is parsed, so ``'12h'`` or ``'8'`` from a URL work."""
    known = option_names(factory)
    declared: Mapping[str, BackendOption] = getattr(factory, "OPTIONS", None) or {}
    label = getattr(factory, "__name__", repr(factory))
    spec, from_query = _split_query(spec, tuple(declared))
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    sources = [("remote_url's ?{}=", from_query), (f"{where}.{{}}", options or {})]
    for fmt, given in sources:
        for name, value in given.items():
            if name in _SET_BY_LMC:
                raise ConfigError(f"{where}: {name!r} is set by lmc itself, not an option "
                                  f"of {label}")
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ConfigError(f"{where}: {label} has no option {name!r}{hint} "
                                  f"(its options: {', '.join(known) or 'none'})")
            if name in origin:
                raise ConfigError(f"{label} option {name!r} is given twice: in "
                                  f"{origin[name]} and in {fmt.format(name)}; keep one")
            out[name], origin[name] = value, fmt.format(name)
    for name, (old_key, value) in (legacy or {}).items():
        if name not in known:
            continue  # the old core key never applied to this backend either
        if name in origin:
            raise ConfigError(f"{old_key} (deprecated) and {origin[name]} both set "
                              f"{label}'s {name!r}; keep {origin[name]}")
        out[name], origin[name] = value, old_key
    for name, value in out.items():
        if name in declared:
            out[name] = declared[name].parse(value, origin[name])
    return spec, out


def configured_options(factory: BackendFactory, spec: str, config: CacheConfig
                       ) -> tuple[str, dict[str, Any]]:
    """:func:`backend_options` for a tier built from ``config``: ``remote_options`` (and the
    deprecated core keys they replace) apply when ``spec`` is served by the same backend as
    ``remote_url`` or there is no ``remote_url`` (a tier built by hand, as the deprecated
    keys always applied); a URL's own query always applies."""
    remote = getattr(config, "remote_url", None)
    ours = not remote or remote == spec or _lookup(remote) is factory
    if not ours:
        return backend_options(factory, spec)
    return backend_options(factory, spec, getattr(config, "remote_options", None),
                           legacy=config.legacy_options())


def create_backend(spec: str, config: CacheConfig, pool: MemoryPool | TierPool, **kwargs: Any
                   ) -> StorageBackend:
    """Instantiate a backend: ``factory(spec, config=..., pool=..., **options, **kwargs)``,
    with ``options`` from config (:func:`configured_options`) and ``kwargs`` (Python values:
    callables, test hooks) winning over them. L1 gets the pool itself, lower tiers a
    ``TierPool`` (see :mod:`lmc.storage.chain`)."""
    factory = backend_factory(spec)
    spec, options = configured_options(factory, spec, config)
    return factory(spec, config=config, pool=pool, **{**options, **kwargs})
