"""A load that watches itself: a lower tier's whole-chunk read that stops once finishing it
would cost more than recomputing what is left.

The load-or-recompute decision (:mod:`lmc.connectors.core.load_policy`) is made from
estimates; a tier never read yet has only its prior, and a link can slow down after the
decision. Measured: a fresh engine behind an ``lmc server`` reached through a 3 MiB/s link
loaded 2,047 of 2,048 tokens and its TTFT was 5.07x the engine alone. So the read of a
load's lower-tier chunks (tiers that return whole chunks: the daemon, Mooncake, wrappers)
goes in pieces, in prefix order, ``DEPTH`` (4) in flight, and while it waits for the oldest
piece in flight (the head) the read compares counted things with what recomputing costs,
``recompute_s(position)``: the engine's compute from the head's first chunk to the end of
the prompt (the connector's estimate, the measured one or, on an engine that has computed
nothing yet, a bound from its model's arithmetic). It gives up on the head at the earlier
of:

* **the rest cannot win**: the chunks not yet asked for, at the best rate the link can
  have had since the head started (every chunk in flight counted as moved: a lower bound
  of the time left, whatever the link does next, unless it speeds up again), would cost
  more than recomputing;
* **waited as long as recomputing costs**: the head has been the piece waited for (since
  it started, or the piece before it landed) as long as recomputing from it takes. Past
  that point no bound says more (every chunk may be in flight), and waiting that long then
  recomputing costs at most twice the better choice, whatever the link does (the
  rent-or-buy argument); it is what stops a link that slows 4,000x under the last pieces.

Each comparison allows ``margin`` and ``slack_s`` (near-ties go to the load); a piece
that lands is also checked (the rest at the rate it showed). On a stop the pieces in flight
are abandoned (their chunks, once they land, are promoted into L1 and released: memory
under a read belongs to that read), and the fetch answers the chunks fully read before
them -- a prefix, chunk-aligned, nothing partly written counted. The caller reports the
rest as failed loads and the engine recomputes them (vLLM's and the reference engine's
load-error path).

Pieces: a tier not read yet (no measured rate) is first read one chunk alone, so a link
slow from the start shows within that chunk with nothing else in flight to blur it; then
(and from the start on a measured tier) four pieces are in flight, each a sixteenth of
what remains (one chunk at least), so the pieces in flight are a small part of the rest
and a fast tier is read with the parallelism of one batch. Pieces share the link, so one
piece's time says little of the tier's rate: the speed estimates get the read as a whole
(its bytes over its time) and each abandoned piece once it lands. Measured on a loopback
``lmc server`` and the disk tier (``benchmarks/bench_watched_read.py``, RESULTS.md): one
chunk at a time cost 1.3-1.5x the plain batch; four in flight cost what the batch costs.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmc import units

if TYPE_CHECKING:
    from lmc.memory.pool import MemoryObj
    from lmc.storage.tier import Key

log = logging.getLogger(__name__)
Abandon = Callable[[list["Key"], list["MemoryObj | None"]], None]
Observe = Callable[[int, float], None]
DEFAULT_MARGIN = 0.03
DEFAULT_SLACK_S = 1e-3
DEPTH = 4  # pieces in flight (module doc)


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


def piece_size(remaining: int, first: bool, depth: int = DEPTH) -> int:
    """Chunks in the next piece (module doc): one to learn the tier's rate, then a
    ``4 * depth``-th of what remains, so the pieces in flight stay a small part of it."""
    return 1 if first else max(1, remaining // (4 * depth))


class Running:
    """Pieces of watched reads not done with yet: running, or abandoned in flight and not
    yet handed over (observed, then given to ``abandon``). A stopped load returns before
    its abandoned pieces land; what they do then (a speed observed, chunks promoted) is
    waited for here, by a close and by whoever needs that aftermath settled (a test reading
    the speeds a stopped load measured, a benchmark placing chunks)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._n = 0

    def enter(self) -> None:
        with self._cv:
            self._n += 1

    def leave(self) -> None:
        with self._cv:
            self._n -= 1
            self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until none is running or landing; False if ``timeout`` seconds passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._n == 0, timeout)


