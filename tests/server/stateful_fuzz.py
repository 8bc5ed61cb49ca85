"""A seeded, stateful driver for a live daemon: many connections at once, each a small state
machine (connected, authenticated, half-way through a frame, silent), interleaving valid and
invalid operations across tenants, namespaces and quotas.

Why a driver rather than single malformed frames: the daemon's bugs live between frames
(a session left in a state nothing times out, a reference kept after a refused request, a
namespace ledger never given back). Each actor remembers what it has sent, so every answer
is checked against what it must be, and the value model is content-addressed: the bytes for
(namespace, key) are a pure function of both, so any GET hit must return exactly them,
whatever was evicted, deleted or refused in between, and a value seen under another
namespace's bytes is caught.

One seed determines every actor's choices (``random.Random(seed)`` per driver thread); the
interleaving of several driver threads is left to the scheduler on purpose.
Threat model: docs/threats/daemon.md."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import socket
import time
from typing import Any

from lmc.storage.backends.server import protocol as P
from tests.server import wire as W

KEYSPACE = 48


def key_of(i: int) -> bytes:
    return bytes([0xA5, i]) * 8


def size_of(key: bytes) -> int:
    """Tokens of the value stored under ``key``: 8..128 (2 KiB..32 KiB with width 64)."""
    return 8 * (1 + key[1] % 16)


def value_of(ns: str, key: bytes) -> tuple[bytes, bytes]:
    return W.value_bytes(ns, key, tokens=size_of(key), width=64)


@dataclasses.dataclass
class Tenant:
    name: str
    secret: str | None            # None: connects with a wrong token
    namespaces: tuple[str, ...]   # what it may use; admin: every namespace in ``ALL_NS``
    admin: bool = False


@dataclasses.dataclass
class Counts:
    steps: int = 0
    hits: int = 0
    stored: int = 0
    refused: int = 0
    dropped_half: int = 0
    silent_dropped: int = 0
    reconnects: int = 0
    by_action: dict[str, int] = dataclasses.field(default_factory=dict)


class Violation(AssertionError):
    pass


class Actor:
    """One connection's life: closed -> fresh -> ready (-> half | silent) -> closed; beside
    it, slow readers (``slow``): connections whose answers it never reads."""

    def __init__(self, driver: Driver, tenant: Tenant, idx: int) -> None:
        self.d = driver
        self.tenant = tenant
        self.idx = idx
        self.c: W.RawClient | None = None
        self.state = "closed"
        self.since = 0.0
        self.rest = b""           # the unsent part of a half frame
        self.expect: Any = None   # how to check the answer of that frame
        self.slow: list[tuple[socket.socket, float]] = []  # slow readers, hang-up time
        self.rid = 0

    def fail(self, msg: str) -> None:
        raise Violation(f"seed {self.d.seed} step {self.d.counts.steps} actor {self.idx} "
                        f"({self.tenant.name}, {self.state}): {msg}")

    # ------------------------------------------------------------ plumbing
    def connect(self) -> None:
        self.c = W.RawClient(self.d.port, timeout=15)
        self.state, self.since = "fresh", time.monotonic()
        self.d.counts.reconnects += 1

    def close(self) -> None:
        if self.c is not None:
            self.c.close()
        self.c, self.state, self.rest = None, "closed", b""
        self.hang_up_slow(0.0, every=True)

    def call(self, data: bytes) -> tuple[int, dict, bytes] | None:
        assert self.c is not None
        if not self.c.send(data):
            return None
        return self.c.answer()

    def must(self, data: bytes) -> tuple[int, dict, bytes]:
        got = self.call(data)
        if got is None:
            self.fail("connection closed instead of an answer")
        return got

    def next_id(self) -> int:
        self.rid += 1
        return self.rid

    # ----------------------------------------------------------- requests
    def pick_ns(self, rng: random.Random) -> tuple[str, bool]:
        """A namespace and whether this actor's token grants it."""
        if self.tenant.admin:
            return rng.choice(self.d.all_ns), True
        if rng.random() < 0.15:
            other = rng.choice([n for n in self.d.all_ns if n not in self.tenant.namespaces])
            return other, False
        return rng.choice(self.tenant.namespaces), True

    def pick_keys(self, rng: random.Random, lo: int = 1, hi: int = 8) -> list[bytes]:
        return [key_of(rng.randrange(KEYSPACE)) for _ in range(rng.randint(lo, hi))]

    def build(self, rng: random.Random, small: bool = False) -> tuple[bytes, Any]:
        """A valid (or deliberately wrong) request and what its answer must be; ``small``:
        no PUT (pipelined requests must not fill both socket buffers: the daemon answers
        in order and stops reading while an answer is unread)."""
        ns, ok = self.pick_ns(rng)
        kinds = ["put", "get", "exists", "delete", "stats", "ping", "bad"]
        weights = [0 if small else 30, 30, 10, 6, 3, 3, 8]
        kind = rng.choices(kinds, weights)[0]
        rid = self.next_id()
        if kind == "bad":  # in a granted namespace: forbidden is checked before the rest
            ns = rng.choice(self.d.all_ns if self.tenant.admin else self.tenant.namespaces)
        if kind == "put":
            keys = self.pick_keys(rng)
            vals, corrupt = [], []
            for k in keys:
                hdr, payload = value_of(ns, k)
                bad = rng.random() < 0.1
                if bad:
                    i = rng.randrange(len(payload))
                    payload = payload[:i] + bytes([payload[i] ^ 0x40]) + payload[i + 1:]
                vals.append((hdr, payload))
                corrupt.append(bad)
            return W.put(ns, vals, rid), ("put", ns, ok, corrupt)
        if kind in ("get", "exists", "delete"):
            keys = self.pick_keys(rng, 1, 12)
            meta: dict[str, Any] = {"ns": ns, "keys": keys}
            if kind != "delete" and rng.random() < 0.3:
                meta["prefix"] = True
            op = {"get": P.GET, "exists": P.EXISTS, "delete": P.DELETE}[kind]
            return W.frame(op, meta, req_id=rid), (kind, ns, ok, keys, meta.get("prefix", False))
        if kind == "stats":
            return W.frame(P.STATS, {}, req_id=rid), ("stats",)
        if kind == "ping":
            return W.frame(P.PING, {}, req_id=rid), ("ping",)
        bad = rng.choice([
            (W.frame(P.GET, {"ns": ns, "keys": [b"short"]}, req_id=rid), P.BAD_REQUEST),
            (W.frame(P.EXISTS, {"ns": 7, "keys": []}, req_id=rid), P.BAD_REQUEST),
            (W.frame(P.PUT, {"ns": ns, "items": [b"\0" * 72]}, b"\0" * 64, rid), P.BAD_REQUEST),
            (W.frame(0x44, {}, req_id=rid), P.UNKNOWN_OP),
            (P.pack_header(P.DELETE, rid, 3) + b"\xc1\xc1\xc1", P.BAD_REQUEST),
        ])
        return bad[0], ("bad", bad[1])

    def check(self, expect: Any, got: tuple[int, dict, bytes]) -> None:
        status, meta, payload = got
        kind = expect[0]
        if kind == "bad":
            if status != expect[1]:
                self.fail(f"bad request answered {status}, expected {expect[1]}")
            return
        if kind in ("ping", "stats"):
            if status != P.OK:
                self.fail(f"{kind} answered {status}: {meta}")
            if kind == "stats" and not self.tenant.admin:
                extra = set(meta.get("namespaces", {})) - set(self.tenant.namespaces)
                if extra:
                    self.fail(f"STATS showed another tenant's namespaces {sorted(extra)}")
            return
        ns, ok = expect[1], expect[2]
        if not ok:
            if status != P.FORBIDDEN:
                self.fail(f"{kind} into ungranted namespace {ns!r} answered {status}")
            self.d.counts.refused += 1
            return
        if status != P.OK:
            self.fail(f"{kind} in {ns!r} answered {status}: {meta}")
        if kind == "put":
            res = meta["results"]
            if len(res) != len(expect[3]):
                self.fail("PUT results of the wrong length")
            for r, corrupt in zip(res, expect[3]):
                if corrupt and r not in (P.BAD_CHECKSUM, P.OVER_QUOTA, P.NO_MEMORY):
                    self.fail(f"a corrupted value was answered {r}")  # refused before read
                if not corrupt and r not in (P.STORED, P.OVER_QUOTA, P.NO_MEMORY):
                    self.fail(f"a good value was answered {r}")
            self.d.counts.stored += sum(r == P.STORED for r in res)
        elif kind == "get":
            keys = expect[3]
            try:
                hdrs = P.get_value_headers(meta, keys, len(payload))
            except P.ProtocolError as e:
                self.fail(f"GET answer malformed: {e}")
            pos = 0
            for i, (k, h) in enumerate(zip(keys, hdrs)):
                if h is None:
                    if expect[4]:
                        self.fail("a prefix GET answered a miss inside its prefix")
                    continue
                got_bytes = payload[pos:pos + h.payload_len]
                pos += h.payload_len
                if got_bytes != value_of(ns, k)[1]:
                    self.fail(f"GET {ns!r} key #{i} returned bytes that were never PUT there")
                self.d.counts.hits += 1
            self.d.used_ns.add(ns)
        elif kind == "exists":
            if expect[4]:
                if not 0 <= meta.get("hits", -1) <= len(expect[3]):
                    self.fail("EXISTS prefix hits out of range")
            elif len(meta.get("present", b"")) != len(expect[3]):
                self.fail("EXISTS answer of the wrong length")
        elif kind == "delete" and not 0 <= meta.get("deleted", -1) <= len(expect[3]):
            self.fail("DELETE count out of range")
        if kind == "put":
            self.d.used_ns.add(ns)

    # --------------------------------------------------------------- steps
    def step(self, rng: random.Random) -> str:
        d = self.d
        now = time.monotonic()
        if self.state == "closed":
            self.connect()
            return "connect"
        if self.state == "silent":
            if now - self.since < d.drop_after:
                time.sleep(0.001)
                return "wait"
            assert self.c is not None
            if not self.c.at_eof(d.drop_after):
                self.fail("a silent connection was never dropped")
            d.counts.silent_dropped += 1
            self.close()
            return "silent_checked"
        if self.state == "fresh":
            r = rng.random()
            if r < 0.08:  # never authenticates: the daemon must close it
                self.state, self.since = "silent", now
                return "go_silent_unauthenticated"
            if r < 0.14 or self.tenant.secret is None:
                token = rng.choice(["wrong-token", ""]) if self.tenant.secret else "nope"
                got = self.call(W.hello(token))
                if got is not None and got[0] != P.AUTH_FAILED:
                    self.fail(f"a wrong token was answered {got[0]}")
                if not self.c.at_eof(5):
                    self.fail("a failed HELLO left the connection open")
                self.close()
                return "hello_wrong"
            got = self.call(W.hello(self.tenant.secret, f"fuzz-{self.idx}"))
            if got is None:  # displaced or timed out before its HELLO: allowed when fresh
                self.close()
                return "hello_displaced"
            if got[0] != P.OK:
                self.fail(f"a good HELLO answered {got[0]}: {got[1]}")
            self.state = "ready"
            return "hello"
        if self.state == "half":
            assert self.c is not None
            late = now - self.since > d.frame_timeout * 0.5
            r = rng.random()
            if r < 0.15:
                self.state, self.since = "silent", now
                return "abandon_half"
            if r < 0.25:
                self.close()  # hangs up mid-frame
                return "hangup_half"
            got = self.call(self.rest)
            if got is None:
                if not late:
                    self.fail("a frame resumed in time was dropped")
                d.counts.dropped_half += 1
                self.close()
                return "half_dropped"
            self.rest, self.state = b"", "ready"
            self.check(self.expect, got)
            return "finish_half"
        self.hang_up_slow(now)
        # ready
        r = rng.random()
        if r < 0.03:
            self.close()
            return "close"
        if r < 0.05:  # a fatal frame: answered, then closed
            got = self.must(b"XXXX" + W.frame(P.PING, {})[4:])
            if got[0] != P.BAD_FRAME or not self.c.at_eof(5):
                self.fail("a frame with a bad magic did not close the connection")
            self.close()
            return "fatal"
        if r < 0.13:  # half a request now, the rest (maybe) later
            data, expect = self.build(rng)
            cut = rng.randrange(1, len(data))
            if not self.c.send(data[:cut]):
                self.fail("the daemon closed an idle authenticated connection")
            self.rest, self.expect = data[cut:], expect
            self.state, self.since = "half", now
            return "send_half"
        if r < 0.23:  # pipelined
            reqs = [self.build(rng, small=True) for _ in range(rng.randint(2, 4))]
            if not self.c.send(b"".join(data for data, _ in reqs)):
                self.fail("the daemon closed an idle authenticated connection")
            for _, expect in reqs:
                got = self.c.answer()
                if got is None:
                    self.fail("connection closed during pipelined requests")
                self.check(expect, got)
            return "pipeline"
        if r < 0.25 and len(self.slow) < 2 and self.tenant.secret is not None:
            return self.start_slow_reader(rng, now)
        data, expect = self.build(rng)
        self.check(expect, self.must(data))
        return expect[0]

    def start_slow_reader(self, rng: random.Random, now: float) -> str:
        """A second connection of this tenant, with a tiny receive window, that pipelines
        HELLO and several large GETs and never reads: the daemon's replies stall in its
        socket and hold pool memory (charged to the namespace) until the daemon drops it
        (no progress for frame_timeout) or the actor hangs up."""
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(15)
        s.connect(("127.0.0.1", self.d.port))
        ns = rng.choice(self.d.all_ns if self.tenant.admin else self.tenant.namespaces)
        frames = [W.hello(self.tenant.secret, f"slow-{self.idx}")]
        for _ in range(rng.randint(3, 8)):
            keys = [key_of(i) for i in rng.sample(range(KEYSPACE), 16)]
            frames.append(W.frame(P.GET, {"ns": ns, "keys": keys}, req_id=self.next_id()))
        with contextlib.suppress(OSError):  # the daemon may stop reading us: that is the point
            s.setblocking(False)
            s.send(b"".join(frames))
        self.slow.append((s, now + rng.uniform(0, 2 * self.d.frame_timeout)))
        return "slow_reader"

    def hang_up_slow(self, now: float, every: bool = False) -> None:
        keep = []
        for s, until in self.slow:
            if every or now >= until:
                s.close()
            else:
                keep.append((s, until))
        self.slow = keep


