"""The ZMQ side: one thread that turns queued tier events into batches, publishes them on a
PUB socket, keeps the last ``buffer_steps`` for replay and answers a ROUTER socket.

The data path only appends to a bounded queue (:meth:`EventPublisher.offer`: a length check
and a ``deque.append``, no lock, no I/O); past ``max_queue_size`` items a new one is dropped
and counted (``dropped``), and the tracker is later reconciled against the tiers
(``contains``) so a lost removal cannot leave a router believing in a block that is gone. A
subscriber that is slow or absent costs nothing here: PUB drops at its high-water mark, the
ROUTER drops replies to a peer that does not read (both ZMQ's own behaviour, never a block).

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
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from lmc.events import wire
from lmc.events.config import EventsConfig
from lmc.events.tracker import EVENTS_PER_BATCH, Tracker

log = logging.getLogger(__name__)
POLL_MS = 10
DUMP_INTERVAL = 1.0
COUNTERS = ("batches", "events", "dropped", "unknown", "untracked", "replays", "dumps",
            "bad_requests", "reconciles", "refused", "no_info", "other_block_size")

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


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """vLLM's rule: a tcp port goes up by the data-parallel rank (port 0 stays 0); an
    inproc name gets ``_dp<rank>``."""
    if not dp_rank:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port):
            return f"{base}:{int(port) + dp_rank}"
    return endpoint


def binds(endpoint: str) -> bool:
    """vLLM binds an endpoint with a wildcard host or a local transport, else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _connectable(endpoint: str) -> str:
    return endpoint.replace("//0.0.0.0:", "//127.0.0.1:")


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
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # a socket left open never holds term()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.rep = None
        try:
            ep = offset_endpoint(cfg.endpoint, cfg.dp_rank)
            (self.pub.bind if binds(ep) else self.pub.connect)(ep)
            self.endpoint = _connectable(self.pub.getsockopt_string(zmq.LAST_ENDPOINT) or ep)
            self.replay_endpoint: str | None = None
            if cfg.replay_endpoint:
                self.rep = self._ctx.socket(zmq.ROUTER)
                self.rep.setsockopt(zmq.MAXMSGSIZE, 64)
                self.rep.setsockopt(zmq.SNDHWM, cfg.buffer_steps + 16)
                self.rep.setsockopt(zmq.LINGER, 0)
                self.rep.bind(offset_endpoint(cfg.replay_endpoint, cfg.dp_rank))
                self.replay_endpoint = _connectable(
                    self.rep.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events: cannot open {cfg.endpoint} / {cfg.replay_endpoint}: "
                             f"{e}") from None
        self._last_dump = -DUMP_INTERVAL
        self.dump_clock = time.monotonic  # the dump limit's clock (a test moves its own)
        self._stop = threading.Event()
        self._send([wire.all_blocks_cleared()])
        self._thread = threading.Thread(target=self._run, name="lmc-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s (replay %s), topic %r", self.endpoint,
                 self.replay_endpoint or "off", topic)

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
        return {**self.counts, "queued": len(self._q), "seq": self.seq}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        if self.rep is not None:
            poller.register(self.rep, zmq.POLLIN)
        last_sent = time.monotonic()
        dropped_seen = warned_at = 0
        last_warned = float("-inf")
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(0 if self._q else POLL_MS))
                if self.rep is not None and ready.get(self.rep):
                    self._answer()
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
        self.buffer.append((seq, payload))
        # at the high-water mark PUB drops (as it does for slow SUBs); never waits
        with contextlib.suppress(self._zmq.Again):
            self.pub.send_multipart([self.topic, wire.seq_bytes(seq), payload],
                                    flags=self._zmq.NOBLOCK)
        self.counts["batches"] += 1
        self.counts["events"] += len(events)
        self._prom.labels("batches").inc()
        if events:
            self._prom.labels("events").inc(len(events))

    def _reply(self, frames: list[bytes]) -> None:
        assert self.rep is not None
        with contextlib.suppress(self._zmq.ZMQError):  # a peer gone or not reading: its loss
            self.rep.send_multipart(frames, flags=self._zmq.NOBLOCK)

    def _answer(self) -> None:
        assert self.rep is not None
        frames = self.rep.recv_multipart()
        ident = frames[0]
        body = frames[1:]
        end = [ident, b"", b"", wire.END_SEQ]
        if len(body) == 2 and body[0] == b"" and len(body[1]) == 8:
            start = int.from_bytes(body[1], "big")
            self.count("replays", 1)
            for seq, payload in list(self.buffer):
                if seq >= start:
                    self._reply([ident, b"", self.topic, wire.seq_bytes(seq), payload])
            self._reply(end + [b""])
            return
        if len(body) == 2 and body[0] == b"" and body[1] == b"dump":
            now = self.dump_clock()
            if now - self._last_dump < DUMP_INTERVAL:
                self.count("bad_requests", 1)
                self._reply(end + [b"error: one dump per second; retry"])
                return
            self._last_dump = now
            self.count("dumps", 1)
            last = wire.seq_bytes(self.seq - 1)
            batches = self.tracker.snapshot() if self.tracker is not None else \
                [[wire.all_blocks_cleared()]]
            for events in batches:
                self._reply([ident, b"", self.topic, last,
                             wire.encode_batch(events, self.cfg.dp_rank)])
            self._reply(end + [b""])
            return
        self.count("bad_requests", 1)
        self._reply(end + [b"error: expected [b'', start_seq as 8 bytes big-endian] or "
                           b"[b'', b'dump']"])

    # ------------------------------------------------------------------ closing
    def _close_sockets(self) -> None:
        self.pub.close(0)
        if self.rep is not None:
            self.rep.close(0)
        self._ctx.term()

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
