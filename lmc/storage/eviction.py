"""Eviction policies as objects: which entry a full tier gives up first.

A policy *is* the tier's index: a map from key to the tier's value for that key (a pool
object for the memory tier, a file entry for the disk tier, a size for the planner's
mirror of it) that also keeps the order in which entries are to be evicted. Holding the
values itself, rather than a second structure of keys beside the tier's own dict, keeps the
tiers' batch paths as fast as a bare ``OrderedDict``: one update per batch, lookups in C.

This module imports nothing from the rest of lmc, so it can move with the storage code.

Primitives (what a tier may call; a policy is not thread-safe, the tier's lock covers it):

* ``entries`` - the held entries as a read-only mapping, for lookups that must not count
  as a use (``contains``, prefix hits, the lookup half of a ``get``). It is a ``dict``, so
  ``map(entries.get, keys)`` and ``entries.keys().isdisjoint(keys)`` run in C, and the same
  object for the policy's life (a tier may keep a reference). Its iteration order is *not*
  the eviction order in general; :meth:`victims` is.
* ``insert(key, value)`` / ``insert_many(mapping)`` - on insert: keys not held yet (a tier
  that keeps a held key's first value checks ``entries`` first).
* ``access(key)`` / ``touch_many(keys)`` - on access: a held key was used (read,
  re-stored, asked for by a lookup that refreshes); ``touch_many`` skips absent keys and
  applies the accesses in the order given. ``touch_held(keys)`` is the same for keys the
  caller just found held (every one of a batch hit): no membership test per key.
* ``remove(key)`` - on remove: the key leaves because the tier deleted it (a delete, a bad
  value); returns its value, or ``None`` when it was not held.
* ``evict(key)`` - the key leaves because it was chosen as a victim. The same as
  ``remove`` for LRU and FIFO; a policy with history (ARC's ghost lists, LFU with aging)
  remembers it here, which is why the two are separate.
* ``victims()`` - held ``(key, value)`` pairs, the first to evict first, without removing
  them: the tier passes over those it cannot give up (referenced, being read) and calls
  ``evict`` on those it picks. Do not insert or remove while iterating.
* ``pop_victim()`` - ``evict`` the first victim and return it (the disk index, which can
  give up any entry).
* ``clear()`` - forget every entry (and any history).

``victims()`` takes no argument: a tier evicts while it allocates, before it knows which key
the room is for, so a policy that adapts to the incoming key (ARC's target on a ghost hit)
adapts in ``insert``, one eviction late.

Policies are made by name with :func:`make_policy` (``eviction_policy: lru|fifo`` in the
configs); :func:`register_policy` adds one (ARC, LFU) under a new name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class EvictionPolicy(ABC, Generic[K, V]):
    """An index of held entries that knows the order to evict them in (see the module doc
    for the primitives and their contracts)."""

    name: ClassVar[str]

    @property
    @abstractmethod
    def entries(self) -> Mapping[K, V]:
        """Held entries, read-only, for lookups that are not a use (not eviction order)."""

    @abstractmethod
    def insert(self, key: K, value: V) -> None:
        """On insert: ``key`` is new to the tier."""

    @abstractmethod
    def insert_many(self, items: Mapping[K, V]) -> None:
        """On insert for a batch of new keys, in the mapping's order."""

    @abstractmethod
    def access(self, key: K) -> None:
        """On access: the held ``key`` was used."""

    @abstractmethod
    def touch_many(self, keys: Iterable[K]) -> None:
        """On access for each held key of ``keys``, in order; absent keys are skipped."""

    def touch_held(self, keys: Iterable[K]) -> None:
        """On access for each of ``keys``, all held (the caller just found each)."""
        self.touch_many(keys)

    @abstractmethod
    def remove(self, key: K) -> V | None:
        """On remove: ``key`` was deleted by the tier; its value, or ``None`` if not held."""

    def evict(self, key: K) -> V | None:
        """``key`` leaves as a chosen victim (a policy with history remembers it here)."""
        return self.remove(key)

    @abstractmethod
    def victims(self) -> Iterator[tuple[K, V]]:
        """Held entries, first to evict first; nothing is removed."""

    def pop_victim(self) -> tuple[K, V]:
        """Evict the first victim and return it; ``KeyError`` when nothing is held."""
        first = next(self.victims(), None)
        if first is None:
            raise KeyError("pop_victim: no entries")
        self.evict(first[0])
        return first

    @abstractmethod
    def clear(self) -> None:
        """Forget every entry (``entries`` stays the same, now empty, object)."""

    def keys_in_order(self) -> list[K]:
        """Held keys, first to evict first (tests and the planner compare these)."""
        return [k for k, _ in self.victims()]

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries


