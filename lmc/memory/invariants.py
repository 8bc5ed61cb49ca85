"""Debug invariant mode for pool memory: wrong KV must fail loudly in tests, not corrupt.

With ``LMC_DEBUG_INVARIANTS=1`` in the environment when a :class:`~lmc.memory.pool.MemoryPool` is
built (or ``MemoryPool(..., invariants=True)``), the pool checks, as it goes:

* every object's tensor starts at the pool's base address plus the object's offset, is
  contiguous and spans exactly its ``nbytes`` (checked whenever a view is made, batch views
  included);
* no two live blocks overlap (the allocator checks each block it hands out against its
  neighbours);
* freed memory is poisoned: a block is filled with 0xFF bytes (NaN in every float dtype)
  when its last reference goes, so a copy that reads an object after releasing it (a late
  asynchronous copy, a view kept past its release) moves garbage that a bit-exact test sees;
* reference counts balance: ``close()`` with objects still referenced, or an object
  garbage-collected while referenced from a pool that lives on (judged at ``close()`` or
  when :func:`take` is called), is a violation naming the allocation site.

A violation raises :class:`InvariantError` where it is detected *and* is recorded here, so a
violation that code under test swallows (a tier's ``except Exception``) still reaches the test
run: ``tests/conftest.py`` fails the test during whose run it was recorded. Off (the default),
the pool uses the plain allocator and skips every check.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from types import FrameType
from typing import Any

ENV = "LMC_DEBUG_INVARIANTS"

_lock = threading.Lock()
_violations: list[str] = []
pools_checked = 0  # pools built in invariant mode so far (the harness collects garbage after)
_watched: weakref.WeakSet[Any] = weakref.WeakSet()  # pools that lost objects, not yet judged


class InvariantError(AssertionError):
    """A pool invariant was broken: a bug in lmc, never bad user input."""


def enabled_by_env() -> bool:
    """The default of new pools: ``LMC_DEBUG_INVARIANTS=1``."""
    return os.environ.get(ENV, "") == "1"


def note_pool() -> None:
    global pools_checked
    pools_checked += 1


def watch(pool: Any) -> None:
    """``pool`` had an object collected while referenced: :func:`take` reports it if the
    pool is still alive then (``pool.lost_references()``)."""
    _watched.add(pool)


def report(msg: str) -> None:
    """Record a violation for the test harness (and anyone calling :func:`take`)."""
    with _lock:
        _violations.append(msg)


def fail(msg: str) -> InvariantError:
    """Record ``msg`` and return the error to raise: ``raise fail(...)``."""
    report(msg)
    return InvariantError(msg)


def take() -> list[str]:
    """The violations recorded since the last call (and forget them), including references
    lost by pools that are still alive."""
    for pool in list(_watched):
        for msg in pool.lost_references():
            report(msg)
    _watched.clear()
    with _lock:
        out = list(_violations)
        _violations.clear()
    return out


Site = tuple[tuple[str, int, str], ...]


def capture_site(skip: int = 1, depth: int = 8) -> Site:
    """The caller's stack (innermost last) as (file, line, function): cheap enough to take on
    every allocation; formatted only when reported."""
    f: FrameType | None = sys._getframe(skip + 1)
    out: list[tuple[str, int, str]] = []
    while f is not None and len(out) < depth:
        out.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return tuple(reversed(out))


def format_site(site: Site | None) -> str | None:
    if not site:
        return None
    return "".join(f'  File "{file}", line {line}, in {name}\n' for file, line, name in site)
