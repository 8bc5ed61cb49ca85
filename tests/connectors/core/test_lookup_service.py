"""The cross-process lookup service (engine-neutral, no engine needed): typed answers over
the socket, minimum over ranks, timeouts and broken or malformed peers count as misses
quickly (never a hang), and every wire field is bounded and checked."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from lmc.connectors.core.lookup_service import (
    LOCAL_ENGINES,
    MAX_NAME,
    LookupClient,
    LookupServer,
    encode_answer,
    encode_request,
    socket_path,
)
from lmc.storage.lookup import LookupResult
from tests import lookup_sockets
from tests.deadlines import AT_ONCE_S, HANG_S, SLACK_S
from tests.lookup_sockets import send_and_expect_close

CS = 16
sock_dir = lookup_sockets.sock_dir  # the fixture
TIERS = ("cpu", "disk")


def answer(hit: int, l1: int) -> LookupResult:
    """``hit`` tokens, chunks starting below ``l1`` in L1, the rest on disk."""
    return LookupResult(hit, CS, TIERS, tuple(0 if i * CS < l1 else 1
                                              for i in range(-(-hit // CS))))


def prefix_answer(limit: int, l1: int):
    def fn(tokens: np.ndarray) -> LookupResult:
        return answer(min(limit, len(tokens)), l1)
    return fn


def pair(r: LookupResult) -> tuple[int, int]:
    """(hit tokens, of which in L1)."""
    return r.tokens, r.tokens_by_tier().get("cpu", 0)


def Client(paths: list[str], timeout: float = HANG_S) -> LookupClient:  # noqa: N802
    """Over the socket, although the servers live in this process. The timeout of a lookup
    that must be answered is a hang guard (tests/deadlines.py)."""
    return LookupClient(paths, timeout, use_local=False)


def test_socket_path_is_short_and_per_rank():
    a = socket_path("/tmp", "8dcf2909-6202-40f1-8cce-9a378f64636a", 0, 0)
    b = socket_path("/tmp", "8dcf2909-6202-40f1-8cce-9a378f64636a", 0, 1)
    c = socket_path("/tmp", "8dcf2909-6202-40f1-8cce-9a378f64636a", 1, 0)
    assert len({a, b, c}) == 3 and len(a) < 100


def test_answers_over_the_socket(sock_dir):
    path = str(sock_dir / "r0.sock")
    server = LookupServer(path, prefix_answer(512, 256))
    client = Client([path])
    try:
        assert client.lookup(list(range(700))) == answer(512, 256)
        assert pair(client.lookup(np.arange(100))) == (100, 100)
        assert server.requests == 2 and client.stats.rank_failures == 0
    finally:
        client.close()
        server.close()
    assert not os.path.exists(path)


def test_minimum_over_ranks(sock_dir):
    paths = [str(sock_dir / f"r{i}.sock") for i in range(3)]
    servers = [LookupServer(p, prefix_answer(n, l1))
               for p, n, l1 in zip(paths, (768, 256, 512), (0, 256, 32))]
    client = Client(paths)
    try:
        # the shortest prefix, each chunk in the slowest tier any rank holds it in
        assert client.lookup(list(range(1000))) == answer(256, 0)
    finally:
        client.close()
        for s in servers:
            s.close()


def test_in_process_engines_are_called_directly(sock_dir):
    path = str(sock_dir / "r0.sock")
    server = LookupServer(path, prefix_answer(300, 0))
    client = LookupClient([path])
    try:
        assert LOCAL_ENGINES[path] is not None
        assert pair(client.lookup(list(range(400)))) == (300, 0)
        assert client.stats.local_calls == 1 and server.requests == 0
    finally:
        server.close()
    assert path not in LOCAL_ENGINES


def test_missing_rank_is_zero_hits(sock_dir):
    client = Client([str(sock_dir / "nobody.sock")])
    t0 = time.perf_counter()
    assert client.lookup([1, 2, 3]).tokens == 0
    assert time.perf_counter() - t0 < AT_ONCE_S  # refused at once, not after the timeout
    assert client.stats.rank_failures == 1


class Held:
    """A rank's lookup function that answers only once released (a stuck engine)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.answered = threading.Event()

    def __call__(self, tokens: np.ndarray) -> LookupResult:
        self.release.wait(HANG_S)
        self.answered.set()
        return answer(len(tokens), 0)


