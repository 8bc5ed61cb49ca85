"""What every remote tier (Redis, the ``lmc://`` daemon, a future S3 or NIXL tier) shares.

* :func:`split_batch`: one prompt's chunks cut into contiguous parts of about equal weight,
  one per connection, so a large batch moves over several sockets at once while a small one
  stays a single round trip.
* :class:`Rejects`: verify-or-delete. A value that fails a check (header, checksum, keyed
  tag) is released at once, logged, counted and collected, and the tier deletes the collected
  keys after the call: a bad value is a miss *and* gone, so it is never re-read, re-checked
  and re-logged by every later lookup.
* :class:`lmc.storage.breaker.CircuitBreaker` (its own module): a dead server costs no timeouts.

A new remote tier built from these keeps the contract in :mod:`lmc.storage.tier` (failure
is a miss within a deadline, corruption is a miss and a delete) without copying any of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from lmc.memory.pool import MemoryObj
from lmc.settings import parse_duration, parse_int
from lmc.storage.serde import CorruptValue
from lmc.storage.tier import BackendOption

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Hashable)


def split_batch(weights: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """At most ``parts`` contiguous ``(start, stop)`` ranges covering ``weights`` in order,
    each of about ``sum(weights) / parts``; never an empty range, ``[]`` for no items.

    Equal weights (``[1] * n``) give counts that differ by at most one."""
    n = len(weights)
    if n == 0:
        return []
    if parts < 1:
        raise ValueError(f"split_batch: parts must be >= 1, got {parts}")
    parts = min(parts, n)
    if parts == 1:
        return [(0, n)]
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"split_batch: weights must sum to > 0, got {total}")
    out: list[tuple[int, int]] = []
    start = acc = 0
    for i, w in enumerate(weights):
        acc += w
        left_items, left_parts = n - (i + 1), parts - len(out) - 1
        # cut once this part reached its share of the whole, or when every remaining item
        # must start a part of its own
        if left_parts and left_items and (acc * parts >= total * (len(out) + 1)
                                          or left_items == left_parts):
            out.append((start, i + 1))
            start = i + 1
    out.append((start, n))
    return out


class Rejects(Generic[R]):
    """Values one tier call refused; thread-safe (a call's parts may run on several threads).

    ``ref`` is whatever names a value to the tier's delete (a key, or an index into the
    call's keys). ``label`` prefixes the log line (``"redis tier host:6379"``).
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._refs: dict[R, None] = {}  # insertion-ordered set
        self._lock = threading.Lock()

    def verify(self, ref: R, obj: MemoryObj, check: Callable[[], None], name: str = ""
               ) -> MemoryObj | None:
        """``obj`` if ``check()`` passes; else ``None``, with ``obj`` released and ``ref``
        rejected. Only :class:`CorruptValue` is a verdict: anything else is a bug and raises."""
        try:
            check()
        except CorruptValue as e:
            obj.release()
            self.reject(ref, e, name)
            return None
        return obj

    def reject(self, ref: R, why: Exception | str, name: str = "") -> None:
        """Record a refused value (once per ``ref``) and say why."""
        with self._lock:
            if ref in self._refs:
                return
            self._refs[ref] = None
        log.warning("%s: value %s refused (%s): deleted, served as a miss", self.label,
                    name or _display(ref), why)

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, ref: object) -> bool:
        return ref in self._refs

    def take(self) -> list[R]:
        """The refs rejected so far, in order, forgetting them (the caller deletes them)."""
        with self._lock:
            out, self._refs = list(self._refs), {}
        return out

    def delete_with(self, delete: Callable[[list[R]], object]) -> int:
        """Delete every rejected value in one call of ``delete``; returns how many."""
        refs = self.take()
        if refs:
            delete(refs)
        return len(refs)


def _display(ref: object) -> str:
    return ref.hex() if isinstance(ref, bytes) else str(ref)


def breaker_options(failing: str) -> dict[str, BackendOption]:
    """The circuit breaker's options (``lmc.storage.breaker``), declared once for every remote
    tier that has one: ``failing`` says what fails (``"a server's"``, ``"the master's"``)."""
    return {
        "breaker_threshold": BackendOption(3, lambda v, k: parse_int(v, k, minimum=1),
                                           f"failures in a row that open {failing} breaker"),
        "breaker_backoff": BackendOption(0.25, lambda v, k: parse_duration(v, k, minimum=0),
                                         "seconds before the first trial call, doubling"),
        "breaker_max_backoff": BackendOption(
            10.0, lambda v, k: parse_duration(v, k, minimum=0),
            "seconds between trial calls at most"),
    }
