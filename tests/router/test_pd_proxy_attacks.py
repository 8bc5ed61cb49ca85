"""``lmc pd-proxy`` attacked where only a proxy can be: a prefill or decode instance that
answers garbage (a JSON array, no JSON, a wrong ``kv_transfer_params``, a cut body, a bad
status line, nothing at all, too much) is a 502 naming the instance, and the next request
through the proxy is served; a client's mistake the prefill instance finds is relayed as
the 4xx it is; past the connection cap with every request in flight (nothing to displace)
a newcomer gets a 503 at once. What every HTTP front must withstand from its clients is
``tests/http/test_attacks.py``, which runs against the proxy too.
Threat model: docs/threats/http.md.

The honest instance is the reference engine's server (``lmc.reference.serve``, in-process,
no lmc: the prefill answers no ``kv_transfer_params`` and the decode side prefills itself);
the lying one is a raw socket server scripted per test. No NIXL needed.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from lmc.http.json_api import HttpLimits
from lmc.router.pd_proxy import Proxy
from tests.deadlines import HANG_S, SLACK_S
from tests.http.kit import (
    LIMITS,
    NORMAL,
    Liar,
    expected_tokens,
    http200,
    message,
    post,
    running_server,
    tiny_model,
)


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