@dataclass
class _Piece:
    """One ``get`` of a watched read: keys ``[first, first + size)``, submitted at ``start``."""

    first: int
    size: int
    start: float
    fut: Future


class _Flight:
    """The pieces of one watched read in prefix order, at most ``depth`` in flight (the
    first alone while ``learn``), and the rule's deadline for the oldest (module doc)."""

    def __init__(self, get: Callable[[list[Key]], list[MemoryObj | None]], keys: list[Key],
                 executor: ThreadPoolExecutor, depth: int, learn: bool,
                 observe: Observe | None = None, running: Running | None = None) -> None:
        self.get, self.keys, self.executor, self.depth = get, keys, executor, depth
        self.learn = learn
        self.observe = observe
        self.running = running
        self.t0 = time.monotonic()
        self.nbytes = 0  # landed so far
        self.last = 0.0  # when the last piece landed
        self.pieces: deque[_Piece] = deque()
        self.next = 0  # the first key not submitted yet
        self.prev: tuple[float, int] | None = None  # the last landed piece: (time, size)

    def fill(self) -> int:
        """Submit pieces until ``depth`` are in flight; how many."""
        n, added = len(self.keys), 0
        depth = 1 if self.learn and self.prev is None else self.depth
        while self.next < n and len(self.pieces) < depth:
            size = min(n - self.next, piece_size(n - self.next, self.learn and self.next == 0,
                                                 self.depth))
            keys = self.keys[self.next: self.next + size]
            self.pieces.append(_Piece(self.next, size, time.monotonic(),
                                      self.executor.submit(self.get, keys)))
            self.next += size
            added += 1
        return added

    @property
    def unsubmitted(self) -> int:
        return len(self.keys) - self.next

    def bound(self, head: _Piece, limit: float) -> float:
        """When the chunks not yet submitted, at the best rate the link can have had since
        ``head`` started (everything in flight counted as moved, ``head`` included), would
        cost more than ``limit``; ``inf`` when every chunk was submitted."""
        left = self.unsubmitted
        if left <= 0:
            return math.inf
        flying = sum(p.size for p in self.pieces if p is not head) + head.size
        best = head.start + limit * flying / left
        if self.prev is not None:
            landed, size = self.prev
            if landed > head.start:  # the piece before it moved bytes after it started
                best = min(head.start + limit * (flying + size) / left,
                           landed + limit * flying / left)  # or since that one landed
        return best

    def deadline(self, head: _Piece, limit: float) -> float:
        """When to give up waiting for ``head`` (the oldest piece in flight): at
        :meth:`bound`, or once ``head`` has been the piece waited for (since it started or
        the piece before it landed) for ``limit`` -- waiting as long as recomputing costs,
        then recomputing, is never more than twice the better choice, whatever the link
        does next."""
        since = head.start if self.prev is None else max(head.start, self.prev[0])
        return min(self.bound(head, limit), since + limit)

    def landed(self, objs: list[MemoryObj | None]) -> None:
        self.nbytes += sum(o.nbytes for o in objs if o is not None)
        self.last = time.monotonic()

    def observed(self) -> None:
        """The read's one observation: the bytes landed, from the first piece's start to
        the last landing (nothing when none landed: an abandoned piece tells it later)."""
        if self.observe is not None and self.nbytes:
            self.observe(self.nbytes, self.last - self.t0)

    def abandon(self, abandon: Abandon) -> None:
        """Every piece still in flight goes, once it lands, to ``abandon`` (and is
        observed: its bytes over the time since it started)."""
        for p in self.pieces:
            _abandon_when_done(p, self.keys[p.first: p.first + p.size], abandon, self.observe,
                               self.running)
        self.pieces.clear()