class Driver:
    """Runs ``actors`` over one daemon for ``seconds`` (one RNG per driver thread)."""

    def __init__(self, seed: int, port: int, tenants: list[Tenant], all_ns: list[str],
                 actors: int, frame_timeout: float, hello_timeout: float) -> None:
        self.seed = seed
        self.port = port
        self.all_ns = all_ns
        self.frame_timeout = frame_timeout
        self.drop_after = max(frame_timeout, hello_timeout) + 2.0
        self.counts = Counts()
        self.used_ns: set[str] = set()
        self.actors = [Actor(self, tenants[i % len(tenants)], i) for i in range(actors)]

    def run(self, seconds: float) -> Counts:
        rng = random.Random(self.seed)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                if rng.random() < 0.005:
                    self.burst(rng)
                    self.counts.by_action["burst"] = self.counts.by_action.get("burst", 0) + 1
                    continue
                actor = rng.choice(self.actors)
                what = actor.step(rng)
                self.counts.steps += 1
                self.counts.by_action[what] = self.counts.by_action.get(what, 0) + 1
        finally:
            for a in self.actors:
                a.close()
        return self.counts

    def burst(self, rng: random.Random) -> None:
        """Many short-lived connections at once: some say nothing, some half a header,
        some garbage; all hang up."""
        socks = []
        try:
            for _ in range(rng.randint(10, 40)):
                s = socket.create_connection(("127.0.0.1", self.port), timeout=15)
                socks.append(s)
                r = rng.random()
                with contextlib.suppress(OSError):
                    if r < 0.3:
                        s.sendall(W.hello("x")[: rng.randint(1, 23)])
                    elif r < 0.5:
                        s.sendall(rng.randbytes(rng.randint(1, 64)))
        finally:
            for s in socks:
                s.close()
