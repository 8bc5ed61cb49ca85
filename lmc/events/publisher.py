"""The ZMQ side: one thread that turns queued tier events into batches, publishes them on a
PUB socket, keeps the last ``buffer_steps`` for replay and answers a ROUTER socket.

The data path only appends to a bounded queue (:meth:`EventPublisher.offer`: a length check
and a ``deque.append``, no lock, no I/O); past ``max_queue_size`` items a new one is dropped
and counted (``dropped``), and the tracker is later reconciled against the tiers
(``contains``) so a lost removal cannot leave a router believing in a block that is gone.

What peers can make this process hold is bounded in bytes. The replay buffer keeps at most
``buffer_steps`` batches and ``buffer_max_bytes``. A batch goes to the PUB socket zero-copy
and tracked: ZMQ holds at most ``pub_max_bytes`` of batches for subscribers that have not
taken them yet (past it a batch is not sent on PUB, counted ``pub_dropped``: subscribers see
a gap and replay it), and ZMTP heartbeats drop a subscriber that stopped reading, which
frees what ZMQ held for it. Replies to the replay socket are bounded across all peers
together (``replay_max_bytes``, peers, requests per peer: :mod:`lmc.events.replay`).

Sequence numbers start at 0 with an ``AllBlocksCleared`` (a restarted publisher clears what
routers remember of it, then re-announces what survived) and go up by one per batch; an empty
batch goes out every ``heartbeat`` seconds while idle, so a subscriber notices a gap or a dead
publisher without waiting for the next store.

The replay socket speaks vLLM's protocol -- ``[b"", start_seq]`` is answered with every
buffered batch from ``start_seq`` on, then ``[b"", b"", END_SEQ, b""]`` -- and one request of
lmc's own, ``[b"", b"dump"]``: a full ``BlockStored`` replay of what every tier holds now
(``AllBlocksCleared`` first), each batch carrying the last published seq, so a router that
started late or missed more than the buffer applies the dump and then the PUB batches after
that seq. A dump is built at most once per second. Any other request gets the end marker
with ``error: ...`` as its payload (an answer, not a crash); requests are capped at 64 bytes
by the socket (``MAXMSGSIZE``), so a larger one disconnects its sender.

Endpoints follow vLLM's bind-or-connect rule, but unset ones bind on loopback and an
``ipc://`` path another live process listens at is refused (:mod:`lmc.events.endpoints`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from lmc.events import wire
from lmc.events.endpoints import IpcClaim, connectable, offset_endpoint
from lmc.events.events_config import EventsConfig
from lmc.events.replay import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS, ReplayServer
from lmc.events.tracker import EVENTS_PER_BATCH, Tracker

log = logging.getLogger(__name__)
POLL_MS = 10
COUNTERS = ("batches", "events", "dropped", "unknown", "untracked", "replays", "dumps",
            "bad_requests", "reconciles", "refused", "no_info", "other_block_size",
            "pub_dropped", "replay_refused", "replay_limited", "replay_abandoned",
            "replay_dropped")

_PROM: Any = None
_PROM_LOCK = threading.Lock()


def _prometheus() -> Any:
    """``lmc_kv_events{what}``, registered by the process's first publisher."""
    global _PROM
    with _PROM_LOCK:
        if _PROM is None:
            from prometheus_client import Counter
            _PROM = Counter("lmc_kv_events", "KV-event publisher figures: batches and events "
                            "published, items dropped at the queue bound, chunks not "
                            "published (unknown tokens, past max_chunks), replay and dump "
                            "requests, refused requests, reconciles", ["what"])
        return _PROM