def test_slow_rank_times_out_and_recovers(sock_dir):
    path = str(sock_dir / "slow.sock")
    held = Held()
    server = LookupServer(path, held)
    client = Client([path], timeout=0.2)
    try:
        t0 = time.perf_counter()
        assert client.lookup(list(range(10))).tokens == 0
        # bounded by the timeout, not by the rank (which answers only when released)
        assert time.perf_counter() - t0 < 0.2 + SLACK_S
        held.release.set()
        assert held.answered.wait(HANG_S)  # the late answer goes to the dropped connection
        client.timeout = HANG_S  # a lookup that must be answered: a hang guard
        assert pair(client.lookup(list(range(20)))) == (20, 0)  # not the late answer's 10
    finally:
        held.release.set()
        client.close()
        server.close()


def test_one_slow_rank_of_two_is_zero(sock_dir):
    fast, slow = str(sock_dir / "a.sock"), str(sock_dir / "b.sock")
    held = Held()
    s1 = LookupServer(fast, prefix_answer(100, 100))
    s2 = LookupServer(slow, held)
    client = Client([fast, slow], timeout=0.2)
    try:
        assert client.lookup(list(range(50))).tokens == 0
        assert client.lookup(list(range(50))).tokens == 0  # both reconnect cleanly
    finally:
        held.release.set()
        client.close()
        s1.close()
        s2.close()


def test_failing_engine_answers_zero(sock_dir):
    path = str(sock_dir / "err.sock")

    def broken(tokens: np.ndarray) -> LookupResult:
        raise OSError("tier down")

    server = LookupServer(path, broken)
    client = Client([path])
    try:
        assert client.lookup([5, 6]).tokens == 0
        assert server.errors == 1 and client.stats.rank_failures == 0
    finally:
        client.close()
        server.close()


def test_garbage_request_closes_only_that_connection(sock_dir):
    path = str(sock_dir / "g.sock")
    server = LookupServer(path, prefix_answer(7, 7))
    try:
        send_and_expect_close(path, b"HTTP/1.1 GET /\r\n\r\n")
        client = Client([path])
        assert pair(client.lookup([1] * 10)) == (7, 7)
        client.close()
    finally:
        server.close()


def test_oversized_request_is_refused_by_the_client():
    with pytest.raises(ValueError, match="exceed"):
        encode_request(np.zeros((1 << 24) + 1, dtype=np.int64))


