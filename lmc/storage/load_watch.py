"""A load that watches itself: a lower tier's whole-chunk read that stops once finishing it
would cost more than recomputing what is left.

The load-or-recompute decision (:mod:`lmc.connectors.core.load_policy`) is made from
estimates; a tier never read yet has only its prior, and a link can slow down after the
decision. Measured: a fresh engine behind an ``lmc server`` reached through a 3 MiB/s link
loaded 2,047 of 2,048 tokens and its TTFT was 5.07x the engine alone. So the read of a
load's lower-tier chunks (tiers that return whole chunks: the daemon, Mooncake, wrappers)
goes in pieces, in prefix order, and after each piece -- and while one is in flight -- the
read compares two counted things:

* what finishing costs at least: the chunks still to read, at the rate the current piece
  has at best shown (its chunks over the time it has taken so far; a piece not done yet
  has moved less than all of its bytes, so this is a lower bound of the time left,
  whatever the link does next, unless it speeds up again);
* what recomputing costs: ``recompute_s(position)``, the engine's compute from the first
  chunk not yet read to the end of the prompt (the connector's estimate, the measured one
  or, on an engine that has computed nothing yet, a bound from its model's arithmetic).

When the first exceeds the second (by ``margin`` and ``slack_s``, near-ties going to the
load), the read stops: the piece in flight is abandoned (its chunks, once they land, are
promoted into L1 and released: memory under a read belongs to that read), and the fetch
answers the chunks fully read before it -- a prefix, chunk-aligned, nothing partly
written counted. The caller reports the rest as failed loads and the engine recomputes
them (vLLM's and the reference engine's load-error path).

Pieces: the first is one chunk (the tier's rate is learnt from it), each later one a
quarter of what remains (one chunk at least), so a fast tier is read in a few calls and a
slowdown is seen within a quarter of the rest. A stop needs chunks left after the piece
in flight: the last piece, whose progress a ``get`` cannot show, always finishes. The
cost, measured: 8 chunks (32 MiB) from an ``lmc server`` on loopback in single-chunk
pieces took 49 ms against 40 ms as one batch over its 4 connections. Bigger pieces once
the rest looks cheap (a rest 8x slower than the last piece still beating recomputing)
won that back but let a link that slows 4,000x inside that last piece run to its end;
two pieces in flight would keep both (not done yet).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmc import units

if TYPE_CHECKING:
    from lmc.memory.pool import MemoryObj
    from lmc.storage.tier import Key

log = logging.getLogger(__name__)
DEFAULT_MARGIN = 0.03
DEFAULT_SLACK_S = 1e-3


@dataclass
class LoadWatch:
    """The stop rule of one load (module doc). ``recompute_s(position)``: seconds to compute
    the prompt from ``position`` to its end; ``positions``: each fetched chunk's first
    token (the cache engine sets them). After the fetch, ``stopped_at`` is the index of the
    first chunk not loaded because of a stop (``None``: no stop) and ``reason`` says why."""

    recompute_s: Callable[[int], float]
    margin: float = DEFAULT_MARGIN
    slack_s: float = DEFAULT_SLACK_S
    positions: Sequence[int] = ()
    stopped_at: int | None = None
    reason: str = ""
    pieces: int = field(default=0)

    def recompute_from(self, index: int) -> float:
        """Seconds to recompute from chunk ``index`` of the fetch on."""
        pos = self.positions[index] if index < len(self.positions) else \
            (self.positions[-1] if self.positions else 0)
        return max(0.0, self.recompute_s(pos))

    def limit(self, index: int) -> float:
        """Finishing may cost this much before recomputing from chunk ``index`` wins."""
        return self.recompute_from(index) * (1 + self.margin) + self.slack_s

    def deadline(self, started: float, first: int, piece: int, left_after: int) -> float:
        """When the piece of ``piece`` chunks (from chunk ``first``), started at ``started``,
        has taken so long that the ``left_after`` chunks behind it would cost more than
        recomputing from ``first``; ``inf`` when none are left after it."""
        if left_after <= 0:
            return float("inf")
        return started + self.limit(first) * piece / left_after

    def stop(self, index: int, why: str) -> None:
        self.stopped_at = index
        self.reason = why


def piece_size(remaining: int, first: bool) -> int:
    """Chunks in the next piece (module doc)."""
    return 1 if first else max(1, remaining // 4)


def read_watched(get: Callable[[list[Key]], list[MemoryObj | None]],
                 abandon: Callable[[list[Key], list[MemoryObj | None]], None],
                 keys: list[Key], chunk_index: Sequence[int], watch: LoadWatch,
                 executor: ThreadPoolExecutor, tier: str) -> list[MemoryObj | None]:
    """Read ``keys`` (chunks ``chunk_index`` of the fetch, ascending) in pieces through
    ``get`` on ``executor``, stopping by ``watch``'s rule; a miss also ends the read (the
    fetch keeps only a prefix). Answers an object or ``None`` per key. A piece abandoned in
    flight is handed, once it returns, to ``abandon(keys, objs)`` (which owns them)."""
    if not keys or math.isinf(watch.limit(chunk_index[0])):
        return get(keys)  # compute unknown: nothing to stop for, one read as unwatched
    out: list[MemoryObj | None] = [None] * len(keys)
    n = len(keys)
    done = 0
    while done < n:
        size = min(n - done, piece_size(n - done, done == 0))
        piece = keys[done: done + size]
        started = time.monotonic()
        fut: Future = executor.submit(get, piece)
        limit = watch.deadline(started, chunk_index[done], size, n - done - size)
        got = _wait(fut, limit)
        watch.pieces += 1
        if got is None:  # past the deadline, still in flight
            took = time.monotonic() - started
            _abandon_when_done(fut, piece, abandon)
            watch.stop(chunk_index[done], _why(tier, size, took, n - done - size,
                                               watch.recompute_from(chunk_index[done]),
                                               in_flight=True))
            return out
        out[done: done + size] = got
        if any(o is None for o in got):
            return out
        took = time.monotonic() - started
        done += size
        left = n - done
        if left and took * left / size > watch.limit(chunk_index[done]):
            watch.stop(chunk_index[done], _why(tier, size, took, left,
                                               watch.recompute_from(chunk_index[done]),
                                               in_flight=False))
            return out
    return out


def _wait(fut: Future, deadline: float) -> list[MemoryObj | None] | None:
    """The piece's objects, or ``None`` if ``deadline`` (monotonic) passed first."""
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    while not done.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        done.wait(min(left, 3600.0))
    return fut.result()


def _abandon_when_done(fut: Future, keys: list[Key],
                       abandon: Callable[[list[Key], list[MemoryObj | None]], None]) -> None:
    def landed(f: Future) -> None:
        try:
            objs = f.result()
        except Exception:  # the read's own error handling counted it
            return
        abandon(keys, objs)

    fut.add_done_callback(landed)


def _why(tier: str, size: int, took: float, left: int, recompute: float,
         in_flight: bool) -> str:
    seen = "not done after" if in_flight else "took"
    return (f"tier {tier}: a piece of {size} chunk(s) {seen} {units.seconds(took)}; the "
            f"{left} chunk(s) after it would take >= {units.seconds(took * left / size)}, "
            f"recomputing from here ~{units.seconds(recompute)}")
