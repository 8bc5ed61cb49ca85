"""The reference server's cache-control endpoints (``POST /admin/cache/<op>``,
lmc/reference/admin.py, lmc/http/admin.py) on a real server with lmc's connector: a prompt
served, then pinned, prioritised, deleted and cleared over HTTP; loopback-only without a
token, bearer tokens scoped to namespaces with one, every field checked, a rule's refusal
answered with its status and code, and ordinary requests served after every attack.
Threat model: docs/threats/http.md."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from lmc.connectors.reference.connector import LMCReferenceConnector
from lmc.http.admin import AdminAuth, AdminToken
from lmc.reference import LLM
from lmc.reference.serve import Server
from tests.http.kit import NORMAL, PATIENT, PROMPT, exchange, post, tiny_model

SECRETS = {"a": "team-a-secret-0123456789", "b": "team-b-secret-0123456789",
           "ops": "operator-secret-0123456789"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("admin"))


def _serve(ckpt: Path, auth: AdminAuth | None = None, **cfg) -> Server:
    conn = LMCReferenceConnector({"chunk_size": 4, "local_cpu_size": "8MiB",
                                  "local_cpu_prefault": "off", "pin_memory": "false",
                                  "max_pin_ttl": "60s", **cfg}, model_dir=ckpt)
    srv = Server(LLM(ckpt, num_blocks=32, kv_connector=conn), limits=PATIENT,
                 admin_auth=auth)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture(scope="module")
def server(ckpt):
    srv = _serve(ckpt)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def tokened(ckpt, tmp_path_factory):
    """A server of namespace team-a with three tokens: team-a's, team-b's, an operator's."""
    d = tmp_path_factory.mktemp("tokens")
    for n, sec in SECRETS.items():
        (d / n).write_text(sec + "\n")
    auth = AdminAuth([AdminToken.parse(f"{d / 'a'}:team-a"),
                      AdminToken.parse(f"{d / 'b'}:team-b"),
                      AdminToken.parse(f"{d / 'ops'}:admin")])
    srv = _serve(ckpt, auth, tenant="team-a")
    yield srv
    srv.close()


def admin(port: int, op: str, body: dict | bytes, token: str | None = None
          ) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = f"POST /admin/cache/{op} HTTP/1.0\r\nContent-Length: {len(data)}\r\n"
    if token is not None:
        head += f"Authorization: Bearer {token}\r\n"
    status, raw = exchange(port, head.encode() + b"\r\n" + data)
    return status, json.loads(raw) if raw else {}


def _engine(srv: Server):
    return srv.llm.kv_connector.engine


def _served(srv: Server) -> None:
    status, raw = post(srv.port, NORMAL)
    assert status == 200, raw


def test_pin_priority_delete_clear_over_http(server):
    _served(server)  # stores the prompt's chunks
    eng = _engine(server)
    assert eng.lookup(PROMPT) >= 4
    status, out = admin(server.port, "pin", {"prompt": PROMPT, "ttl": 30, "priority": 3,
                                             "session": "s1"})
    assert status == 200 and out["pinned_tokens"] >= 4, out
    assert eng.stats()["ttl_pinned_chunks"] >= 1
    status, out = admin(server.port, "priority", {"prompt": PROMPT, "priority": -2})
    assert status == 200 and out["chunks"] >= 1, out
    status, out = admin(server.port, "unpin", {"session": "s1"})
    assert status == 200 and out["unpinned_chunks"] >= 1, out
    status, out = admin(server.port, "delete", {"prompt": PROMPT})
    assert status == 200 and out["deleted"] >= 1, out
    assert eng.lookup(PROMPT) == 0
    _served(server)
    status, out = admin(server.port, "clear", {})
    assert status == 200 and out["cleared"]["cpu"] >= 1, out
    assert eng.lookup(PROMPT) == 0
    status, out = admin(server.port, "prefetch", {"prompt": PROMPT})
    assert status == 200 and out["queued"], out
    _served(server)


def test_every_field_is_checked_and_named(server):
    bad = [("pin", {"prompt": PROMPT}, "ttl"),
           ("pin", {"prompt": PROMPT, "ttl": "5"}, "ttl"),
           ("pin", {"ttl": 5}, "needs a prompt"),
           ("pin", {"prompt": PROMPT, "ttl": 5, "priority": 1.5}, "priority"),
           ("delete", {"prompt": [-1]}, "uint32"),
           ("delete", {"prompt": [True]}, "uint32"),
           ("delete", {"prompt": PROMPT, "ttl": 3}, "ttl is for pin"),
           ("delete", {"prompt": PROMPT, "cache_salt": 7}, "cache_salt"),
           ("delete", {"prompt": PROMPT, "session": "x" * 257}, "session"),
           ("delete", {"prompt": PROMPT, "sneaky": 1}, "unknown field 'sneaky'"),
           ("delete", {"prompt": PROMPT, "messages": [{"role": "user", "content": "hi"}]},
            "not both"),
           ("priority", {"prompt": PROMPT}, "priority"),
           ("unpin", {}, "needs a prompt"),
           ("clear", [], "JSON object"),
           ("delete", {"prompt": list(range(100))}, "max_model_len")]
    for op, body, words in bad:
        status, out = admin(server.port, op, body)
        assert status == 400 and words in out["error"]["message"], (op, body, out)
    status, out = admin(server.port, "explode", {})
    assert status == 404 and "/admin/cache/<pin|" in out["error"]["message"]
    status, raw = exchange(server.port, b"POST /admin/cache/pin HTTP/1.0\r\n"
                                        b"Content-Length: 5\r\n\r\n{\"a\":")
    assert status == 400
    _served(server)