def test_stale_socket_file_is_replaced_live_one_is_not(sock_dir):
    path = str(sock_dir / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # file left behind, nobody listening
    server = LookupServer(path, prefix_answer(1, 1))
    try:
        with pytest.raises(RuntimeError, match="engine_id"):
            LookupServer(path, prefix_answer(2, 2))
    finally:
        server.close()


def test_concurrent_clients(sock_dir):
    path = str(sock_dir / "c.sock")
    server = LookupServer(path, prefix_answer(10**6, 0))
    errors: list[BaseException] = []

    def hammer(n: int) -> None:
        client = Client([path])
        try:
            for i in range(50):
                assert pair(client.lookup(list(range(n + i)))) == (n + i, 0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=hammer, args=(k * 100,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.close()
    assert not errors


# ----------------------------------------------------------------- wire bounds and errors
class RawServer:
    """A peer that answers every request with fixed bytes (an old or broken server)."""

    def __init__(self, path: str, reply: bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(4)
        self.reply = reply
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    n = struct.unpack("<4sI", conn.recv(8))[1]
                    got = 0
                    while got < 4 * n:
                        got += len(conn.recv(4 * n - got))
                    conn.sendall(self.reply)  # then hang up: a short reply ends there

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def head(tokens=10, cs=CS, tiers=0, sources=0, magic=b"LMA2") -> bytes:
    return struct.pack("<4sQIBI", magic, tokens, cs, tiers, sources)


@pytest.mark.parametrize("reply,why", [
    (struct.pack("<4sQQ", b"LMCA", 10, 10), "version 1"),
    (head(magic=b"HTTP"), "bad lookup answer magic"),
    (head(tokens=11), "11 hit tokens for a request of 10"),
    (head(cs=0), "chunk size 0"),
    (head(tiers=17), "17 tiers, at most 16"),
    (head(sources=3, cs=8), "3 chunk sources for a request of 10 tokens in chunks of 8"),
    (head(tiers=1) + bytes([MAX_NAME + 1]) + b"x" * (MAX_NAME + 1), "65 bytes, at most 64"),
    (head(tiers=1) + b"\x02\xff\xfe", "not UTF-8"),
    (head(tokens=10, tiers=1, sources=1) + b"\x03cpu\x01", "source 1 names no tier"),
    (head()[:10], "peer closed the connection"),
    # a hybrid model's answer: points bounded by the request, the hit one of them
    (head(magic=b"LMH2") + struct.pack("<II", 0, 0), "0 points"),
    (head(magic=b"LMH2") + struct.pack("<II", 0, 2), "2 points"),  # 10 tokens: 1 chunk
    (head(magic=b"LMH2", cs=4) + struct.pack("<II", 5, 1) + struct.pack("<Q", 10),
     "slack 5"),
    (head(magic=b"LMH2") + struct.pack("<II", 0, 1) + struct.pack("<Q", 11),
     "a point past the request"),
    (head(magic=b"LMH2") + struct.pack("<II", 0, 1) + struct.pack("<Q", 8),
     "no servable end"),
])
def test_a_malformed_answer_is_a_miss_that_says_why(sock_dir, caplog, reply, why):
    path = str(sock_dir / "raw.sock")
    server = RawServer(path, reply)
    client = Client([path])
    try:
        with caplog.at_level(logging.WARNING, logger="lmc.connectors.core.lookup_service"):
            t0 = time.perf_counter()
            assert client.lookup(list(range(10))) == LookupResult.miss()
            assert time.perf_counter() - t0 < AT_ONCE_S  # refused, not timed out
        assert client.stats.rank_failures == 1
        assert why in caplog.text and path in caplog.text
    finally:
        client.close()
        server.close()


def test_a_hybrid_answer_crosses_the_socket_with_its_points(sock_dir):
    """A hybrid model's hit is servable only at some ends (lmc.hybrid.rules): the points
    and slack reach the scheduler, and the minimum over ranks keeps the common ones."""
    paths = [str(sock_dir / f"h{i}.sock") for i in range(2)]
    hits = [LookupResult(150, CS, TIERS, bytes(10), (64, 144, 150), CS),
            LookupResult(144, CS, TIERS, bytes(9), (64, 144), CS)]

    def fixed(r: LookupResult):
        return lambda tokens: r

    servers = [LookupServer(p, fixed(r)) for p, r in zip(paths, hits)]
    client = Client(paths, timeout=2)
    try:
        one = Client(paths[:1], timeout=2)
        assert one.lookup(list(range(150))) == hits[0]
        one.close()
        got = client.lookup(list(range(150)))
        assert (got.tokens, got.points, got.slack) == (144, (64, 144), CS)
        assert got.servable_end(140) == 140 and got.servable_end(100) == 64
    finally:
        client.close()
        for s in servers:
            s.close()


def test_an_old_client_request_is_refused_clearly(sock_dir, caplog):
    path = str(sock_dir / "new.sock")
    server = LookupServer(path, prefix_answer(7, 7))
    try:
        with caplog.at_level(logging.WARNING, logger="lmc.connectors.core.lookup_service"):
            send_and_expect_close(path, struct.pack("<4sI", b"LMCQ", 1) + b"\0\0\0\0")
        assert server.errors == 1 and "version 1" in caplog.text
    finally:
        server.close()


def test_a_request_over_the_limit_is_refused_by_the_server(sock_dir):
    path = str(sock_dir / "big.sock")
    server = LookupServer(path, prefix_answer(7, 7))
    try:
        send_and_expect_close(path, struct.pack("<4sI", b"LMQ2", (1 << 24) + 1))  # no 64 MiB
        assert server.errors == 1
    finally:
        server.close()


def test_encoding_is_bounded():
    with pytest.raises(ValueError, match="longer than 64 bytes"):
        encode_answer(LookupResult(0, 1, ("t" * 65,)))
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        encode_request([-1, 2])
    with pytest.raises(ValueError, match="1-D"):
        encode_request(np.zeros((2, 2), dtype=np.int64))
    r = answer(40, 16)
    assert len(encode_answer(r)) == struct.calcsize("<4sQIBI") + 4 + 5 + 3


def test_a_lookup_returning_garbage_is_a_miss_not_a_dead_server(sock_dir):
    path = str(sock_dir / "bad.sock")
    server = LookupServer(path, lambda t: LookupResult(0, 1, ("x" * 100,)))
    client = Client([path])
    try:
        assert client.lookup([1, 2]).tokens == 0
        assert server.errors == 1 and client.stats.rank_failures == 0
    finally:
        client.close()
        server.close()


# ----------------------------------------------------------- speeds for the load policy
def measured_costs():
    """Costs as a real engine's Speeds measure them: a tier's reads and prefill steps."""
    from lmc.connectors.core.load_policy import Costs
    from lmc.storage.speeds import Speeds

    sp = Speeds([("cpu", "memory", True), ("disk", "local_storage", False)])
    for n in (1 << 20, 8 << 20, 32 << 20):
        sp.tiers[1].observe(n, 0.002 + n / 1.5e9)
    for tokens in (256, 1024, 4096):
        sp.prefill.observe(tokens, float(tokens) ** 2, 0.001 + tokens * 6e-6)
    return Costs.from_snapshot(sp.snapshot(), 131072.0, 32)


def test_speeds_cross_the_socket_exactly(sock_dir):
    """A scheduler whose rank 0 lives in another process decides with that rank's measured
    speeds: every number arrives as measured (float64 on the wire)."""
    want = measured_costs()
    path = str(sock_dir / "speeds.sock")
    server = LookupServer(path, prefix_answer(7, 7), costs=lambda: want)
    client = Client([path])
    try:
        assert client.costs() == want
        assert pair(client.lookup(list(range(10)))) == (7, 7)  # the same connection goes on
    finally:
        client.close()
        server.close()


def test_speeds_unknown_and_asked_at_most_once_a_second(sock_dir):
    asked = []
    state = {"costs": None}

    def costs():
        asked.append(1)
        return state["costs"]

    path = str(sock_dir / "speeds.sock")
    server = LookupServer(path, prefix_answer(7, 7), costs=costs)
    bare = LookupServer(str(sock_dir / "bare.sock"), prefix_answer(7, 7))  # no costs given
    client = Client([path])
    try:
        assert client.costs() is None and len(asked) == 1  # nothing measured yet
        state["costs"] = measured_costs()
        assert client.costs() is None and len(asked) == 1  # the answer is reused for a second
        client.speeds_max_age = 0.0
        assert client.costs() == state["costs"] and len(asked) == 2
        assert Client([bare.path]).costs() is None
    finally:
        client.close()
        server.close()
        bare.close()


def test_a_hybrid_models_bytes_cross_the_socket(sock_dir):
    """A hybrid model's load is priced per KV group kind (lmc.storage.speeds.KVBytes):
    the speeds answer carries its windows and fixed bytes; lying ones are unknown."""
    from lmc.storage.speeds import KVBytes

    base = measured_costs()
    want = dataclasses.replace(base, kv=KVBytes(base.bytes_per_token, ((143, 32768.0),),
                                                4096.0))
    path = str(sock_dir / "hyb.sock")
    server = LookupServer(path, prefix_answer(0, 0), costs=lambda: want)
    client = Client([path], timeout=2)
    try:
        assert client.costs() == want
        assert want.load_bytes(1000) == 1000 * base.bytes_per_token + 143 * 32768 + 4096
    finally:
        client.close()
        server.close()


def test_remote_speeds_are_the_fallback_of_local_costs():
    from lmc.connectors.core.load_policy import LOCAL_COSTS, local_costs, register_local

    want = measured_costs()
    assert local_costs(["/nowhere"])() is None  # neither: the whole hit is loaded
    assert local_costs(["/nowhere"], remote=lambda: want)() == want
    register_local("/here", lambda: None)
    try:
        assert local_costs(["/here"], remote=lambda: want)() is None  # in process: its own
    finally:
        register_local("/here", None)
    assert "/here" not in LOCAL_COSTS


def speeds_reply(known=1, tiers=(("disk", 1.5e9, 0.002, 0, 3),), tail=(0.001, 6e-6, 0.0, 3,
                                                                       131072.0, 32),
                 magic=b"LMB2", name_len=None) -> bytes:
    out = struct.pack("<4sBB", magic, known, len(tiers))
    for name, bps, lat, ov, obs in tiers:
        b = name.encode()
        out += bytes([len(b) if name_len is None else name_len]) + b
        out += struct.pack("<ddBI", bps, lat, ov, obs)
    return out + struct.pack("<dddIdI", *tail)


@pytest.mark.parametrize("reply,why", [
    (speeds_reply(magic=b"LMA2"), "bad speeds answer magic"),
    (speeds_reply(known=7), "known flag 7"),
    (speeds_reply(tiers=()), "names 0 tiers"),
    (speeds_reply(tiers=(("disk", float("nan"), 0.0, 0, 1),)), "bytes/s nan"),
    (speeds_reply(tiers=(("disk", -5.0, 0.0, 0, 1),)), "bytes/s -5.0"),
    (speeds_reply(tiers=(("disk", 1e9, float("inf"), 0, 1),)), "latency is inf"),
    (speeds_reply(tiers=(("disk", 1e9, 0.0, 2, 1),)), "overlaps 2"),
    (speeds_reply(tiers=(("d" * 65, 1e9, 0.0, 0, 1),)), "65 bytes, at most 64"),
    (speeds_reply(tail=(0.0, float("nan"), 0.0, 1, 1.0, 1)), "prefill c1 is nan"),
    (speeds_reply(tail=(0.0, -1.0, 0.0, 1, 1.0, 1)), "prefill c1 is -1.0"),
    (speeds_reply(tail=(0.0, 1e-6, 0.0, 1, 0.0, 1)), "0.0 bytes per token"),
    (speeds_reply(tail=(0.0, 1e-6, 0.0, 1, 1.0, 0)), "0 layers"),
    (speeds_reply(tail=(0.0, 1e-6, 0.0, 1, 1.0, 1 << 20)), "1048576 layers"),
    (speeds_reply()[:20], "peer closed the connection"),
    # a hybrid model's bytes per KV group kind
    (speeds_reply(magic=b"LMK2") + bytes([1]) + struct.pack("<Id", 0, 1.0)
     + struct.pack("<d", 0.0), "a window of 0 positions"),
    (speeds_reply(magic=b"LMK2") + bytes([65]), "65 sliding windows"),
    (speeds_reply(magic=b"LMK2") + bytes([0]) + struct.pack("<d", float("nan")),
     "fixed bytes is nan"),
])
def test_lying_speeds_are_unknown_never_used(sock_dir, caplog, reply, why):
    """A rank answering speeds that are not numbers a decision can use (NaN, negative,
    infinite, out of range, truncated) is 'unknown' -- the whole hit is loaded -- with a
    warning naming the socket and the field; the connection is dropped and reopened."""
    path = str(sock_dir / "liar.sock")
    server = RawServer(path, reply)
    client = Client([path])
    try:
        with caplog.at_level(logging.WARNING, logger="lmc.connectors.core.lookup_service"):
            t0 = time.perf_counter()
            assert client.costs() is None
            assert time.perf_counter() - t0 < AT_ONCE_S  # refused, not timed out
        assert client.stats.rank_failures == 1
        assert why in caplog.text and path in caplog.text
    finally:
        client.close()
        server.close()


def test_a_speeds_request_with_a_count_closes_the_connection(sock_dir):
    path = str(sock_dir / "s.sock")
    server = LookupServer(path, prefix_answer(7, 7), costs=measured_costs)
    try:
        send_and_expect_close(path, struct.pack("<4sI", b"LMS2", 5) + b"\0" * 20)
        assert server.errors == 1
    finally:
        server.close()


def test_failing_costs_answer_unknown_and_the_server_lives(sock_dir):
    def costs():
        raise RuntimeError("speeds broke")

    path = str(sock_dir / "s.sock")
    server = LookupServer(path, prefix_answer(7, 7), costs=costs)
    client = Client([path])
    try:
        assert client.costs() is None
        assert server.errors == 1
        assert pair(client.lookup(list(range(10)))) == (7, 7)
    finally:
        client.close()
        server.close()


def test_prefetch_messages_are_bounded_and_refusals_are_none(sock_dir):
    from concurrent.futures import Future

    from lmc.connectors.core.lookup_service import encode_prefetch

    got = []

    def prefetch(tokens, start):
        got.append((list(tokens), start))
        f: Future = Future()
        f.set_result(len(tokens))
        return f

    def broken(tokens, start):
        raise RuntimeError("no room")

    path = str(sock_dir / "p.sock")
    server = LookupServer(path, prefix_answer(7, 7), prefetch=prefetch)
    bare = LookupServer(str(sock_dir / "bare.sock"), prefix_answer(7, 7))
    failing = LookupServer(str(sock_dir / "f.sock"), prefix_answer(7, 7), prefetch=broken)
    client = Client([path])
    try:
        assert client.prefetch(list(range(10)), 4) is not None
        assert got == [(list(range(10)), 4)]
        assert pair(client.lookup(list(range(10)))) == (7, 7)  # the connection goes on
        assert Client([bare.path]).prefetch([1, 2, 3], 0) is None  # refused
        assert Client([failing.path]).prefetch([1, 2, 3], 0) is None
        assert failing.errors == 1
        with pytest.raises(ValueError, match="position 11 of 10"):
            encode_prefetch(list(range(10)), 11)
        # a raw request starting past its tokens, or over the token limit: the server hangs up
        send_and_expect_close(path, struct.pack("<4sII", b"LMP2", 2, 3) + b"\0" * 8)
        send_and_expect_close(path, struct.pack("<4sII", b"LMP2", (1 << 24) + 1, 0))
        assert server.errors == 2
        # in this process: the engines' own futures, no socket
        local = LookupClient([path], HANG_S)
        p = local.prefetch(list(range(5)), 2)
        assert p is not None and p.futures and p.done()
    finally:
        client.close()
        for s in (server, bare, failing):
            s.close()


def recording_prefetch(got: list, tagged: bool = True):
    """A prefetch function that notes what it was asked (``tagged``: it takes the key tag)."""
    from concurrent.futures import Future

    def done(n: int) -> Future:
        f: Future = Future()
        f.set_result(n)
        return f

    if tagged:
        def fn(tokens, start, tag):
            got.append((list(tokens), start, tag))
            return done(len(tokens))
        return fn

    def plain(tokens, start):
        got.append((list(tokens), start, "plain function"))
        return done(len(tokens))
    return plain


TAG = bytes(range(16))


def test_a_tagged_prefetch_frame_is_count_start_tag_tokens():
    from lmc.connectors.core.lookup_service import encode_prefetch
    from lmc.token_database import request_tag

    frame = encode_prefetch([7, 8, 9], 1, TAG)
    assert frame == struct.pack("<4sII", b"LMU2", 3, 1) + TAG + struct.pack("<3I", 7, 8, 9)
    salted = encode_prefetch([7, 8, 9], 0, request_tag(None, "my-secret-salt-value"))
    assert b"my-secret-salt-value" not in salted  # a digest only
    assert encode_prefetch([7, 8, 9], 1)[:4] == b"LMP2"  # untagged: the old message
    with pytest.raises(ValueError, match="key tag must be 16 bytes"):
        encode_prefetch([1, 2, 3], 0, b"short")
    with pytest.raises(ValueError, match="position 4 of 3"):
        encode_prefetch([1, 2, 3], 4, TAG)


@pytest.mark.parametrize("use_local", [False, True], ids=["socket", "in-process"])
def test_a_tagged_prefetch_reaches_every_rank_with_its_tag(sock_dir, use_local):
    got: list = []
    paths = [str(sock_dir / f"r{i}.sock") for i in range(2)]
    servers = [LookupServer(p, prefix_answer(7, 7), prefetch=recording_prefetch(got))
               for p in paths]
    client = LookupClient(paths, 2, use_local=use_local)
    try:
        p = client.prefetch(list(range(10)), 4, TAG)
        assert p is not None and p.tag == TAG and bool(p.futures) == use_local
        assert got == [(list(range(10)), 4, TAG)] * 2  # both ranks, the tag with it
        got.clear()
        assert client.prefetch(list(range(10)), 4) is not None  # plain: no tag
        assert got == [(list(range(10)), 4, None)] * 2
        assert pair(client.lookup(list(range(10)))) == (7, 7)  # the connection goes on
    finally:
        client.close()
        for s in servers:
            s.close()


@pytest.mark.parametrize("use_local", [False, True], ids=["socket", "in-process"])
def test_a_plain_prefetch_function_refuses_a_tagged_prefetch(sock_dir, use_local):
    """A server whose prefetch function takes no tag cannot key by one: a tagged prefetch is
    refused (``None``), never pulled in the plain chain; plain prefetches go on."""
    got: list = []
    path = str(sock_dir / "plain.sock")
    server = LookupServer(path, prefix_answer(7, 7), prefetch=recording_prefetch(got, False))
    client = LookupClient([path], 2, use_local=use_local)
    try:
        assert client.prefetch(list(range(10)), 4, TAG) is None
        assert got == [] and server.errors == 0
        assert client.prefetch(list(range(10)), 4) is not None
        assert got == [(list(range(10)), 4, "plain function")]
    finally:
        client.close()
        server.close()


def test_malformed_tagged_prefetches_close_the_connection_and_the_server_lives(sock_dir):
    """A tagged prefetch claiming too many tokens is refused before its start and tag are
    read; one starting past its tokens is refused; one whose sender stops inside its tag is
    dropped; one left half-sent holds only its own connection. None reaches the prefetch
    function; the server then still answers."""
    got: list = []
    path = str(sock_dir / "m.sock")
    server = LookupServer(path, prefix_answer(7, 7), prefetch=recording_prefetch(got))
    try:
        # the count alone: the server hangs up without waiting for the start or the tag
        send_and_expect_close(path, struct.pack("<4sI", b"LMU2", (1 << 24) + 1))
        send_and_expect_close(path, struct.pack("<4sII", b"LMU2", 2, 3) + TAG + b"\0" * 8)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # ends inside the tag
            s.connect(path)
            s.sendall(struct.pack("<4sII", b"LMU2", 2, 0) + b"short")
            s.shutdown(socket.SHUT_WR)
            s.settimeout(HANG_S)
            assert s.recv(16) == b""
        assert server.errors == 2  # the oversized count and the start; a hang-up is not one
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as half:
            half.connect(path)
            half.sendall(struct.pack("<4sII", b"LMU2", 2, 0) + TAG[:8])  # and nothing more
            client = Client([path])
            t0 = time.perf_counter()
            assert client.prefetch([1, 2, 3], 1, TAG) is not None
            assert time.perf_counter() - t0 < AT_ONCE_S  # not held up by the half-open one
            assert pair(client.lookup([1] * 10)) == (7, 7)
            client.close()
        assert got == [([1, 2, 3], 1, TAG)], "only the well-formed prefetch was made"
    finally:
        server.close()