class EventPublisher:
    """See the module docstring. ``tracker`` turns items into wire events; ``reconcile``
    (optional) re-checks the tracker against the tiers after items were dropped."""

    def __init__(self, cfg: EventsConfig, tracker: Tracker | None, topic: str, *,
                 reconcile: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        try:
            import zmq
        except ImportError:
            raise ValueError("kv_events needs pyzmq: pip install 'lmc-kvcache[events]' "
                             "(or pyzmq)") from None
        self.cfg = cfg
        self.tracker = tracker
        self.topic = topic.encode()
        self._reconcile = reconcile
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._prom = _prometheus()
        self._q: deque[tuple[Any, ...]] = deque()
        self._cap = cfg.max_queue_size
        self._lost = False
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self.buffer_bytes = 0
        self._pub_sent: deque[tuple[Any, int]] = deque()  # (tracker, bytes) ZMQ may hold
        self.pub_held = 0
        self.pub_peak = 0
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # a socket left open never holds term()
        self._claims: list[IpcClaim] = []
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.pub.copy_threshold = 0  # zero-copy means it (lmc.events.replay: tracked bytes)
        self.rep = None
        self.replay: ReplayServer | None = None
        self.replay_endpoint: str | None = None
        ep = offset_endpoint(cfg.pub_address, cfg.dp_rank)
        rep_ep = (None if cfg.replay_address is None
                  else offset_endpoint(cfg.replay_address, cfg.dp_rank))
        try:
            bind = cfg.pub_binds
            if bind:
                self._claims.append(IpcClaim(ep))
            (self.pub.bind if bind else self.pub.connect)(ep)
            self.endpoint = connectable(self.pub.getsockopt_string(zmq.LAST_ENDPOINT) or ep)
            if rep_ep is not None:
                self.rep = self._ctx.socket(zmq.ROUTER)
                ReplayServer.configure(zmq, self.rep)
                self._claims.append(IpcClaim(rep_ep))
                self.rep.bind(rep_ep)
                self.replay_endpoint = connectable(
                    self.rep.getsockopt_string(zmq.LAST_ENDPOINT))
                self.replay = ReplayServer(zmq, self.rep, self, cfg.replay_max_bytes)
        except (zmq.ZMQError, ValueError) as e:
            self._close_sockets()
            raise ValueError(f"kv_events: cannot open {ep} / {rep_ep or 'no replay'}: "
                             f"{e}") from None
        self._stop = threading.Event()
        self._send([wire.all_blocks_cleared()])
        self._thread = threading.Thread(target=self._run, name="lmc-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s (replay %s), topic %r%s", self.endpoint,
                 self.replay_endpoint or "off", topic, cfg.loopback_note())

    # ------------------------------------------------------------------ data path
    def offer(self, item: tuple[Any, ...]) -> None:
        """Queue one item for the publisher's thread; never blocks (see the module doc)."""
        if len(self._q) < self._cap:
            self._q.append(item)
        else:
            self.counts["dropped"] += 1
            self._lost = True

    def count(self, what: str, n: int) -> None:
        self.counts[what] += n
        self._prom.labels(what).inc(n)

    def stats(self) -> dict[str, int]:
        out = {**self.counts, "queued": len(self._q), "seq": self.seq,
               "buffer_bytes": self.buffer_bytes, "pub_bytes_held": self.pub_held,
               "pub_bytes_peak": self.pub_peak}
        if self.replay is not None:
            out.update(self.replay.stats())
        return out

    # ------------------------------------------------------------------ replay's source
    def snapshot(self) -> list[list[dict[str, Any]]]:
        """A state dump's batches (``AllBlocksCleared`` alone without a tracker)."""
        return self.tracker.snapshot() if self.tracker is not None else \
            [[wire.all_blocks_cleared()]]

    def encode(self, events: list[dict[str, Any]]) -> bytes:
        return wire.encode_batch(events, self.cfg.dp_rank)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        if self.rep is not None:
            poller.register(self.rep, zmq.POLLIN)
        last_sent = time.monotonic()
        dropped_seen = warned_at = 0
        last_warned = float("-inf")
        more = False
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(0 if self._q or more else POLL_MS))
                self._sweep_pub()
                if self.replay is not None:
                    if ready.get(self.rep):
                        self.replay.on_readable()
                    more = self.replay.pump()
                events = self._drain()
                if self._lost and self.tracker is not None and self._reconcile is not None:
                    self._lost = False
                    self.count("reconciles", 1)
                    events += self._reconcile()
                now = time.monotonic()
                if self.counts["dropped"] != dropped_seen:
                    self._prom.labels("dropped").inc(self.counts["dropped"] - dropped_seen)
                    dropped_seen = self.counts["dropped"]
                    if now - last_warned >= 10.0:  # one line per 10 s, with the total since
                        log.warning("KV events: %d items dropped (queue full at %d); routers "
                                    "may under-count this instance's cache until it is "
                                    "reconciled", dropped_seen - warned_at, self._cap)
                        last_warned, warned_at = now, dropped_seen
                for i in range(0, len(events), EVENTS_PER_BATCH):
                    self._send(events[i:i + EVENTS_PER_BATCH])
                    last_sent = now
                if now - last_sent >= self.cfg.heartbeat:
                    self._send([])
                    last_sent = now
            except Exception as e:  # one bad item must not end publishing
                log.warning("KV events: %s: %s", type(e).__name__, str(e)[:200])

    def _drain(self, limit: int = 4096) -> list[dict[str, Any]]:
        """Wire events of queued items: at most one queue's worth of items and about one
        batch of events, so what waits here is bounded as the queue is (the data path keeps
        adding while this runs)."""
        out: list[dict[str, Any]] = []
        t = self.tracker
        for _ in range(min(limit, self._cap)):
            if len(out) >= EVENTS_PER_BATCH:
                break
            try:
                item = self._q.popleft()
            except IndexError:
                break
            time.sleep(0)  # let the engine's threads have the GIL between items
            op = item[0]
            if op == "raw":
                out += item[1]
            elif t is None:
                continue
            elif op == "note":
                t.note(item[1], item[2])
            elif op == "note_keys":  # (tokens, keys, chunk_size, tokens considered)
                _, toks, keys, cs, n = item
                t.note(toks, [(i * cs, min(i * cs + cs, n), k) for i, k in enumerate(keys)])
            elif op == "info":  # (key, a callable making its ChunkInfo): the daemon's
                t.add(item[1], item[2]())
            elif op == "stored":
                out += t.stored(item[1], item[2])
            elif op == "removed":
                out += t.removed(item[1], item[2])
            elif op == "cleared":
                out += t.cleared(item[1])
        return out

    def _send(self, events: list[dict[str, Any]]) -> None:
        payload = wire.encode_batch(events, self.cfg.dp_rank)
        seq = self.seq
        self.seq += 1
        self._keep(seq, payload)
        self._publish(seq, payload)
        self.counts["batches"] += 1
        self.counts["events"] += len(events)
        self._prom.labels("batches").inc()
        if events:
            self._prom.labels("events").inc(len(events))

    def _keep(self, seq: int, payload: bytes) -> None:
        """Into the replay buffer, the oldest batches going past ``buffer_steps`` batches
        or ``buffer_max_bytes`` (the newest always stays)."""
        buf = self.buffer
        if len(buf) == buf.maxlen:
            self.buffer_bytes -= len(buf[0][1])
        buf.append((seq, payload))
        self.buffer_bytes += len(payload)
        while self.buffer_bytes > self.cfg.buffer_max_bytes and len(buf) > 1:
            self.buffer_bytes -= len(buf.popleft()[1])

    def _publish(self, seq: int, payload: bytes) -> None:
        """On PUB, zero-copy and tracked (the payload is the buffer's own bytes), while what
        ZMQ holds for subscribers is within ``pub_max_bytes``; at ZMQ's high-water mark PUB
        drops for that subscriber itself (as for any slow SUB): never a wait."""
        self._sweep_pub()
        n = len(payload) + 256
        if self.pub_held and self.pub_held + n > self.cfg.pub_max_bytes:
            self.count("pub_dropped", 1)
            return
        zmq = self._zmq
        try:
            self.pub.send_multipart([self.topic, wire.seq_bytes(seq)], flags=zmq.SNDMORE)
            tracker = self.pub.send(payload, zmq.NOBLOCK, copy=False, track=True)
        except zmq.Again:
            return
        self._pub_sent.append((tracker, n))
        self.pub_held += n
        self.pub_peak = max(self.pub_peak, self.pub_held)

    def _sweep_pub(self) -> None:
        sent = self._pub_sent
        while sent and sent[0][0].done:
            self.pub_held -= sent.popleft()[1]

    # ------------------------------------------------------------------ closing
    def _close_sockets(self) -> None:
        self.pub.close(0)
        if self.rep is not None:
            self.rep.close(0)
        self._ctx.term()
        for claim in self._claims:  # after the sockets: their paths are free now
            claim.release()

    def close(self) -> None:
        """Publish what is queued (bounded by one drain), then close the sockets."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        try:
            for _ in range(64):  # what is queued, within bounds
                events = self._drain()
                if not events and not self._q:
                    break
                for i in range(0, len(events), EVENTS_PER_BATCH):
                    self._send(events[i:i + EVENTS_PER_BATCH])
        except Exception as e:
            log.warning("KV events: last batch not sent: %s", e)
        self._close_sockets()
