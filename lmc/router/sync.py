"""Keeping one source in sequence without ever waiting on it: its replay socket, asked
without blocking, and the PUB batches that arrive meanwhile.

Before, the feed's single thread waited up to ``REPLAY_TIMEOUT`` on each dump or replay; a
source whose replay socket never answers (a typo in its ``replay=`` is enough) was asked
again at each of its heartbeats, and the other sources' batches waited behind it until they
went stale. Now each source has a :class:`SourceSync`: a DEALER of its own (one request
under way at a time) that the feed's poll loop reads with every other socket, so answers
are taken frame by frame as they come and a silent source only times out its own request.

* A **sync** (at start, after a restart, after a loss a replay cannot fill) asks for a dump
  (lmc's ``[b"", b"dump"]``; a publisher without dumps -- vLLM's -- answers the end marker
  alone, and is then replayed from seq 0). The answer is applied to a *staging*
  :class:`PrefixIndex` as it arrives (bounded as the live one is) and swapped in at the end
  marker, so a failed sync never leaves a half-applied index scored.
* A **gap** (a PUB seq past the next expected, or a batch that does not decode) is filled
  by vLLM's replay request from the next expected seq, applied to the live index in order;
  a replay that skips a seq (the buffer no longer holds it) turns into a sync.
* PUB batches arriving while a request is under way wait in a bounded queue
  (:data:`MAX_HELD` batches, :data:`MAX_HELD_BYTES`) and are applied after it; past the
  bound they are dropped, and the next batch's gap asks for them again.
* A request unanswered within :data:`REPLAY_TIMEOUT`, answered with more than
  :data:`MAX_REPLAY` batches, or refused is abandoned (its socket closed, so a late answer
  cannot be mistaken for the next one's); the source stays unsynced (scored as caching
  nothing) and is asked again :data:`RETRY` seconds later at the earliest -- never at each
  heartbeat.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmc.events import wire
from lmc.ratelog import RateLimitedWarnings
from lmc.router.index import PrefixIndex

if TYPE_CHECKING:
    from lmc.router.feed import Source

log = logging.getLogger(__name__)
_warn = RateLimitedWarnings(limit=10, window=10.0, logger=log)
REPLAY_TIMEOUT = 2.0
RETRY = 5.0
MAX_REPLAY = 1 << 16
MAX_MESSAGE = 64 << 20
MAX_HELD = 1000
MAX_HELD_BYTES = 64 << 20


@dataclass
class _Request:
    kind: str  # "dump", "replay0" (a sync from seq 0), "fill" (a gap)
    deadline: float
    staging: PrefixIndex | None = None  # a sync's index, swapped in at the end marker
    batches: int = 0
    last_seq: int | None = None


class SourceSync:
    """One source's replay conversation and held batches (module docstring). Called from
    the feed's thread only."""

    def __init__(self, source: Source, zmq: Any, ctx: Any) -> None:
        self.s = source
        self.zmq = zmq
        self.ctx = ctx
        self.sock: Any = None
        self.request: _Request | None = None
        self.held: deque[tuple[int, bytes]] = deque()
        self.held_bytes = 0
        self.retry_at = 0.0

    # ------------------------------------------------------------------ asking
    def start_sync(self, now: float) -> None:
        """Ask for a dump, unless a request is under way or the last failed < RETRY ago."""
        if self.request is not None or now < self.retry_at or not self.s.replay_endpoint:
            return
        self.s.synced = False
        self.s.counts["dumps"] += 1
        self._ask(b"dump", _Request("dump", now + REPLAY_TIMEOUT,
                                    PrefixIndex(self.s.index.max_blocks)))

    def _start_fill(self, now: float) -> None:
        self.s.counts["replays"] += 1
        self._ask(wire.seq_bytes(self.s.next_seq or 0),
                  _Request("fill", now + REPLAY_TIMEOUT))

    def _ask(self, body: bytes, req: _Request) -> None:
        zmq = self.zmq
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            self.sock.setsockopt(zmq.SNDHWM, 4)
            self.sock.connect(self.s.replay_endpoint)
        try:
            self.sock.send_multipart([b"", body], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # not connected yet and its queue full: a failure
            self._failed(time.monotonic(), f"cannot ask: {e}")
            return
        self.request = req

    # ------------------------------------------------------------------ answers
    def on_readable(self, now: float, limit: int = 256) -> None:
        """Take what the replay socket sent (at most ``limit`` frames' worth per call)."""
        zmq = self.zmq
        for _ in range(limit):
            if self.sock is None or self.request is None:
                return
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._frame(frames, now)

    def _frame(self, frames: list[bytes], now: float) -> None:
        req = self.request
        assert req is not None
        s = self.s
        if len(frames) != 4 or len(frames[2]) != 8:
            s.counts["bad"] += 1
            self._failed(now, f"an answer of {len(frames)} frames")
            return
        if frames[2] == wire.END_SEQ:
            if frames[3]:
                self._failed(now, "refused: " + frames[3][:200].decode("utf-8", "replace"))
            else:
                self._ended(req, now)
            return
        req.batches += 1
        if req.batches > MAX_REPLAY:
            s.counts["bad"] += 1
            self._failed(now, f"more than {MAX_REPLAY} batches")
            return
        seq = int.from_bytes(frames[2], "big")
        try:
            events = wire.decode_batch(frames[3])[1]
        except wire.WireError as e:
            s.counts["bad"] += 1
            self._failed(now, f"a bad batch {seq}: {e}")
            return
        if req.staging is not None:  # a sync: everything, into the staging index
            req.staging.apply(events)
            req.last_seq = seq
        elif s.next_seq is None or seq < s.next_seq:
            pass  # applied already
        elif seq > s.next_seq:  # the buffer no longer holds what was missed
            self._drop_request()
            self.start_sync(now)
        else:
            s.index.apply(events)
            s.next_seq = seq + 1
            s.counts["batches"] += 1

    def _ended(self, req: _Request, now: float) -> None:
        s = self.s
        self._drop_request(close=False)
        if req.kind == "dump" and not req.batches:  # a publisher without dumps
            s.counts["replays"] += 1
            self._ask(wire.seq_bytes(0), _Request("replay0", now + REPLAY_TIMEOUT,
                                                  PrefixIndex(s.index.max_blocks)))
            return
        if req.staging is not None:
            s.index = req.staging
            s.next_seq = None if req.last_seq is None else req.last_seq + 1
            s.synced = True
            s.last_heard = now
            log.info("events from %s: synced (%d blocks)", s.name, s.index.blocks)
        self._apply_held(now)

    def _failed(self, now: float, why: str) -> None:
        _warn("events from %s: replay socket %s: %s; retrying in %.0f s", self.s.name,
              self.s.replay_endpoint, why, RETRY)
        kind = self.request.kind if self.request is not None else "dump"
        self._drop_request()
        self.retry_at = now + RETRY
        if kind == "fill":
            self.s.synced = False  # a gap it could not fill: a sync, after RETRY
        self.held.clear()
        self.held_bytes = 0

    def _drop_request(self, close: bool = True) -> None:
        """Forget the request; ``close``: also the socket (a late answer must not be read as
        the next request's)."""
        self.request = None
        if close and self.sock is not None:
            self.sock.close(0)
            self.sock = None

    def check(self, now: float) -> None:
        """Time out a request; start a sync that is due."""
        if self.request is not None and now > self.request.deadline:
            self._failed(now, f"no answer in {REPLAY_TIMEOUT:.0f} s")
        elif not self.s.synced and self.s.replay_endpoint:
            self.start_sync(now)

    # ------------------------------------------------------------------ PUB batches
    def on_batch(self, seq: int, payload: bytes, now: float) -> None:
        """One PUB batch in sequence order (restarts were handled by the feed)."""
        s = self.s
        if not s.replay_endpoint and not s.synced:  # best effort: from here on
            s.synced, s.next_seq = True, seq
        if self.request is not None or not s.synced:
            self._hold(seq, payload)
            if self.request is None:
                self.start_sync(now)
        elif not self._in_order(seq, payload, now):
            self._hold(seq, payload)

    def _in_order(self, seq: int, payload: bytes, now: float) -> bool:
        """Apply the batch if it is the next one (or skip it if applied already); False when
        a replay was asked for what comes before it (the caller keeps it for after)."""
        s = self.s
        if s.next_seq is None:  # synced from an empty replay buffer: from here on
            s.next_seq = seq
        if seq < s.next_seq:
            return True  # already applied (the dump or replay covered it)
        if seq > s.next_seq:
            s.counts["gaps"] += 1
            if not s.replay_endpoint:  # best effort: from here on
                s.next_seq = seq
            else:
                self._start_fill(now)
                return False
        try:
            events = wire.decode_batch(payload)[1]
        except wire.WireError as e:
            s.counts["bad"] += 1
            _warn("events from %s: batch %d refused: %s", s.name, seq, e)
            if s.replay_endpoint:  # asked again: a gap at this seq
                s.counts["gaps"] += 1
                self._start_fill(now)
            return True
        s.index.apply(events)
        s.next_seq = seq + 1
        s.counts["batches"] += 1
        return True

    def _hold(self, seq: int, payload: bytes) -> None:
        if len(self.held) >= MAX_HELD or self.held_bytes + len(payload) > MAX_HELD_BYTES:
            self.held.clear()  # the next batch's gap asks for them again
            self.held_bytes = 0
        self.held.append((seq, payload))
        self.held_bytes += len(payload)

    def _apply_held(self, now: float) -> None:
        while self.held and self.request is None and self.s.synced:
            seq, payload = self.held[0]
            if not self._in_order(seq, payload, now):
                return  # a replay was asked for what comes before it: it waits, first
            self.held.popleft()
            self.held_bytes -= len(payload)

    def restarted(self, now: float) -> None:
        """The publisher restarted (a seq at or below the last one): sync anew at once."""
        self._drop_request()
        self.held.clear()
        self.held_bytes = 0
        self.retry_at = 0.0
        self.s.synced = False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
