"""The relay both fronts share (``lmc.router.relay``), attacked through each: ``lmc router`` and
``lmc pd-proxy`` (its decode side) in front of a scripted instance give the client the same
answer to the same lie -- a status that is no HTTP status, a refusal past ``--max-body``, a
refusal cut short (502s naming the instance); a refusal within bounds relayed as is; header
values with control characters dropped; ``/v1/models`` relayed. Threat models:
docs/threats/http.md, docs/threats/router.md."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from lmc.router.app import InstanceSpec, Router
from lmc.router.pd_proxy import Proxy
from tests.http.kit import (
    LIMITS,
    NORMAL,
    exchange,
    message,
    post,
    running_server,
    tiny_model,
)
from tests.router.test_router_attacks import Liar


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    with running_server(tiny_model(tmp_path_factory.mktemp("relay"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def liar():
    up = Liar()
    yield up
    up.close()


@pytest.fixture(params=["router", "pd-proxy"])
def front(request, honest, liar) -> Iterator[Router | Proxy]:
    if request.param == "router":
        f: Router | Proxy = Router([InstanceSpec(liar.url)], limits=LIMITS, health_interval=60,
                                   upstream_timeout=2.0)
        who = f"instance {liar.url}"
    else:
        f = Proxy([honest.url], [liar.url], limits=LIMITS, upstream_timeout=2.0)
        who = f"decode instance {liar.url}"
    f.who = who  # type: ignore[union-attr]
    threading.Thread(target=f.serve_forever, daemon=True).start()
    yield f
    f.close()


def answer(status: str, body: bytes, headers: bytes = b"") -> bytes:
    return (b"HTTP/1.0 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (status.encode(), len(body), headers, body))


def raw_answer(port: int, path: bytes = b"/v1/completions") -> tuple[bytes, bytes]:
    data = json.dumps(NORMAL).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST %s HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (path, len(data), data))
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.parametrize("lie,words", [
    (b"HTTP/1.0 999 Odd\r\nContent-Length: 2\r\n\r\n{}", "answered status 999"),
    (answer("400 Bad Request", b'{"e": "' + b"x" * (300 << 10) + b'"}'), "more than"),
    (answer("503 Busy", b'{"error": 1}')[:-3], "cut short"),
])
def test_an_instance_lying_in_its_answer_is_a_502_naming_it(front, liar, lie, words):
    liar.answer = lie
    status, raw = post(front.port, NORMAL)
    assert status == 502 and front.who in message(raw) and words in message(raw), raw[:300]


def test_a_refusal_within_bounds_is_relayed_as_it_came(front, liar):
    body = b'{"error": {"message": "prompt too long", "code": 400}}'
    liar.answer = answer("400 Bad Request", body, b"Content-Type: application/x-odd\r\n")
    head, got = raw_answer(front.port)
    assert head.startswith(b"HTTP/1.0 400") and got == body, (head, got)


def test_header_values_with_control_characters_are_dropped(front, liar):
    body = b'{"ok": true}'
    liar.answer = (b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\x01x\r\n"
                   b"Cache-Control: no-cache\r\nContent-Length: %d\r\nX-Secret: 1\r\n\r\n%s"
                   % (len(body), body))
    head, got = raw_answer(front.port)
    assert head.startswith(b"HTTP/1.0 200") and got == body
    assert b"\x01" not in head and b"X-Secret" not in head and b"Cache-Control: no-cache" in head


def test_models_are_relayed(front, liar):
    """The scripted instance answers every GET ``{}``: relayed whole."""
    status, raw = exchange(front.port, b"GET /v1/models HTTP/1.0\r\n\r\n")
    assert status == 200 and raw == b"{}"


def test_only_the_two_completion_paths_are_relayed(front):
    head, got = raw_answer(front.port, b"/v1/embeddings")
    assert head.startswith(b"HTTP/1.0 404") and b"no such path" in got
