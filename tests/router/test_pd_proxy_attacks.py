"""``lmc pd-proxy`` attacked from both sides: a client with lying Content-Length, half-sent
requests, slow-loris trickles, deep nesting and a socket flood at RLIMIT_NOFILE 128; and a
prefill or decode instance that answers garbage (a JSON array, no JSON, a wrong
``kv_transfer_params``, a cut body, a bad status line, nothing at all, too much). Each gets
its own error (a 4xx for the client's mistakes, a 502 naming the instance for an
instance's) and the next request through the proxy is served.
Threat model: docs/threats/http.md.

The honest instance is the reference engine's server (``lmc.reference.serve``, in-process,
no lmc: the prefill answers no ``kv_transfer_params`` and the decode side prefills itself);
the lying one is a raw socket server scripted per test. No NIXL needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings

from lmc.http.json_api import HttpLimits
from lmc.router.pd_proxy import Proxy
from tests.deadlines import AT_ONCE_S, HANG_S, SLACK_S
from tests.http_attack_kit import (
    LIMITS,
    NORMAL,
    PATIENT,
    expected_tokens,
    flood_then_serve,
    low_nofile,
    message,
    post,
    read_answer,
    running_server,
    tiny_model,
)
from tests.reference.test_serve_attacks import BODIES, FIELD_ERRORS
from tests.server.daemon_proc import ROOT


class Liar:
    """An upstream that reads each request and answers ``self.answer``: raw bytes, or
    ``"close"`` (hang up unanswered) or ``"hang"`` (never answer)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer: bytes | str = b""
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            buf = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in buf:
                    buf += conn.recv(65536)
                head, _, body = buf.partition(b"\r\n\r\n")
                if head.startswith(b"GET "):  # the proxy's health probe
                    if self.answer == "hang":
                        self.stop.wait(HANG_S)
                    else:
                        conn.sendall(http200(b"{}"))
                    return
                n = int(re.search(rb"Content-Length: (\d+)", head).group(1))
                while len(body) < n:
                    body += conn.recv(65536)
                if self.answer == "hang":
                    self.stop.wait(HANG_S)
                elif self.answer != "close":
                    conn.sendall(self.answer)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def http200(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s"
            b"\r\n%s" % (len(body), extra, body))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("proxy"))


@pytest.fixture(scope="module")
def want(ckpt) -> list[int]:
    return expected_tokens(ckpt)


@pytest.fixture(scope="module")
def honest(ckpt):
    with running_server(ckpt) as srv:
        yield srv


@pytest.fixture(scope="module")
def liar():
    up = Liar()
    yield up
    up.close()


def start(proxy: Proxy) -> Proxy:
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    return proxy


@pytest.fixture(scope="module")
def proxy(honest):
    p = start(Proxy([honest.url], [honest.url], limits=LIMITS))
    yield p
    p.close()


def assert_served(port: int, want: list[int]) -> None:
    status, raw = post(port, NORMAL)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["token_ids"] == want


# ------------------------------------------------------------ lying instances

LIES = [  # (the prefill's answer, words the 502 must carry)
    (http200(b"[1, 2, 3]"), "JSON list, not an object"),
    (http200(b"<html>busy</html>"), "not JSON"),
    (http200(b'{"kv_transfer_params": 5}'), "kv_transfer_params of type int"),
    (http200(b'{"kv_transfer_params": ["a"]}'), "kv_transfer_params of type list"),
    (http200(b"[" * 100_000 + b"]" * 100_000), "not JSON"),
    (http200(b"{}")[:-1].replace(b"Length: 2", b"Length: 50"), "cut short"),
    (b"HELLO THERE\r\n\r\n", "BadStatusLine"),
    (b"HTTP/1.0 999 Odd\r\nContent-Length: 2\r\n\r\n{}", "status 999"),
    (b"HTTP/1.0 302 Found\r\nLocation: http://x/\r\nContent-Length: 0\r\n\r\n", "status 302"),
    (http200(b"{}", b"X-A: b\r\n" * 200), "headers"),
    (http200(b'{"a": "' + b"x" * (300 << 10) + b'"}'), "more than"),
    ("close", "RemoteDisconnected"),
    ("hang", "timed out"),
]


