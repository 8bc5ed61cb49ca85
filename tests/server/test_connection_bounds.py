"""What a client can make the daemon hold is bounded: connections that never authenticate
are timed out and capped below max_connections (authenticated clients keep a reserve),
every half-received or half-sent frame is timed out whatever state the request was in,
and running out of file descriptors costs one log line per interval, not one per retry.
Threat model: docs/threats/daemon.md."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from lmc.storage.backends.server import protocol as P
from lmc.storage.backends.server.client import ServerError
from tests.deadlines import HANG_S, SLACK_S
from tests.server import wire as W

pytestmark = pytest.mark.integration
TOKEN = "bounds-token-0123456789"


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _server_stats(d) -> dict:
    return d.stats(token=TOKEN)["server"]


def test_idle_unauthenticated_sockets_never_lock_out_a_client(start_daemon):
    # a client that waited for the idle ones' hello_timeout would take 2 * SLACK_S
    hello = 2 * SLACK_S
    d = start_daemon("--size", "16MiB", "--token", TOKEN, "--max-connections", "32",
                     "--hello-timeout", str(hello))
    idle = [socket.create_connection(("127.0.0.1", d.port), timeout=HANG_S)
            for _ in range(96)]
    t0 = time.monotonic()
    good = d.connect(token=TOKEN)  # at once: the oldest idle ones made room
    good.ping()
    assert time.monotonic() - t0 < SLACK_S, "the client waited for hello_timeout"
    st = _server_stats(d)
    assert st["connections"] <= 32 and st["unauthenticated"] <= 8, st
    # every idle socket is closed: displaced or timed out after hello_timeout
    deadline = time.monotonic() + hello + SLACK_S
    for s in idle:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        assert s.recv(1) == b"", "an unauthenticated socket was held past hello_timeout"
        s.close()
    _wait(lambda: _server_stats(d)["unauthenticated"] == 0, HANG_S, "pre-HELLO sessions left")
    good.ping()  # an authenticated idle connection is kept
    good.close()
    log = d.log()
    assert log.count("sent no HELLO") <= 2 and log.count("closed the oldest") <= 2, \
        "one line per interval, not one per connection"


def test_authenticated_clients_keep_their_reserve(start_daemon):
    """max_connections 8: at most 2 before HELLO. Six authenticated clients survive a flood
    of junk connections, two more still get in, a ninth is refused: the cap holds."""
    d = start_daemon("--size", "16MiB", "--token", TOKEN, "--max-connections", "8",
                     "--hello-timeout", "30")
    clients = [d.connect(token=TOKEN) for _ in range(6)]
    junk = [socket.create_connection(("127.0.0.1", d.port), timeout=HANG_S)
            for _ in range(40)]
    time.sleep(0.3)
    for c in clients:
        c.ping()  # kept: no error
    clients += [d.connect(token=TOKEN) for _ in range(2)]
    for c in clients:
        c.ping()
    with pytest.raises((ServerError, OSError)):
        d.connect(token=TOKEN, timeout=2).ping()
    for s in junk:
        s.close()
    for c in clients:
        c.close()


def test_bad_request_put_then_silence_is_dropped(start_daemon, tmp_path):
    """A PUT refused before its payload (bad items, forbidden namespace, bad types) has its
    payload read and discarded; a client that stops sending half-way is dropped after
    frame_timeout, as is one that stops inside a header or metadata."""
    tok = tmp_path / "mine.token"
    tok.write_text(TOKEN)
    d = start_daemon("--size", "16MiB", "--frame-timeout", "0.5", "--tokens", f"{tok}:mine")
    refused = [
        W.frame(P.PUT, {"ns": "mine", "items": [b"x" * 10]}, b"\0" * (1 << 20)),  # bad_request
        W.put("theirs", [W.value_bytes("theirs", b"k" * 16)] * 8),               # forbidden
        W.frame(P.PUT, {"ns": 5, "items": []}, b"\0" * 4096),                    # bad types
        W.frame(P.GET, {"ns": "mine", "keys": [b"k" * 16] * 50})[:60],            # in metadata
        W.frame(P.PING, {})[:11],                                                # in a header
    ]
    for req in refused:
        c = W.RawClient(d.port)
        assert c.call(W.hello(TOKEN))[0] == P.OK
        assert c.send(req[: len(req) // 2] if len(req) > 100 else req)  # then silence
        assert c.at_eof(10), "a client silent mid-frame was held"
        c.close()
    c = W.RawClient(d.port)
    assert c.send(W.hello(TOKEN)[:10])  # silent inside its HELLO
    assert c.at_eof(10)
    c.close()
    _wait(lambda: _server_stats(d)["connections"] == 1, 5, "stalled sessions left")
    assert "no progress" in d.log()


def test_a_reader_that_stops_reading_loses_its_pins(start_daemon):
    """GET answers the client never reads: the send stalls, the watchdog drops the
    connection and the values it was sending are no longer pinned (they can be evicted)."""
    d = start_daemon("--size", "32MiB", "--frame-timeout", "0.5", "--max-payload", "8MiB")
    c = W.RawClient(d.port)
    keys = [bytes([3, i]) * 8 for i in range(4)]
    vals = [W.value_bytes("big", k, tokens=512, width=512) for k in keys]  # 1 MiB each
    assert c.call(W.put("big", vals))[0] == P.OK
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    for i in range(24):  # ~96 MiB of answers nobody reads
        assert c.send(W.frame(P.GET, {"ns": "big", "keys": keys}, req_id=i))

    def dropped() -> bool:
        st = d.stats()  # the stalled reader gone (this is the one connection), no pins
        return st["server"]["connections"] == 1 and \
            st["pool"]["objects"] == st["tiers"]["cpu.chunks"] == 4

    _wait(dropped, HANG_S, "the stalled reader is still connected, or its pins outlived it")
    c.close()


def test_a_low_fd_limit_caps_connections_instead_of_running_out(start_daemon):
    """With RLIMIT_NOFILE 48, 80 connections never exhaust the daemon's fds: accepting stops
    at the cap fd_reserve leaves (half the limit here), idle ones are displaced,
    accept() never fails, and a client still gets in."""
    d = start_daemon("--size", "16MiB", "--hello-timeout", "60", nofile=48)
    socks = [socket.create_connection(("127.0.0.1", d.port), timeout=HANG_S)
             for _ in range(80)]
    time.sleep(1)
    assert W.fd_count(d.pid) < 48
    c = d.connect()
    c.ping()
    log = d.log()
    assert "accept failed" not in log and "Too many open files" not in log, log[-3000:]
    assert "lowered to" in log
    for s in socks:
        s.close()
    c.close()


def test_out_of_fds_logs_once_per_interval(start_daemon):
    """fd_reserve 0 leaves the /metrics listener's connections uncovered: with RLIMIT_NOFILE
    48, 80 data and 40 /metrics connections exhaust the fds, accept() fails for seconds on
    both listeners, the log gets a line or two (not a traceback per retry), and once fds
    are free again a client gets in."""
    d = start_daemon("--size", "16MiB", "--hello-timeout", "60", "--fd-reserve", "0",
                     "--max-unauthenticated", "1000", nofile=48)
    socks = [socket.create_connection(("127.0.0.1", d.info["metrics_port"]), timeout=10)
             for _ in range(40)]
    for _ in range(80):
        socks.append(socket.create_connection(("127.0.0.1", d.port), timeout=10))
    _wait(lambda: "Too many open files" in d.log(), HANG_S, "accept never failed")
    time.sleep(3)  # seconds of failing accepts: still a line or two
    log = d.log()
    assert log.count("accept failed") <= 2 and "Traceback" not in log, log[-3000:]
    for s in socks:
        s.close()
    _wait(lambda: "works again" in d.log(), HANG_S, "accept never recovered")
    c = d.connect()
    c.ping()
    c.close()


def test_metrics_listener_is_bounded_too(start_daemon):
    """Idle connections to /metrics: at most 32 are held, each at most 5 s in all."""
    d = start_daemon("--size", "16MiB")
    url_port = d.info["metrics_port"]
    time.sleep(0.3)
    fds0 = W.fd_count(d.pid)
    idle = [socket.create_connection(("127.0.0.1", url_port), timeout=10) for _ in range(100)]
    idle[0].sendall(b"GET /metr")  # and one that trickles
    time.sleep(1.0)
    assert W.fd_count(d.pid) <= fds0 + 32 + 2
    _wait(lambda: W.fd_count(d.pid) <= fds0, HANG_S, "idle /metrics connections were held")
    for s in idle:
        s.close()
    assert urllib.request.urlopen(f"http://127.0.0.1:{url_port}/healthz", timeout=5).read() \
        == b"ok\n"


def test_an_fd_limit_with_no_room_for_connections_is_a_clear_error(tmp_path):
    """RLIMIT_NOFILE 20: after the descriptors open at start-up and the reserve, nothing is
    left for clients: the daemon refuses to start, naming the limit and fd_reserve."""
    from tests.server.daemon_proc import DaemonProc

    d = DaemonProc(tmp_path / "d", ["--size", "16MiB"], nofile=20)
    with pytest.raises(RuntimeError, match="exited with 2"):
        d.start(timeout=60)
    log = d.log()
    assert "RLIMIT_NOFILE 20" in log and "fd_reserve" in log, log[-2000:]
    assert "Traceback" not in log
