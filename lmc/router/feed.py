"""The router's subscriptions: one SUB socket per instance, in order, gaps filled.

Each instance's batches are applied in sequence order to its :class:`PrefixIndex`. A source
is *synced* once the router knows its whole state: at start (and after any loss it cannot
fill) it asks the replay socket for a dump (``[b"", b"dump"]``, lmc's publisher) and applies
the PUB batches after the dump's seq. A gap (a seq past the next expected, or a batch that
does not decode) is filled by vLLM's replay request (``[b"", next_seq]``); if the buffer no
longer holds it, a dump. A source without a replay socket (a plain vLLM left at its
defaults) is taken from its first batch on, best effort.

A source is *fresh* while synced and heard from (a batch or a heartbeat) within
``stale_after`` seconds; the router scores only fresh sources (``lmc.router.app``).

A publisher that restarts starts again at seq 0 (with ``AllBlocksCleared``); PUB delivers
one publisher's batches in order, so a PUB batch numbered at or below the last one received
can only come from a restarted publisher: the source is synced again from its dump into a
fresh index (block size included: a publisher restarted with another block size is indexed
at its new one; Dynamo 1.6.1 drops those batches as old until it is registered again).

A *shared* source (:class:`SharedSource`, ``lmc router --shared-events``) is a store several
instances read from, an ``lmc server`` daemon with ``kv_events`` on: its blocks count as
cached for every instance that uses it (:func:`match_instance`), each medium weighted as an
instance's own. Its events carry the daemon namespace as ``cache_salt``, so its blocks are
matched with the prompt keyed under that salt.

Bounds: a message is at most 64 MiB (``MAXMSGSIZE``: a larger one disconnects the
publisher), each SUB queues at most 1,000 messages (then ZMQ drops: a gap, filled by replay),
a replay or dump is read for at most ``REPLAY_TIMEOUT`` seconds and ``MAX_REPLAY`` batches
(:mod:`lmc.router.sync`: applied as they come, into an index bounded as the live one), and
at most 1,000 batches / 64 MiB per source wait for a request under way; a failed request is
retried ``RETRY`` seconds later at the earliest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmc.ratelog import RateLimitedWarnings
from lmc.router.index import Match, PrefixIndex, block_keys, match_union, root_key
from lmc.router.sync import MAX_MESSAGE, SourceSync

# a restart its seq showed covers the reconnection that comes with it for this long: the
# connection's event, queued on another socket, may be taken after the batches
COVERED_S = 10.0

log = logging.getLogger(__name__)
_warn = RateLimitedWarnings(limit=10, window=10.0, logger=log)


class Source:
    """One instance's event stream and what the router knows from it."""

    def __init__(self, name: str, endpoint: str, replay_endpoint: str | None,
                 max_blocks: int) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = PrefixIndex(max_blocks)
        self.next_seq: int | None = None
        self.last_pub: int | None = None  # seq of the last PUB batch received
        self.synced = False
        self.last_heard = 0.0
        self.counts = {"batches": 0, "gaps": 0, "replays": 0, "dumps": 0, "bad": 0,
                       "restarts": 0, "reconnects": 0}

    def fresh(self, stale_after: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.synced and now - self.last_heard < stale_after


DEFAULT_NAMESPACE = "lmc"
"""The ``lmc://`` tier's default namespace (``remote_key_prefix``)."""
MAX_SHARED_INSTANCES = 1024


@dataclass(frozen=True)
class SharedSpec:
    """``ENDPOINT[,replay=ENDPOINT][,namespace=NS][,instances=URL|URL...]``: a shared store's
    events, the namespace its users' ``lmc://`` tier writes (``?ns=``; default ``lmc``) and
    the instances that use it (default: every instance)."""

    endpoint: str
    replay: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    instances: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, text: str) -> SharedSpec:
        ep, *opts = text.split(",")
        form = ("expected ENDPOINT[,replay=ENDPOINT][,namespace=NS][,instances=URL|URL], "
                f"got {text[:200]!r}")
        if not ep.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--shared-events: {ep[:80]!r} is not a tcp:// or ipc:// "
                             f"endpoint; {form}")
        kw: dict[str, str] = {}
        for o in opts:
            k, eq, v = o.partition("=")
            if not eq or k not in ("replay", "namespace", "instances") or k in kw:
                raise ValueError(f"--shared-events: {o[:60]!r}: {form}")
            kw[k] = v
        replay = kw.get("replay")
        if replay is not None and not replay.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--shared-events: replay={replay[:80]!r} is not a tcp:// or "
                             "ipc:// endpoint")
        ns = kw.get("namespace", DEFAULT_NAMESPACE)
        if len(ns.encode()) > 64:
            raise ValueError("--shared-events: namespace= is longer than 64 bytes")
        insts = None
        if "instances" in kw:
            insts = tuple(u.rstrip("/") for u in kw["instances"].split("|") if u)
            if not insts or len(insts) > MAX_SHARED_INSTANCES:
                raise ValueError(f"--shared-events: instances= must name 1 to "
                                 f"{MAX_SHARED_INSTANCES} instance URLs")
        return cls(ep, replay, ns, insts)


