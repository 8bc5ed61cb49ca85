"""Every HTTP front (:data:`tests.http.fronts.FRONTS`: the reference engine's server,
``lmc router``, ``lmc pd-proxy``) attacked as a careless or hostile client would: lying
Content-Length, bodies over the limit, malformed and deeply nested JSON, values out of every
range, half-sent requests, slow-loris trickles, silent sockets past the connection cap, a
socket flood at RLIMIT_NOFILE 128 and random bodies. Each attack gets its own error (or a
correct answer), and the next ordinary request is served with the tokens an untouched
engine gives. What only one front has (an engine's failures, lying instances, event
publishers) is tested with that front: ``tests/reference/test_serve_attacks.py``,
``tests/router/test_router_attacks.py``, ``tests/router/test_pd_proxy_attacks.py``.
Threat model: docs/threats/http.md.

Real servers on 127.0.0.1 (in-process, or a subprocess where RLIMIT_NOFILE is lowered), real
sockets, a tiny random-weight checkpoint (64 positions: a generation is short). The proxies'
upstream is one honest reference server.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from lmc.http.json_api import HttpLimits
from tests.deadlines import AT_ONCE_S, HANG_S, SLACK_S
from tests.http.fronts import FRONTS, FrontSpec
from tests.http.kit import (
    BODIES,
    FIELD_ERRORS,
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
from tests.server.daemon_proc import ROOT


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("attacks"))


@pytest.fixture(scope="module")
def want(ckpt) -> list[int]:
    return expected_tokens(ckpt)


@pytest.fixture(scope="module")
def honest(ckpt):
    """The proxies' upstream: a reference server with the ordinary limits."""
    with running_server(ckpt) as srv:
        yield srv


@pytest.fixture(scope="module", params=FRONTS, ids=[f.name for f in FRONTS])
def spec(request) -> FrontSpec:
    return request.param


@contextlib.contextmanager
def serving(spec: FrontSpec, ckpt: Path, upstream: str, limits: HttpLimits) -> Iterator[Any]:
    front = spec.make(ckpt, upstream, limits)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    try:
        yield front
    finally:
        front.close()


@pytest.fixture(scope="module")
def front(spec, ckpt, honest):
    """The front with a short read timeout (the tests that a request is dropped at it)."""
    with serving(spec, ckpt, honest.url, LIMITS) as f:
        yield f


@pytest.fixture(scope="module")
def patient(spec, ckpt, honest):
    """The front with a read timeout only a hang reaches: what must happen before it, at
    once, is told from waiting for it whatever the machine's load."""
    with serving(spec, ckpt, honest.url, PATIENT) as f:
        yield f


def assert_served(spec: FrontSpec, front: Any, want: list[int]) -> None:
    """The ordinary request after an attack: answered, with the right tokens."""
    status, raw = post(front.port, NORMAL)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["token_ids"] == want
    assert spec.alive(front)


# ------------------------------------------------------------------ the request

@pytest.mark.parametrize("header,status,words", [
    (b"Content-Length: -1\r\n", 400, "Content-Length"),
    (b"Content-Length: abc\r\n", 400, "Content-Length"),
    (b"Content-Length: 1e3\r\n", 400, "Content-Length"),
    (b"", 411, "Content-Length required"),
    (b"Transfer-Encoding: chunked\r\n", 411, "Transfer-Encoding"),
    (b"Content-Length: 16777216\r\n", 413, "--max-body"),
    (b"Content-Length: " + b"9" * 5000 + b"\r\n", 413, "--max-body"),
])
def test_lying_content_length_is_answered_at_once_with_the_socket_left_open(
        spec, patient, want, header, status, words):
    """The client sends its headers and keeps the socket open (no body, no FIN): the
    answer must come from the headers alone, before the read timeout."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", patient.port), timeout=HANG_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\n" + header + b"\r\n")
        got, raw = read_answer(s)
    assert got == status and words in message(raw), raw
    assert time.monotonic() - t0 < AT_ONCE_S  # not the read timeout's HANG_S
    assert_served(spec, patient, want)


def test_a_body_over_the_limit_is_refused_before_it_is_read(spec, front, want):
    """16 MiB announced, 64 KiB sent (the limit is 256 KiB): the 413 comes while the
    client is still sending."""
    with socket.create_connection(("127.0.0.1", front.port), timeout=HANG_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % (16 << 20))
        with contextlib.suppress(OSError):
            s.sendall(b"0" * (64 << 10))
        status, raw = read_answer(s)
    assert status == 413 and "--max-body" in message(raw), raw
    assert_served(spec, front, want)


@pytest.mark.parametrize("body,words", [
    (b"[1, 2, 3]", "JSON object"),
    (b"{", "not JSON"),
    (b"\xff\xfe", "not JSON"),
])
def test_a_body_that_is_no_json_object_is_a_400(spec, front, want, body, words):
    got, raw = post(front.port, body)
    assert got == 400 and words in message(raw), raw[:300]
    assert_served(spec, front, want)


@pytest.mark.parametrize("body,field", FIELD_ERRORS,
                         ids=[f"{i}-{f}" for i, (_, f) in enumerate(FIELD_ERRORS)])
def test_bad_values_are_a_400_naming_the_field_and_the_next_request_is_served(
        spec, front, want, body, field):
    """Found by the front itself or by the instance behind it and relayed: the client
    learns which field was wrong either way."""
    status, raw = post(front.port, body)
    assert status == 400 and field in message(raw), raw[:300]
    assert_served(spec, front, want)


# ------------------------------------------------------------------ the socket

@pytest.mark.parametrize("partial", [
    b"POST /v1/comp",  # half a request line
    b"POST /v1/completions HTTP/1.0\r\nContent-Le",  # half the headers
    b"POST /v1/completions HTTP/1.0\r\nContent-Length: 50\r\n\r\n{\"prompt\"",  # half a body
], ids=["request line", "headers", "body"])
def test_a_half_sent_request_is_dropped_after_the_read_timeout(spec, front, want, partial):
    """Dropped (a 408, or just closed) at the read timeout plus ``SLACK_S``, not held until
    the client gives up (``HANG_S``)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", front.port), timeout=HANG_S) as s:
        s.sendall(partial)
        got = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(4096):
                got += chunk
    assert got == b"" or got.startswith(b"HTTP/1.0 408"), got
    assert time.monotonic() - t0 < LIMITS.read_timeout + SLACK_S  # not HANG_S
    assert_served(spec, front, want)