def _consume(it: Iterable[Any]) -> None:
    """Run an iterator to its end in C (no Python frame per item)."""
    deque(it, maxlen=0)


class _OrderedPolicy(EvictionPolicy[K, V]):
    """One ``OrderedDict`` whose order is the eviction order, oldest first: insertion
    appends, eviction takes from the front. Subclasses say what an access does."""

    def __init__(self) -> None:
        self._od: OrderedDict[K, V] = OrderedDict()

    @property
    def entries(self) -> Mapping[K, V]:
        return self._od

    def insert(self, key: K, value: V) -> None:
        self._od[key] = value

    def insert_many(self, items: Mapping[K, V]) -> None:
        self._od.update(items)

    def remove(self, key: K) -> V | None:
        return self._od.pop(key, None)

    def victims(self) -> Iterator[tuple[K, V]]:
        return iter(self._od.items())

    def pop_victim(self) -> tuple[K, V]:
        if not self._od:
            raise KeyError("pop_victim: no entries")
        return self._od.popitem(last=False)

    def keys_in_order(self) -> list[K]:
        return list(self._od)

    def clear(self) -> None:
        self._od.clear()

    def __len__(self) -> int:
        return len(self._od)


class LRUPolicy(_OrderedPolicy[K, V]):
    """Least recently used first: an access moves the key to the back."""

    name = "lru"

    def access(self, key: K) -> None:
        self._od.move_to_end(key)

    def touch_many(self, keys: Iterable[K]) -> None:
        od = self._od
        _consume(map(od.move_to_end, filter(od.__contains__, keys)))

    def touch_held(self, keys: Iterable[K]) -> None:
        _consume(map(self._od.move_to_end, keys))


class FIFOPolicy(_OrderedPolicy[K, V]):
    """First stored, first evicted: accesses change nothing."""

    name = "fifo"

    def access(self, key: K) -> None:
        if key not in self._od:
            raise KeyError(key)

    def touch_many(self, keys: Iterable[K]) -> None:
        pass

    def touch_held(self, keys: Iterable[K]) -> None:
        pass


_POLICIES: dict[str, Callable[[], EvictionPolicy[Any, Any]]] = {}


def register_policy(name: str, factory: Callable[[], EvictionPolicy[Any, Any]]) -> None:
    """Make ``factory`` available as ``eviction_policy: <name>``."""
    if name in _POLICIES:
        raise ValueError(f"eviction policy {name!r} is already registered")
    _POLICIES[name] = factory


def policy_names() -> tuple[str, ...]:
    """The names :func:`make_policy` accepts, in registration order."""
    return tuple(_POLICIES)


def make_policy(name: str) -> EvictionPolicy[Any, Any]:
    """A new, empty policy by name; an unknown name is refused with the choices."""
    factory = _POLICIES.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(f"eviction_policy: {name!r} is not a known policy; choose one of "
                         f"{', '.join(policy_names())}")
    return factory()


register_policy(LRUPolicy.name, LRUPolicy)
register_policy(FIFOPolicy.name, FIFOPolicy)