class SharedSource(Source):
    """A shared store's events (see the module docstring)."""

    def __init__(self, spec: SharedSpec, max_blocks: int) -> None:
        super().__init__(f"shared:{spec.endpoint}", spec.endpoint, spec.replay, max_blocks)
        self.namespace = spec.namespace
        self.instances = None if spec.instances is None else frozenset(spec.instances)

    def serves(self, url: str) -> bool:
        return self.instances is None or url.rstrip("/") in self.instances


class SaltedKeys:
    """A prompt's block keys per (salt, block size), each computed once per request."""

    def __init__(self, tokens: Sequence[int], lora_name: str | None = None,
                 cache_salt: str | None = None) -> None:
        self.tokens = tokens
        self.lora_name = lora_name
        self.cache_salt = cache_salt  # the request's own (an instance's own events)
        self._keys: dict[tuple[str | None, int], list[int]] = {}

    def at(self, block_size: int, salt: str | None = None) -> list[int]:
        k = (salt, block_size)
        out = self._keys.get(k)
        if out is None:
            out = self._keys[k] = block_keys(self.tokens, block_size,
                                             root_key(self.lora_name, salt))
        return out


def match_instance(url: str, own: Source | None, shared: Sequence[SharedSource],
                   keys: SaltedKeys, stale_after: float, now: float | None = None
                   ) -> Match | None:
    """The prompt's cached prefix for instance ``url``: its own fresh events and those of
    every fresh shared source it uses, block by block (a prefix may start in the
    instance's GPU and go on in the shared store). None when none of them is fresh (the
    policy then credits nothing). Sources of another block size than the largest group's
    are left out (counted by nobody: a deployment has one block size)."""
    now = time.monotonic() if now is None else now
    parts: list[tuple[PrefixIndex, list[int]]] = []
    fresh = False
    if own is not None and own.fresh(stale_after, now):
        fresh = True
        if own.index.block_size:
            parts.append((own.index, keys.at(own.index.block_size, keys.cache_salt)))
    for s in shared:
        if s.serves(url) and s.fresh(stale_after, now):
            fresh = True
            if s.index.block_size:
                parts.append((s.index, keys.at(s.index.block_size, s.namespace)))
    if not fresh:
        return None
    if not parts:
        return Match()
    sizes = [p[0].block_size for p in parts]
    bs = max(set(sizes), key=sizes.count)
    return match_union([p for p in parts if p[0].block_size == bs])