@pytest.mark.parametrize("answer,words", LIES, ids=[w for _, w in LIES])
def test_a_lying_prefill_instance_is_a_502_naming_it(honest, liar, want, answer, words):
    """The proxy alternates the lying and the honest prefill instance: the lie is a 502
    naming the liar, the next request goes through the honest one and is served."""
    liar.answer = answer
    p = start(Proxy([liar.url, honest.url], [honest.url], limits=LIMITS,
                    upstream_timeout=SLACK_S))
    try:
        status, raw = post(p.port, NORMAL)
        assert status == 502, raw[:300]
        assert f"prefill instance {liar.url}" in message(raw) and words in message(raw), raw
        assert_served(p.port, want)
        assert p.counts["prefill_failures"] == 1
    finally:
        p.close()


def test_a_prefill_refusal_is_relayed_as_the_client_error_it_is(proxy):
    status, raw = post(proxy.port, {**NORMAL, "temperature": "hot"})
    assert status == 400 and "temperature" in message(raw), raw


@pytest.mark.parametrize("answer,words", [
    (b"HELLO\r\n\r\n", "BadStatusLine"),
    ("close", "RemoteDisconnected"),
    (b"HTTP/1.0 999 Odd\r\nContent-Length: 2\r\n\r\n{}", "status 999"),
])
def test_a_lying_decode_instance_is_a_502_naming_it(honest, liar, want, answer, words):
    liar.answer = answer
    p = start(Proxy([honest.url], [liar.url, honest.url], limits=LIMITS,
                    upstream_timeout=SLACK_S))
    try:
        status, raw = post(p.port, NORMAL)
        assert status == 502 and f"decode instance {liar.url}" in message(raw), raw
        assert words in message(raw), raw
        assert_served(p.port, want)
    finally:
        p.close()


def test_a_decode_answer_cut_short_reaches_the_client_as_cut(honest, liar, want):
    """Headers promise 100 bytes, 10 come, then the instance hangs up: the client gets
    what came and the end of the connection; the proxy goes on."""
    liar.answer = b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n0123456789"
    p = start(Proxy([honest.url], [liar.url, honest.url], limits=LIMITS,
                    upstream_timeout=SLACK_S))
    try:
        status, raw = post(p.port, NORMAL)
        assert status == 200 and raw == b"0123456789"
        assert_served(p.port, want)
    finally:
        p.close()


# -------------------------------------------------------------- lying clients

@pytest.mark.parametrize("header,status,words", [
    (b"Content-Length: -1\r\n", 400, "Content-Length"),
    (b"Content-Length: x\r\n", 400, "Content-Length"),
    (b"", 411, "Content-Length required"),
    (b"Content-Length: 16777216\r\n", 413, "--max-body"),
])
def test_lying_content_length_is_answered_at_once(honest, want, header, status, words):
    p = start(Proxy([honest.url], [honest.url], limits=PATIENT))
    try:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", p.port), timeout=HANG_S) as s:
            s.sendall(b"POST /v1/completions HTTP/1.0\r\n" + header + b"\r\n")
            got, raw = read_answer(s)
        assert got == status and words in message(raw), raw
        assert time.monotonic() - t0 < AT_ONCE_S  # not the read timeout's HANG_S
        assert_served(p.port, want)
    finally:
        p.close()