def read_watched(get: Callable[[list[Key]], list[MemoryObj | None]],
                 abandon: Callable[[list[Key], list[MemoryObj | None]], None],
                 keys: list[Key], chunk_index: Sequence[int], watch: LoadWatch,
                 executor: ThreadPoolExecutor, tier: str, depth: int = DEPTH,
                 learn: bool = True, observe: Observe | None = None,
                 running: Running | None = None) -> list[MemoryObj | None]:
    """Read ``keys`` (chunks ``chunk_index`` of the fetch, ascending) in pieces through
    ``get`` on ``executor`` (``depth`` in flight; ``learn``: the first piece, one chunk,
    alone), stopping by ``watch``'s rule; a miss also ends the read (the fetch keeps only a prefix). Answers an object or
    ``None`` per key. Pieces abandoned in flight are handed, once each returns, to
    ``abandon(keys, objs)`` (which owns them). ``observe(nbytes, seconds)``: what the read
    moved and how long it took, once (pieces share the link, so one piece's time says
    little), and each abandoned piece's once it lands. ``running``: counts each abandoned
    piece from its abandonment until ``abandon`` has returned (:class:`Running`)."""
    if not keys or math.isinf(watch.limit(chunk_index[0])):
        return get(keys)  # compute unknown: nothing to stop for, one read as unwatched
    flight = _Flight(get, keys, executor, depth, learn, observe, running)
    try:
        return _read(flight, abandon, chunk_index, watch, tier)
    finally:
        flight.observed()


def _read(flight: _Flight, abandon: Abandon, chunk_index: Sequence[int], watch: LoadWatch,
          tier: str) -> list[MemoryObj | None]:
    keys = flight.keys
    out: list[MemoryObj | None] = [None] * len(keys)
    watch.pieces += flight.fill()
    while flight.pieces:
        head = flight.pieces[0]
        limit = watch.limit(chunk_index[head.first])
        got = _wait(head.fut, flight.deadline(head, limit))
        if got is None:  # past the deadline, still in flight
            took = time.monotonic() - head.start
            left = flight.unsubmitted
            flight.abandon(abandon)
            watch.stop(chunk_index[head.first],
                       _why(tier, head.size, took, left, watch.recompute_from(
                           chunk_index[head.first]), in_flight=True))
            return out
        flight.pieces.popleft()
        flight.landed(got)
        out[head.first: head.first + head.size] = got
        if any(o is None for o in got):
            flight.abandon(abandon)
            return out
        now = time.monotonic()
        after = head.first + head.size
        if after < len(keys) and flight.bound(head, watch.limit(chunk_index[after])) < now:
            left = flight.unsubmitted
            flight.abandon(abandon)
            watch.stop(chunk_index[after], _why(tier, head.size, now - head.start, left,
                                                watch.recompute_from(chunk_index[after]),
                                                in_flight=False))
            return out
        flight.prev = (now, head.size)
        watch.pieces += flight.fill()
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


def _abandon_when_done(piece: _Piece, keys: list[Key], abandon: Abandon,
                       observe: Observe | None, running: Running | None = None) -> None:
    def landed(f: Future) -> None:
        try:
            try:
                objs = f.result()
            except Exception:  # the read's own error handling counted it
                return
            if observe is not None:
                nbytes = sum(o.nbytes for o in objs if o is not None)
                if nbytes:
                    observe(nbytes, time.monotonic() - piece.start)
            abandon(keys, objs)
        finally:
            if running is not None:
                running.leave()

    if running is not None:
        running.enter()  # before the callback, which runs at once if the piece has landed
    piece.fut.add_done_callback(landed)


def _why(tier: str, size: int, took: float, left: int, recompute: float,
         in_flight: bool) -> str:
    seen = "not done after" if in_flight else "took"
    return (f"tier {tier}: a piece of {size} chunk(s) {seen} {units.seconds(took)}; at the "
            f"rate shown, the {left} chunk(s) not yet asked for would take longer than "
            f"recomputing from here (~{units.seconds(recompute)})")