class EventFeed:
    """The thread that keeps every :class:`Source` current (see the module docstring): one
    poll over every SUB socket and every replay request under way; no source waits on
    another (:mod:`lmc.router.sync`)."""

    def __init__(self, sources: Sequence[Source], stale_after: float = 10.0) -> None:
        try:
            import zmq
        except ImportError:
            raise ValueError("subscribing to events= needs pyzmq: pip install "
                             "'lmc-kvcache[events]' (or pyzmq)") from None
        self.zmq = zmq
        self.sources = list(sources)
        self.stale_after = stale_after
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # a socket left open never holds term()
        self._subs: dict[Any, Source] = {}
        self._mons: dict[Any, Source] = {}
        self._lost: set[int] = set()  # sources whose connection dropped since
        self._connected: set[int] = set()  # sources whose SUB has had a connection
        self._covered: dict[int, float] = {}  # a restart's sync, asked until then
        self.syncs = {id(s): SourceSync(s, zmq, self.ctx) for s in self.sources}
        for s in self.sources:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            sock.setsockopt(zmq.RCVHWM, 1000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            # a reconnection may be a restart whose first batches (seq 0's AllBlocksCleared
            # among them) went out before this socket was back: it syncs anew
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED
                                          | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._mons[mon] = s
            sock.connect(s.endpoint)
            self._subs[sock] = s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmc-router-events",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def on_message(self, s: Source, frames: list[bytes]) -> None:
        """One PUB message of ``s`` (also the tests' way in)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            s.counts["bad"] += 1
            _warn("events from %s: a message of %d frames, not [topic, seq, payload]",
                  s.name, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        now = time.monotonic()
        s.last_heard = now
        sync = self.syncs[id(s)]
        if s.last_pub is not None and seq <= s.last_pub:
            s.counts["restarts"] += 1
            log.info("events from %s: the publisher restarted (seq %d after %d); syncing "
                     "anew", s.name, seq, s.last_pub)
            self._lost.discard(id(s))  # the sync its reconnection would ask for: this one
            self._covered[id(s)] = now + COVERED_S
            if s.replay_endpoint is None:  # no replay socket: from here on
                s.next_seq = seq
            else:
                sync.restarted(now)
        s.last_pub = seq
        sync.on_batch(seq, frames[2], now)

    def step(self, timeout_ms: int = 200) -> None:
        """One round of the loop: wait up to ``timeout_ms`` for any socket, take what came,
        time out and retry replay requests (the thread's body; tests drive it directly)."""
        zmq = self.zmq
        poller = zmq.Poller()
        for sock in (*self._subs, *self._mons):
            poller.register(sock, zmq.POLLIN)
        asking = {}
        for sync in self.syncs.values():
            if sync.request is not None and sync.sock is not None:
                poller.register(sync.sock, zmq.POLLIN)
                asking[sync.sock] = sync
        ready = dict(poller.poll(timeout_ms))
        # connection events first: a reconnection's sync is asked before the batches that
        # came over the new connection are taken, so they are not seen as a second restart
        for sock in sorted(ready, key=lambda k: k not in self._mons):
            if sock in asking:
                asking[sock].on_readable(time.monotonic())
                continue
            if sock in self._mons:
                self._on_monitor(sock)
                continue
            s = self._subs[sock]
            for _ in range(256):
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.on_message(s, frames)
        now = time.monotonic()
        for sync in self.syncs.values():
            sync.check(now)

    def _on_monitor(self, mon: Any) -> None:
        """A SUB connection dropped or came back: back after a drop, the publisher may
        have restarted and sent its first batches (seq 0's ``AllBlocksCleared`` among them)
        to nobody, and its next seq may lie past the last one seen -- a restart the seq
        alone cannot show. A source with a replay socket syncs anew."""
        from zmq.utils.monitor import recv_monitor_message

        s = self._mons[mon]
        for _ in range(64):  # what is queued (a drop and its reconnection come together)
            try:
                event = recv_monitor_message(mon, flags=self.zmq.NOBLOCK)["event"]
            except self.zmq.Again:
                return
            self.on_connection(s, connected=event != self.zmq.EVENT_DISCONNECTED)

    def on_connection(self, s: Source, connected: bool) -> None:
        """``s``'s SUB connection dropped, or is up (also the tests' way in). A connection
        after the first is a reconnection even when its drop went unseen (the feed once
        kept a restarted publisher's stale index for a minute: no drop noted, the new
        one's first batches lost, its next seq the old one's next); one that follows a
        restart its seq showed (a sync already asked) is not."""
        key = id(s)
        if not connected:
            self._lost.add(key)
            return
        again = key in self._connected or key in self._lost
        self._connected.add(key)
        self._lost.discard(key)
        covered = self._covered.pop(key, 0.0) > time.monotonic()
        if again and not covered and s.replay_endpoint is not None \
                and (s.last_pub is not None or s.synced):
            log.info("events from %s: reconnected; syncing anew", s.name)
            s.counts["reconnects"] += 1
            # the batches from here on may be a restarted publisher's, numbered from 0
            # again: not a restart of their own once this sync is asked
            s.last_pub = None
            self.syncs[key].restarted(time.monotonic())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as e:  # a source's garbage must not end the feed
                _warn("events: %s: %s", type(e).__name__, str(e)[:200])

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for sync in self.syncs.values():
            sync.close()
        for sock in self._subs:
            sock.disable_monitor()
            sock.close(0)
        for mon in self._mons:
            mon.close(0)
        self.ctx.term()
