"""The replay socket's answers, within bounds that hold across every peer together.

Anyone who can connect may ask (vLLM's ``[b"", start_seq]`` replay, lmc's ``[b"", b"dump"]``
state dump). Before, each request handed ZMQ its whole answer at once: sixteen peers asking
for a replay from seq 0 every 10 ms and never reading grew an engine by 3 GiB. Now an answer
is a cursor (:class:`_Job`) that the publisher's thread advances a few messages at a time
(:meth:`ReplayServer.pump`), and what ZMQ holds is counted:

* **bytes**: each reply's last frame (the payload) is handed to ZMQ zero-copy and *tracked*
  (pyzmq's ``MessageTracker``: done once ZMQ has written it to the kernel, dropped it, or
  the peer went away; the socket's ``copy_threshold`` is 0, else pyzmq copies a frame under
  64 KiB and reports it done at once -- the copy then sat uncounted in ZMQ's queue, the
  very memory this bounds); every reply counts its payload plus :data:`OVERHEAD` until then. At
  most ``replay_max_bytes`` across all peers and a quarter of it per peer (a single message
  larger than that goes alone, when nothing else is held); an answer waits while either is
  full (its cursor costs nothing), and a request arriving while all of it is held is
  refused (``replay_refused``);
* **peers**: at most :data:`MAX_PEERS` with state here (an answer under way, bytes held or
  a recent request); a request from one more is refused;
* **rate**: per peer :data:`BURST` requests, then one per :data:`REFILL` seconds; past it a
  request is refused (``replay_limited``), and so is a second request while the peer's
  answer is under way; at most :data:`MAX_DUMPS` dumps under way, one started per
  :data:`DUMP_INTERVAL` (a dump can be large, a replay is the buffer);
* **stuck peers**: ZMTP heartbeats (a ping every :data:`HEARTBEAT_IVL_MS`, dropped after
  :data:`HEARTBEAT_TIMEOUT_MS` without an answer) disconnect a peer that stopped reading,
  which frees what ZMQ held for it; an answer that makes no progress for :data:`STALL`
  seconds is abandoned (``replay_abandoned``).

A refusal is the end marker with ``error: ...`` as its payload, itself counted like any
reply (``replay_dropped`` when even that does not fit: the peer times out). A replay answers
the batches from ``start_seq`` up to the last one published when it was asked (batches the
buffer dropped meanwhile are skipped: the requester sees a gap, as when it asks too far
back); a dump answers the tiers' state when it was asked.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from lmc.events import wire

OVERHEAD = 512
"""Bytes counted per reply message beyond its payload (its other frames, ZMQ's messages)."""
MAX_PEERS = 64
PEER_SHARE = 4  # a peer holds at most 1/PEER_SHARE of the budget
BURST = 4
REFILL = 0.5
STALL = 10.0
MAX_DUMPS = 1
DUMP_INTERVAL = 1.0
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
SNDHWM = 1024  # messages queued per peer (a second bound; the bytes bind first)
PUMP = 64  # messages sent per pump: publishing goes on between them
IDLE = 30.0  # seconds after which an idle peer's rate state is forgotten
ERROR_WINDOW = 64 << 10  # bytes of refusals held for peers without state


class ReplaySource(Protocol):
    """What the answers come from: the publisher."""

    topic: bytes
    buffer: deque[tuple[int, bytes]]
    seq: int

    def snapshot(self) -> list[list[dict[str, Any]]]: ...

    def encode(self, events: list[dict[str, Any]]) -> bytes: ...

    def count(self, what: str, n: int) -> None: ...


@dataclass
class _Job:
    """One answer under way: a replay's next seq and end, or a dump's batches."""

    end: int  # replay: the first seq not answered; dump: the number of batches
    next: int
    dump: list[list[dict[str, Any]]] | None = None
    dump_seq: bytes = b""  # the seq a dump's batches carry
    pending: bytes | None = None  # a dump batch encoded, not yet sent
    progress_at: float = field(default_factory=time.monotonic)


class _Peer:
    def __init__(self, now: float) -> None:
        self.job: _Job | None = None
        self.held = 0
        self.sent: deque[tuple[Any, int]] = deque()  # (tracker, bytes counted), in order
        self.tokens = float(BURST)
        self.seen = now

    def refill(self, now: float) -> None:
        self.tokens = min(float(BURST), self.tokens + (now - self.seen) / REFILL)
        self.seen = now


class ReplayServer:
    """See the module docstring. Called from the publisher's thread only."""

    def __init__(self, zmq: Any, sock: Any, source: ReplaySource, budget: int) -> None:
        self.zmq = zmq
        self.sock = sock
        self.source = source
        self.budget = budget
        self.per_peer = max(1, budget // PEER_SHARE)
        self.peers: OrderedDict[bytes, _Peer] = OrderedDict()
        self._anon = _Peer(time.monotonic())  # refusals to peers without state
        self.held = 0
        self.peak = 0
        self._dumps = 0
        self._last_dump = float("-inf")
        self.clock = time.monotonic  # requests' clock: rate limits (a test moves its own)

    @staticmethod
    def configure(zmq: Any, sock: Any) -> None:
        """The ROUTER's options, before it binds (a listener copies them then)."""
        sock.setsockopt(zmq.MAXMSGSIZE, 64)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer: an error, not a drop
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.LINGER, 0)
        sock.copy_threshold = 0  # copy=False means it (pyzmq copies below 64 KiB otherwise)

    # ------------------------------------------------------------------ requests
    def on_readable(self, limit: int = 64) -> None:
        """Read up to ``limit`` waiting requests."""
        for _ in range(limit):
            try:
                frames = self.sock.recv_multipart(flags=self.zmq.NOBLOCK)
            except self.zmq.Again:
                return
            self._request(frames[0], frames[1:])

    def _request(self, ident: bytes, body: list[bytes]) -> None:
        now = self.clock()
        peer = self._peer(ident, now)
        if peer is None:
            self.source.count("replay_refused", 1)
            self._refuse(self._anon, ident, b"error: too many replay peers; retry")
            return
        peer.refill(now)
        if peer.tokens < 1:
            self.source.count("replay_limited", 1)
            self._refuse(peer, ident, b"error: too many requests; retry")
            return
        peer.tokens -= 1
        is_replay = len(body) == 2 and body[0] == b"" and len(body[1]) == 8
        is_dump = len(body) == 2 and body[0] == b"" and body[1] == b"dump"
        if not (is_replay or is_dump):
            self.source.count("bad_requests", 1)
            self._refuse(peer, ident, b"error: expected [b'', start_seq as 8 bytes "
                                      b"big-endian] or [b'', b'dump']")
            return
        if peer.job is not None:
            self.source.count("replay_limited", 1)
            self._refuse(peer, ident, b"error: an answer to this peer is under way")
            return
        if self.held >= self.budget:
            self.source.count("replay_refused", 1)
            self._refuse(peer, ident, b"error: replay busy; retry")
            return
        if is_replay:
            self.source.count("replays", 1)
            peer.job = _Job(end=self.source.seq, next=int.from_bytes(body[1], "big"))
            return
        if now - self._last_dump < DUMP_INTERVAL or self._dumps >= MAX_DUMPS:
            self.source.count("bad_requests", 1)
            self._refuse(peer, ident, b"error: one dump per second; retry")
            return
        self._last_dump = now
        self._dumps += 1
        self.source.count("dumps", 1)
        batches = self.source.snapshot()
        peer.job = _Job(end=len(batches), next=0, dump=batches,
                        dump_seq=wire.seq_bytes(self.source.seq - 1))

    def _peer(self, ident: bytes, now: float) -> _Peer | None:
        peer = self.peers.get(ident)
        if peer is not None:
            self.peers.move_to_end(ident)
            return peer
        if len(self.peers) >= MAX_PEERS:
            self._forget_idle(now, force=True)
            if len(self.peers) >= MAX_PEERS:
                return None
        peer = self.peers[ident] = _Peer(now)
        return peer

    def _forget_idle(self, now: float, force: bool = False) -> None:
        """Drop peers with nothing under way and nothing held: those idle past
        :data:`IDLE`, or (``force``: the table is full) the oldest such one."""
        for ident, p in list(self.peers.items()):
            if p.job is None and not p.held and (force or now - p.seen > IDLE):
                del self.peers[ident]
                if force:
                    return

    # ------------------------------------------------------------------ sending
    def pump(self) -> bool:
        """Free what ZMQ is done with and advance the answers under way: at most
        :data:`PUMP` messages, a peer that sent moving behind the others (no answer starves
        another); True when an answer could go on at once."""
        now = time.monotonic()
        self._sweep(self._anon)
        for p in self.peers.values():
            self._sweep(p)
        sent = 0
        for ident, p in list(self.peers.items()):
            job = p.job
            if job is None:
                continue
            if sent >= PUMP:
                return True
            waiting = False
            while sent < PUMP and p.job is job:
                if not self._step(ident, p, job):
                    waiting = p.job is job
                    break
                sent += 1
                job.progress_at = now
            self.peers.move_to_end(ident)
            if waiting and now - job.progress_at > STALL:
                self.source.count("replay_abandoned", 1)
                self._finish(p)
        self._forget_idle(now)
        return sent >= PUMP

    def _step(self, ident: bytes, p: _Peer, job: _Job) -> bool:
        """Send the job's next message (its end marker last, which finishes it); False if
        nothing could be sent: it waits for room."""
        src = self.source
        if job.dump is not None:
            if job.next >= job.end:
                return self._end(ident, p)
            if job.pending is None:
                job.pending = src.encode(job.dump[job.next])
                job.dump[job.next] = []  # its events are not needed again
            frames = [ident, b"", src.topic, job.dump_seq, job.pending]
            if not self._send(p, frames):
                return False
            job.pending = None
            job.next += 1
            return True
        buf = src.buffer
        if not buf or job.next >= job.end or buf[-1][0] < job.next:
            return self._end(ident, p)
        first = buf[0][0]
        seq, payload = buf[max(0, job.next - first)]
        if seq >= job.end:
            return self._end(ident, p)
        if not self._send(p, [ident, b"", src.topic, wire.seq_bytes(seq), payload]):
            return False
        job.next = seq + 1
        return True

    def _end(self, ident: bytes, p: _Peer) -> bool:
        if not self._send(p, [ident, b"", b"", wire.END_SEQ, b""]):
            return False
        self._finish(p)
        return True

    def _finish(self, p: _Peer) -> None:
        if p.job is not None and p.job.dump is not None:
            self._dumps -= 1
        p.job = None

    def _refuse(self, p: _Peer, ident: bytes, message: bytes) -> None:
        if not self._send(p, [ident, b"", b"", wire.END_SEQ, message],
                          ERROR_WINDOW if p is self._anon else None):
            self.source.count("replay_dropped", 1)

    def _send(self, p: _Peer, frames: list[bytes], window: int | None = None) -> bool:
        """Hand one reply to ZMQ if the peer's share and the budget have room (a message
        alone may exceed them); False to wait. A peer gone ends its answer."""
        n = len(frames[-1]) + OVERHEAD
        window = self.per_peer if window is None else window
        if p.held and p.held + n > window or self.held and self.held + n > self.budget:
            return False
        zmq = self.zmq
        try:
            for f in frames[:-1]:
                self.sock.send(f, zmq.SNDMORE | zmq.NOBLOCK)
            tracker = self.sock.send(frames[-1], zmq.NOBLOCK, copy=False, track=True)
        except zmq.Again:  # its queue is full (SNDHWM): later
            return False
        except zmq.ZMQError:  # gone (EHOSTUNREACH): its answer ends here
            self._finish(p)
            return False
        p.sent.append((tracker, n))
        p.held += n
        self.held += n
        self.peak = max(self.peak, self.held)
        return True

    def _sweep(self, p: _Peer) -> None:
        while p.sent and p.sent[0][0].done:
            _, n = p.sent.popleft()
            p.held -= n
            self.held -= n

    def stats(self) -> dict[str, int]:
        return {"replay_bytes_held": self.held, "replay_bytes_peak": self.peak,
                "replay_peers": len(self.peers)}

