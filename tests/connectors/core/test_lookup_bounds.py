"""What a lookup socket's peers can make a rank hold (lmc/connectors/core/lookup_conns.py):
connections announcing the largest token count and then silent allocate nothing for it (the
bytes the bound counts, and RSS with a margin); past the connection cap the longest-idle
connection makes room, or the newcomer is refused when none is idle, while a good lookup
still answers; idle and slow connections are closed, and a scheduler whose kept connection
was closed reconnects without a miss."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np

from lmc.connectors.core.lookup_conns import ConnLimits
from lmc.connectors.core.lookup_service import (
    _REQ_HEAD,
    MAX_TOKENS,
    TAGGED_REQ_MAGIC,
    LookupClient,
    LookupServer,
)
from tests import lookup_sockets
from tests.connectors.core.test_lookup_service import prefix_answer

sock_dir = lookup_sockets.sock_dir  # the fixture
MAX_HEAD = _REQ_HEAD.pack(TAGGED_REQ_MAGIC, MAX_TOKENS) + b"\x01" * 16  # 64 MiB announced


def rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def dial(path: str, first: bytes = b"") -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    if first:
        s.sendall(first)
    return s


def wait_for(pred, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end
        time.sleep(0.02)


def closed_by_server(s: socket.socket, timeout: float = 20.0) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def good_lookup(path: str) -> int:
    c = LookupClient([path], timeout=30.0, use_local=False)  # a hang guard, not a timing
    try:
        return c.lookup(np.arange(100)).tokens
    finally:
        c.close()


def test_silent_connections_announcing_the_largest_count_allocate_nothing(sock_dir):
    path = str(sock_dir / "r.sock")
    server = LookupServer(path, prefix_answer(64, 64))
    socks = []
    try:
        before = rss()
        for _ in range(8):  # before the bound: 8 x 64 MiB allocated at once
            socks.append(dial(path, MAX_HEAD + b"\x00" * 100))
        wait_for(lambda: server.stats()["connections"] == 8)
        time.sleep(0.5)
        st = server.stats()
        grew = (rss() - before) >> 20
        print(f"8 silent max-count requests: {st['buffered_bytes']} bytes counted, RSS "
              f"+{grew} MiB")
        assert st["buffered_bytes"] <= 8 * (len(MAX_HEAD) + 100 + (64 << 10))  # arrived + a read
        assert grew < 64, f"RSS grew {grew} MiB"  # 512 MiB before
        assert good_lookup(path) == 64
    finally:
        for s in socks:
            s.close()
        server.close()


def test_the_byte_budget_closes_the_connection_that_would_pass_it(sock_dir):
    path = str(sock_dir / "b.sock")
    server = LookupServer(path, prefix_answer(64, 64),
                          limits=ConnLimits(max_buffered=1 << 20))
    socks = []
    try:
        big = dial(path, MAX_HEAD)
        socks.append(big)
        chunk = b"\x00" * (256 << 10)
        try:
            for _ in range(8):  # 2 MiB of tokens into a 1 MiB budget
                big.sendall(chunk)
        except OSError:
            pass  # closed under us: what is tested
        assert closed_by_server(big)
        assert server.stats()["over_budget"] >= 1
        assert server.stats()["buffered_peak"] <= 1 << 20
        wait_for(lambda: server.stats()["buffered_bytes"] == 0)
        assert good_lookup(path) == 64
    finally:
        for s in socks:
            s.close()
        server.close()


def test_idle_connections_past_the_cap_make_room_and_threads_stay_bounded(sock_dir):
    path = str(sock_dir / "c.sock")
    server = LookupServer(path, prefix_answer(64, 64), limits=ConnLimits(max_connections=16))
    socks = []
    try:
        for _ in range(100):  # before: 100 threads, each holding its connection
            socks.append(dial(path))
        wait_for(lambda: server.stats()["evicted"] >= 84)
        threads = [t for t in threading.enumerate() if t.name == "lmc-lookup-conn"]
        assert server.stats()["connections"] <= 16 and len(threads) <= 17
        assert good_lookup(path) == 64  # evicts the longest-idle one
    finally:
        for s in socks:
            s.close()
        server.close()


def test_a_full_house_of_requests_refuses_the_next_and_a_good_client_answers_after(sock_dir):
    path = str(sock_dir / "f.sock")
    limits = ConnLimits(max_connections=4, request_timeout=1.0)
    server = LookupServer(path, prefix_answer(64, 64), limits=limits)
    socks = []
    try:
        kept = LookupClient([path], timeout=30.0, use_local=False)
        assert kept.lookup(np.arange(100)).tokens == 64  # a scheduler's kept connection
        for _ in range(4):  # each inside a request (a header, then nothing)
            socks.append(dial(path, MAX_HEAD))
        wait_for(lambda: server.stats()["evicted"] >= 1 and server.stats()["connections"] == 4)
        extra = dial(path)
        assert closed_by_server(extra)  # refused at once: every connection is mid-request
        assert server.stats()["refused"] >= 1
        # the slow requests time out; the kept client finds its connection gone, reconnects
        wait_for(lambda: server.stats()["timeouts"] >= 4)
        failures = kept.stats.rank_failures
        assert kept.lookup(np.arange(100)).tokens == 64
        assert kept.stats.rank_failures == failures  # no miss on the way
        kept.close()
    finally:
        for s in socks:
            s.close()
        server.close()


def test_idle_and_slow_readers_are_dropped(sock_dir):
    path = str(sock_dir / "i.sock")
    server = LookupServer(path, prefix_answer(64, 64),
                          limits=ConnLimits(idle_timeout=0.5, request_timeout=0.5))
    try:
        idle = dial(path)
        assert closed_by_server(idle)
        slow = dial(path, _REQ_HEAD.pack(b"LMQ2", 100))
        for _ in range(20):  # one token a 0.1 s: 40 s for the request
            try:
                slow.sendall(b"\x00")
            except OSError:
                break
            time.sleep(0.1)
        assert closed_by_server(slow)
        assert server.stats()["timeouts"] >= 2
        # a scheduler's connection closed while idle: its next lookup reconnects, no miss
        c = LookupClient([path], timeout=30.0, use_local=False)
        assert c.lookup(np.arange(100)).tokens == 64
        time.sleep(1.0)
        assert c.lookup(np.arange(100)).tokens == 64 and c.stats.rank_failures == 0
        c.close()
        idle.close()
        slow.close()
    finally:
        server.close()