@pytest.mark.parametrize("body,status,words", [
    (b"[1, 2, 3]", 400, "JSON object"),
    (b"{", 400, "not JSON"),
    (b'{"prompt": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested"),
])
def test_bad_bodies_are_a_400(proxy, want, body, status, words):
    got, raw = post(proxy.port, body)
    assert got == status and words in message(raw), raw[:300]
    assert_served(proxy.port, want)


def test_half_sent_and_trickled_requests_are_dropped_at_the_read_timeout(proxy, want):
    """Both dropped by the read timeout plus ``SLACK_S``: the trickle would last 60 s."""
    t0 = time.monotonic()
    half = socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_S)
    half.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: 50\r\n\r\n{")
    trickle = socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_S)
    closed = False
    for b in b"POST /v1/completions HTTP/1.0\r\nX-Pad: " + b"a" * 600:
        try:
            trickle.sendall(bytes([b]))
        except OSError:
            closed = True
            break
        time.sleep(0.1)
        if time.monotonic() - t0 > LIMITS.read_timeout + SLACK_S:
            break
    with half, trickle:
        trickle.setblocking(False)  # closed by now, or never
        try:
            closed = closed or trickle.recv(1) == b""
        except BlockingIOError:
            pass
        except ConnectionError:
            closed = True
        got = half.recv(4096)  # the 408 (or the end), once the read timeout passed
        assert got == b"" or got.startswith(b"HTTP/1.0 408"), got
    assert closed and time.monotonic() - t0 < LIMITS.read_timeout + 2 * SLACK_S  # not HANG_S
    assert_served(proxy.port, want)


def test_past_the_cap_with_every_request_in_flight_a_newcomer_gets_503_at_once(
        honest, liar, want):
    """Two connections whose requests are read and wait on a prefill instance that never
    answers fill a cap of 2: nothing can be displaced, so a third is answered 503 at
    once; once the instance times out (502 each), the next request is served."""
    liar.answer = "hang"
    # no health probes: the hanging instance would be marked down by them (what they are
    # for), and this test is of the connection cap
    # the two in flight end at the upstream timeout, 2 * SLACK_S: a newcomer that waited
    # for one of them would take that long
    p = start(Proxy([liar.url], [honest.url], upstream_timeout=2 * SLACK_S,
                    limits=HttpLimits(max_connections=2, read_timeout=1.0),
                    health_interval=None))
    try:
        answers: list[tuple[int, bytes]] = []
        waiting = [threading.Thread(target=lambda: answers.append(post(p.port, NORMAL)))
                   for _ in range(2)]
        for t in waiting:
            t.start()
        end = time.monotonic() + HANG_S
        while sum(not c.reading for c in p.httpd.conns.values()) < 2:
            assert time.monotonic() < end
            time.sleep(0.01)
        t0 = time.monotonic()
        status, raw = post(p.port, NORMAL)
        assert status == 503 and "too many connections" in message(raw), raw
        assert time.monotonic() - t0 < SLACK_S and p.httpd.refused == 1
        for t in waiting:
            t.join(HANG_S)
        assert [a[0] for a in answers] == [502, 502], answers
        liar.answer = http200(b'{"kv_transfer_params": null}')  # answers, not a producer
        assert_served(p.port, want)
    finally:
        p.close()


def test_a_flood_at_nofile_128_leaves_the_proxy_serving_everyone(honest, want, tmp_path):
    log = tmp_path / "proxy.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmc.cli", "pd-proxy", "--port", "0", "--prefill",
             honest.url, "--decode", honest.url], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=err,
            text=True, preexec_fn=low_nofile)
        try:
            port = int(re.search(r" at http://[\d.]+:(\d+)", proc.stdout.readline()).group(1))
        except BaseException:
            proc.kill()
            raise
        # relayed refusals and the proxy's own: answered, no traceback
        flood_then_serve(proc, port, log, want, [body for body, _ in FIELD_ERRORS])


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(BODIES)
def test_fuzz_the_proxy_answers_200_or_a_4xx_with_a_message(proxy, body):
    """Random bodies through the proxy to an honest pair: 200, or a 4xx with a message."""
    status, raw = post(proxy.port, json.dumps(body).encode())
    if status != 200:
        assert 400 <= status < 500 and message(raw), (status, raw[:300])
