"""What the disk tier holds and how full it is, without its files.

:class:`DiskIndex` is the key -> :class:`Entry` table in the tier's eviction policy
(:mod:`lmc.storage.eviction`), the bytes it accounts for -- indexed files (``used``), files
being written (``reserved``), evicted files not yet unlinked (``dying``) -- and the rule that
makes room: victims in the policy's order until the new file fits, stopping early at a
victim of exactly the new file's size that no one is reading, whose file is recycled. The
tier (``backend.py``) holds it under its lock and does the file I/O around it; the planner
(``lmc/planner/tiers.py``) runs the same object with no files at all, so what it predicts
the disk tier holds is what this code decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lmc.storage.eviction import EvictionPolicy, make_policy
from lmc.storage.tier import Key

BLOCK = 4096


def round_up(n: int) -> int:
    """``n`` rounded up to whole 4 KiB blocks (a file's payload part)."""
    return -(-n // BLOCK) * BLOCK


def file_bytes(nbytes: int) -> int:
    """A value's file: a 4 KiB header block, then the payload rounded up to 4 KiB."""
    return BLOCK + round_up(nbytes)


class Entry:
    """An indexed file: its size, and how many reads hold it (not recycled meanwhile)."""

    __slots__ = ("size", "readers")

    def __init__(self, size: int) -> None:
        self.size = size
        self.readers = 0


@dataclasses.dataclass
class Eviction:
    """What one :meth:`DiskIndex.make_room` evicted: what ``retire`` gave for each victim to
    unlink, the recycled victim's (``None``: none), the bytes the unlinks will free, and
    every key that left the index (for the tier's ``on_evicted``)."""

    victims: list[Any]
    recycled: Any
    dying: int
    gone: list[Key]


Retire = Callable[[Key, int], Any]
"""``retire(key, size)``: take an evicted value's file out of the key space (the tier renames
it), returning what to unlink or recycle later; ``None`` when the file was already gone."""


class DiskIndex:
    """See the module docstring. Not thread-safe: the tier calls it under its lock."""

    def __init__(self, capacity: int, eviction_policy: str = "lru") -> None:
        self.capacity = int(capacity)
        self.policy: EvictionPolicy[Key, Entry] = make_policy(eviction_policy)
        self.entries = self.policy.entries  # lookups that are not a use (never reassigned)
        self.used = 0  # bytes of indexed files
        self.reserved = 0  # bytes of files being written
        self.dying = 0  # bytes of evicted files not yet unlinked

    def committed(self) -> int:
        """Bytes on disk or about to be: stored, being written, evicted but not yet unlinked."""
        return self.used + self.reserved + self.dying

    def commit(self, key: Key, size: int) -> None:
        """A written file of ``size`` reserved bytes is now ``key``'s value."""
        self.reserved -= size
        self.policy.insert(key, Entry(size))
        self.used += size

    def forget(self, key: Key) -> Entry | None:
        """``key`` leaves the index (its file is the caller's to remove)."""
        e = self.policy.remove(key)
        if e is not None:
            self.used -= e.size
        return e

    def make_room(self, size: int, retire: Retire) -> tuple[bool, Eviction | None]:
        """Reserve ``size`` bytes: at once where they fit (``(True, None)``), else evict
        (``(True, eviction)`` when a victim was recycled: its file is the reservation;
        ``(False, eviction)``: the victims' bytes are free once unlinked, try again)."""
        over = self.committed() + size - self.capacity
        if over <= 0:
            self.reserved += size
            return True, None
        ev = self.evict(over, size, retire)
        return ev.recycled is not None, ev

    def evict(self, need: int, size: int, retire: Retire, recycle: bool = True) -> Eviction:
        """Evict values in the policy's order until ``need`` bytes will be free, or until one
        of exactly ``size`` bytes that no one is reading can be recycled (its bytes become the
        new reservation)."""
        ev = Eviction([], None, 0, [])
        freed = 0
        while self.entries and freed < need:
            key, e = self.policy.pop_victim()
            ev.gone.append(key)
            self.used -= e.size
            token = retire(key, e.size)
            if token is None:  # the file was already gone
                freed += e.size
                continue
            if recycle and e.size == size and e.readers == 0:
                ev.recycled = token
                self.reserved += size
                break
            ev.victims.append(token)
            self.dying += e.size
            ev.dying += e.size
            freed += e.size
        return ev