def test_slow_loris_cannot_hold_a_connection_by_trickling(spec, front, want):
    """A byte every 0.1 s keeps each read alive; the deadline is for the whole request
    (the trickle would last 60 s: a connection still open at the read timeout plus
    ``SLACK_S`` was not dropped by it)."""
    t0 = time.monotonic()
    closed = False
    with socket.create_connection(("127.0.0.1", front.port), timeout=HANG_S) as s:
        for b in b"POST /v1/completions HTTP/1.0\r\nX-Pad: " + b"a" * 600:
            try:
                s.sendall(bytes([b]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            if time.monotonic() - t0 > LIMITS.read_timeout + SLACK_S:
                break
        if not closed:
            s.setblocking(False)  # closed by now, or never
            try:
                closed = s.recv(1) == b""
            except BlockingIOError:
                closed = False
            except ConnectionError:
                closed = True
    assert closed
    assert_served(spec, front, want)


def test_at_the_connection_cap_silent_sockets_give_way_to_real_requests(spec, patient, want):
    """3x the cap of connections that never finish their request line: the oldest ones are
    displaced, so a real client is still served at once (no wait for the read timeout)."""
    socks = []
    try:
        for _ in range(3 * PATIENT.max_connections):
            s = socket.create_connection(("127.0.0.1", patient.port), timeout=HANG_S)
            s.sendall(b"POST /v1/comp")
            socks.append(s)
        t0 = time.monotonic()
        assert_served(spec, patient, want)
        assert time.monotonic() - t0 < AT_ONCE_S  # not the read timeout's HANG_S
        assert len(patient.httpd.conns) <= patient.httpd.cap
    finally:
        for s in socks:
            s.close()


def test_a_flood_at_nofile_128_leaves_the_front_serving_everyone(spec, ckpt, honest, want,
                                                                 tmp_path):
    """The front in its own process at RLIMIT_NOFILE 128 (the issue's setting): 300 half-
    sent request lines, then ordinary clients are served, ordinary mistakes are a 400, and
    the process still runs with neither EMFILE nor a traceback in its log. Its read timeout
    is one only a hang reaches, so the silent sockets are never freed by it: the clients get
    in through the connection cap alone (its room kept under RLIMIT_NOFILE, silent senders
    displaced)."""
    log = tmp_path / "front.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, *spec.argv(ckpt, honest.url), "--read-timeout", str(10 * HANG_S)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=err,
            text=True, preexec_fn=low_nofile)
        try:
            port = serving_port(proc, log)
        except BaseException:
            proc.kill()
            proc.wait(30)
            raise
        flood_then_serve(proc, port, log, want, [body for body, _ in FIELD_ERRORS])


def serving_port(proc: subprocess.Popen, log: Path) -> int:
    """The port of the ``... at http://HOST:PORT`` line a front prints once it serves."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r" at http://[\d.]+:(\d+)", line):
            return int(m.group(1))
    raise AssertionError(f"the front ended without serving: {log.read_text()[-2000:]}")


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(BODIES)
def test_fuzz_the_front_answers_200_or_a_4xx_with_a_message(spec, front, body):
    """Random bodies: a whole answer (a stream ending in ``[DONE]`` with no error in it),
    or a 4xx with a message; the front still serves."""
    status, raw = post(front.port, json.dumps(body).encode())
    if status == 200:
        if raw.startswith(b"data: "):
            assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, raw[-300:]
        else:
            assert json.loads(raw)["choices"], raw
    else:
        assert 400 <= status < 500 and message(raw), (status, raw[:300])
    assert spec.alive(front)


# ------------------------------------------------------------------ the limits

@pytest.mark.parametrize("kw,words", [
    ({"max_connections": 0}, "max_connections"), ({"read_timeout": 0}, "read_timeout"),
    ({"read_timeout": math.inf}, "read_timeout"), ({"read_timeout": math.nan}, "read_timeout"),
    ({"max_body": 0}, "max_body")])
def test_limits_out_of_range_are_refused_by_name(kw, words):
    with pytest.raises(ValueError, match=words):
        HttpLimits(**kw)