def test_rule_refusals_carry_their_status_and_code(server):
    _served(server)
    for body, status_want, rule in (
            ({"prompt": PROMPT, "ttl": 61}, 400, "ttl"),
            ({"prompt": PROMPT, "ttl": 0}, 400, "ttl"),
            ({"prompt": PROMPT, "ttl": 5, "priority": 11}, 400, "priority"),
            ({"prompt": PROMPT, "ttl": 5, "namespace": "elsewhere"}, 403, "namespace")):
        status, out = admin(server.port, "pin", body)
        assert status == status_want and out["error"]["rule"] == rule, (body, out)
    assert _engine(server).stats()["ttl_pinned_chunks"] == 0


def test_the_pin_bound_is_409(ckpt):
    srv = _serve(ckpt, max_ttl_pins=1)
    try:
        _served(srv)
        status, out = admin(srv.port, "pin", {"prompt": PROMPT, "ttl": 5})
        assert status == 409 and out["error"]["rule"] == "pin_limit", out
        assert "past the bound of 1 chunks" in out["error"]["message"]
    finally:
        srv.close()


def test_tokens_scope_namespaces_and_loopback_needs_one_too(tokened):
    _served(tokened)
    eng = _engine(tokened)
    assert eng.namespace == "team-a"
    status, out = admin(tokened.port, "clear", {})  # a token is needed even on loopback
    assert status == 401 and "Bearer" in out["error"]["message"]
    status, out = admin(tokened.port, "clear", {}, token="not-the-secret-at-all")
    assert status == 401 and "wrong admin token" in out["error"]["message"]
    for op, body in (("clear", {}), ("delete", {"prompt": PROMPT}),
                     ("pin", {"prompt": PROMPT, "ttl": 5}),
                     ("clear", {"namespace": "team-a"})):
        status, out = admin(tokened.port, op, body, token=SECRETS["b"])  # team-b's token
        assert status == 403 and "does not grant namespace 'team-a'" in \
            out["error"]["message"], (op, out)
    status, out = admin(tokened.port, "clear", {"namespace": "team-b"}, token=SECRETS["b"])
    assert status == 403 and out["error"]["rule"] == "namespace", out  # not this engine's
    assert eng.lookup(PROMPT) >= 4, "a refused request changed the cache"
    status, out = admin(tokened.port, "pin", {"prompt": PROMPT, "ttl": 5}, token=SECRETS["a"])
    assert status == 200 and out["pinned_tokens"] >= 4, out
    status, out = admin(tokened.port, "clear", {}, token=SECRETS["ops"])
    assert status == 200, out
    assert eng.lookup(PROMPT) == 0


def test_a_client_off_loopback_is_refused_without_a_token():
    auth = AdminAuth()
    grant = auth.check("127.0.0.1", None)
    assert grant.allows("anything") and auth.check("::1", None).allows("x")
    for host in ("10.0.0.7", "192.168.1.2", "2001:db8::1", "not-an-address"):
        with pytest.raises(Exception, match="loopback clients only"):
            auth.check(host, None)


def test_token_files_are_checked(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        AdminToken.parse(str(short))
    with pytest.raises(ValueError, match="cannot read it"):
        AdminToken.parse(str(tmp_path / "missing"))
    ok = tmp_path / "ok"
    ok.write_text("x" * 20)
    assert AdminToken.parse(f"{ok}:a,b").grant.namespaces == {"a", "b"}
    assert AdminToken.parse(f"{ok}:admin").grant.namespaces is None


def test_a_caller_is_refused_before_its_body_is_read(tokened):
    """A wrong token with a huge announced body: 401 at once (a server reading the body
    first would wait for it until the read timeout and answer 408 or 413)."""
    head = (b"POST /admin/cache/clear HTTP/1.0\r\nContent-Length: 1000\r\n"
            b"Authorization: Bearer wrong-wrong-wrong-wrong\r\n\r\n")
    status, raw = exchange(tokened.port, head)
    assert status == 401, raw
    status, raw = exchange(tokened.port, b"POST /admin/cache/clear HTTP/1.0\r\n"
                                         b"Content-Length: 999999999999\r\n\r\n")
    assert status == 401, raw
    _served(tokened)
