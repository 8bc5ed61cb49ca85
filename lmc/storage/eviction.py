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
* ``set_priority(keys, priority)`` - retention priorities: held keys of ``keys`` get
  ``priority`` (an int, 0 the default every insert gets; absent keys are skipped). Victims
  come lowest priority first, and in the policy's own order (recency, arrival) within one
  priority. A change of priority counts as a use (the key starts at the back of its new
  level, FIFO's too). A key that leaves forgets its priority; a re-inserted key starts at 0.
  ``priority_of(key)`` answers one key's.
* ``demote(keys)`` - held keys of ``keys`` become the first victims of their priority (a
  lower tier's copy of a chunk promoted into L1 under write-on-evict: L1 holds it and
  writes it back when it evicts it, so among equals that copy is the cheapest to lose).
* ``arrival`` - where a key's priority comes from when it is inserted (``None``: 0, the
  default): the storage manager's memory of the priorities it set
  (:mod:`lmc.storage.priorities`), so a chunk written down to the disk or promoted back into
  L1 has its rank from its first moment in the tier. Set after the insert instead, a batch
  of high-priority chunks arriving in a tier full of others of that priority would evict
  its own first chunks (the only ones at 0) to make room for its last ones.

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
    arrival: Callable[[K], int | None] | None = None
    """A new key's priority (module doc); ``None`` (the default): every insert gets 0."""

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

    def set_priority(self, keys: Iterable[K], priority: int) -> int:
        """Held keys of ``keys`` take ``priority`` (module doc); returns how many are held.
        A policy without priorities refuses any but 0."""
        if priority != 0:
            raise ValueError(f"eviction policy {self.name!r} keeps no priorities")
        return sum(1 for k in keys if k in self.entries)

    def priority_of(self, key: K) -> int:
        """``key``'s retention priority (0 when not held or never set)."""
        return 0

    def demote(self, keys: Iterable[K]) -> None:  # noqa: B027 - optional: order unchanged
        """Held keys of ``keys`` go first among their priority (module doc)."""

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
    appends, eviction takes from the front. Subclasses say what an access does.

    Priorities: every key stays in that one dict (``entries``); a key of another priority
    than 0 is also listed in ``_prio`` and ordered within its priority by a dict of its own
    (``_levels``), which an access moves as the main dict. ``victims`` walks the levels
    below 0, then the main dict skipping prioritised keys, then the levels above 0. With no
    priority set (``_prio`` empty) every path is the plain dict's, as before."""

    def __init__(self) -> None:
        self._od: OrderedDict[K, V] = OrderedDict()
        self._prio: dict[K, int] = {}
        self._levels: dict[int, OrderedDict[K, None]] = {}

    @property
    def entries(self) -> Mapping[K, V]:
        return self._od

    def insert(self, key: K, value: V) -> None:
        self._od[key] = value
        if self.arrival is not None:
            self._rank(self.arrival, (key,))

    def insert_many(self, items: Mapping[K, V]) -> None:
        self._od.update(items)
        if self.arrival is not None:
            self._rank(self.arrival, items)

    def _rank(self, get: Callable[[K], int | None], keys: Iterable[K]) -> None:
        """New keys take the priority ``get`` says (0 where it says nothing)."""
        for k in keys:
            p = get(k)
            if p:
                self.set_priority((k,), p)

    def remove(self, key: K) -> V | None:
        if self._prio:
            self._forget_priority(key)
        return self._od.pop(key, None)

    def _forget_priority(self, key: K) -> None:
        p = self._prio.pop(key, None)
        if p is not None:
            level = self._levels[p]
            del level[key]
            if not level:
                del self._levels[p]

    def _moved(self, keys: Iterable[K]) -> None:
        """An access of each of ``keys``: prioritised ones move within their level too."""
        prio, levels = self._prio, self._levels
        for k in keys:
            p = prio.get(k)
            if p is not None:
                levels[p].move_to_end(k)

    def victims(self) -> Iterator[tuple[K, V]]:
        if not self._prio:
            return iter(self._od.items())
        return self._victims_by_priority()

    def _victims_by_priority(self) -> Iterator[tuple[K, V]]:
        od, prio = self._od, self._prio
        order = sorted(self._levels)
        for p in order:
            if p < 0:
                yield from ((k, od[k]) for k in self._levels[p])
        yield from ((k, v) for k, v in od.items() if k not in prio)
        for p in order:
            if p > 0:
                yield from ((k, od[k]) for k in self._levels[p])

    def pop_victim(self) -> tuple[K, V]:
        if not self._od:
            raise KeyError("pop_victim: no entries")
        if not self._prio:
            return self._od.popitem(last=False)
        return super().pop_victim()

    def keys_in_order(self) -> list[K]:
        if not self._prio:
            return list(self._od)
        return [k for k, _ in self._victims_by_priority()]

    def clear(self) -> None:
        self._od.clear()
        self._prio.clear()
        self._levels.clear()

    def set_priority(self, keys: Iterable[K], priority: int) -> int:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        od, n = self._od, 0
        for k in keys:
            if k not in od:
                continue
            n += 1
            if self._prio.get(k, 0) == priority:
                continue
            self._forget_priority(k)
            od.move_to_end(k)  # a change of priority is a fresh start in its new level
            if priority:
                self._prio[k] = priority
                self._levels.setdefault(priority, OrderedDict())[k] = None
        return n

    def priority_of(self, key: K) -> int:
        return self._prio.get(key, 0)

    def demote(self, keys: Iterable[K]) -> None:
        od, prio = self._od, self._prio
        for k in keys:
            if k in od:
                od.move_to_end(k, last=False)
                p = prio.get(k)
                if p is not None:
                    self._levels[p].move_to_end(k, last=False)

    def __len__(self) -> int:
        return len(self._od)


class LRUPolicy(_OrderedPolicy[K, V]):
    """Least recently used first: an access moves the key to the back."""

    name = "lru"

    def access(self, key: K) -> None:
        self._od.move_to_end(key)
        if self._prio:
            self._moved((key,))

    def touch_many(self, keys: Iterable[K]) -> None:
        od = self._od
        if self._prio:
            keys = [k for k in keys if k in od]
            self._moved(keys)
        _consume(map(od.move_to_end, filter(od.__contains__, keys)))

    def touch_held(self, keys: Iterable[K]) -> None:
        if self._prio:
            keys = list(keys)
            self._moved(keys)
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
