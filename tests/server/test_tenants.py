"""Namespaces as an access boundary: a tenant token grants its own namespaces only (reads,
writes, probes, deletes and STATS), an admin token sees everything, and a daemon never
starts with an empty token. Threat model: docs/threats/daemon.md."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from lmc.server.auth import Authenticator, Grant, parse_tokens
from lmc.server.server_config import ServerConfig
from lmc.storage.backends.server import protocol as P
from lmc.storage.tier import create_backend
from tests.server import wire as W
from tests.server.daemon_proc import DaemonProc, client_pool

pytestmark = pytest.mark.integration
KEYS = [bytes([7, i]) * 8 for i in range(3)]


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    """A daemon with quotas on and three tokens: alpha (namespaces alpha, shared), beta
    (beta) and an admin. Returns (daemon, {name: secret})."""
    tmp_path = tmp_path_factory.mktemp("tenants")
    secrets = {n: f"{n}-{os.urandom(8).hex()}" for n in ("alpha", "beta", "ops")}
    files = {}
    for n, sec in secrets.items():
        files[n] = tmp_path / f"{n}.token"
        files[n].write_text(sec + "\n")
    cfg = tmp_path / "tenants.yaml"
    cfg.write_text(yaml.safe_dump({
        "quota_default": "8MiB",
        "tokens": [{"token_file": str(files["alpha"]), "namespaces": ["alpha", "shared"]},
                   {"token_file": str(files["beta"]), "namespaces": ["beta"]},
                   {"token_file": str(files["ops"]), "admin": True, "name": "ops"}]}))
    d = DaemonProc(tmp_path / "d", ["--config", str(cfg), "--size", "64MiB"]).start()
    yield d, secrets
    d.kill()


def _authed(d: DaemonProc, secret: str) -> W.RawClient:
    c = W.RawClient(d.port)
    status, meta, _ = c.call(W.hello(secret))
    assert status == P.OK, meta
    return c


def test_tenant_token_grants_its_namespaces_only(tenants):
    d, sec = tenants
    for who in ("alpha", "beta"):
        c = _authed(d, sec[who])
        vals = [W.value_bytes(who, k) for k in KEYS]
        status, meta, _ = c.call(W.put(who, vals))
        assert status == P.OK and meta["results"] == bytes(3), meta
        c.close()
    alpha = W.RawClient(d.port)
    status, meta, _ = alpha.call(W.hello(sec["alpha"]))
    assert meta["namespaces"] == ["alpha", "shared"]  # a tenant learns what it may use
    beta_vals = [W.value_bytes("beta", k) for k in KEYS]
    refused = [W.frame(P.GET, {"ns": "beta", "keys": KEYS}),
               W.frame(P.EXISTS, {"ns": "beta", "keys": KEYS}),
               W.frame(P.EXISTS, {"ns": "beta", "keys": KEYS, "prefix": True}),
               W.frame(P.DELETE, {"ns": "beta", "keys": KEYS}),
               W.put("beta", beta_vals),            # its payload is read and discarded
               W.frame(P.GET, {"ns": "", "keys": KEYS})]   # the default namespace too
    for req in refused:
        status, meta, payload = alpha.call(req)
        assert status == P.FORBIDDEN and "does not grant namespace" in meta["error"], meta
        assert payload == b""
    status, _, _ = alpha.call(W.frame(P.PING, {}))
    assert status == P.OK, "a forbidden request leaves the connection usable"
    status, meta, _ = alpha.call(W.frame(P.EXISTS, {"ns": "alpha", "keys": KEYS}))
    assert status == P.OK and meta["present"] == b"\x01\x01\x01"
    alpha.close()
    # beta's values survived alpha's DELETE attempt, and the admin reads them bit-exact
    ops = _authed(d, sec["ops"])
    status, meta, payload = ops.call(W.frame(P.GET, {"ns": "beta", "keys": KEYS}))
    assert status == P.OK and payload == b"".join(p for _, p in beta_vals)
    ops.close()
    log = d.log()
    assert all(s not in log for s in sec.values()), "a token reached the log"


def test_stats_shows_a_tenant_its_own_namespaces(tenants):
    d, sec = tenants
    for who in ("alpha", "beta"):
        c = _authed(d, sec[who])
        assert c.call(W.put(who, [W.value_bytes(who, KEYS[0])]))[0] == P.OK
        c.close()
    assert set(d.stats(token=sec["alpha"])["namespaces"]) == {"alpha"}
    assert set(d.stats(token=sec["beta"])["namespaces"]) == {"beta"}
    assert set(d.stats(token=sec["ops"])["namespaces"]) == {"alpha", "beta"}
    conn = d.connect(token=sec["alpha"])
    assert conn.namespaces == ["alpha", "shared"]  # the client learns its grant at HELLO
    conn.close()
    conn = d.connect(token=sec["ops"])
    assert conn.namespaces is None
    conn.close()


def test_tier_with_an_ungranted_namespace_misses(tenants):
    """Through the engine's tier: a namespace the token does not grant is a miss (and a
    clear log line), never an exception and never another tenant's data."""
    d, sec = tenants
    cfg, pool = client_pool("8MiB")
    good = create_backend(d.url + "?ns=beta", cfg.replace(remote_token=sec["beta"]), pool)
    o = pool.allocate((1, 2, 8, 64), torch.float16, 8)
    o.tensor.fill_(1.5)
    assert good.put(KEYS[:1], [o]) == 1
    good.close()
    thief = create_backend(d.url + "?ns=beta", cfg.replace(remote_token=sec["alpha"]), pool)
    assert thief.contains(KEYS[:1]) == [False]
    assert thief.get(KEYS[:1]) == [None]
    assert thief.put(KEYS[:1], [o]) == 0
    thief.close()
    o.release()
    assert pool.used_bytes == 0


def test_wrong_token_and_bad_hello_close_the_connection(tenants):
    d, _ = tenants
    for req in (W.hello("not-a-token"), W.hello(None),
                W.frame(P.HELLO, {"client": "x", "token": 12345}),   # wrong type
                W.frame(P.HELLO, {"token": ["x"]})):
        c = W.RawClient(d.port)
        got = c.call(req)
        assert got[0] in (P.AUTH_FAILED, P.BAD_REQUEST), got
        assert c.at_eof(5), "a failed HELLO must close the connection"
        c.close()


# ------------------------------------------------------------ start-up refusals
@pytest.mark.parametrize("flags,env", [(["--token", ""], {}), ([], {"LMC_SERVER_TOKEN": ""})])
def test_daemon_refuses_to_start_with_an_empty_token(tmp_path, flags, env):
    d = DaemonProc(tmp_path / "d", ["--size", "16MiB", *flags], env=env)
    with pytest.raises(RuntimeError, match="exited with 2") as e:
        d.start(timeout=30)
    assert "token: is empty" in str(e.value)


@pytest.mark.parametrize("kv,match", [
    ({"token": "   "}, "token: is empty"), ({"token_file": ""}, "token_file: is empty"),
    ({"host": "0.0.0.0"}, "not loopback and no token"),
    ({"tokens": [{"token": "", "namespaces": ["a"]}]}, r"tokens\[0\].token: is empty"),
])
def test_config_refuses_what_would_leave_the_daemon_open(kv, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig.load(overrides=kv, environ={})


def test_empty_token_file_in_tokens_refused(tmp_path):
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    cfg = ServerConfig.load(overrides={"tokens": [f"{empty}:a"]}, environ={})
    with pytest.raises(ValueError, match="is empty"):
        cfg.authenticator()


def test_open_daemon_says_so(shared_daemon):
    assert "WARNING" in shared_daemon.log() and "no token configured" in shared_daemon.log()


# ---------------------------------------------------------------- in-process
def test_token_parsing_and_lookup(tmp_path):
    with pytest.raises(ValueError, match="exactly one of token and token_file"):
        parse_tokens([{"namespaces": ["a"]}], "tokens")
    with pytest.raises(ValueError, match="either admin"):
        parse_tokens([{"token": "x", "namespaces": []}], "tokens")
    with pytest.raises(ValueError, match="unknown key"):
        parse_tokens([{"token": "x", "namespace": ["a"]}], "tokens")
    with pytest.raises(ValueError, match="names must be unique"):
        parse_tokens([{"token": "x", "namespaces": ["a"]}, {"token": "y", "namespaces": ["a"]}],
                     "tokens")
    with pytest.raises(ValueError, match="same secret"):
        Authenticator([("s", Grant("a")), ("s", Grant("b"))])
    specs = parse_tokens([{"token": "ta", "namespaces": ["a"]},
                          {"token": "tb", "namespaces": ["b", "c"], "name": "team-b"}], "tokens")
    auth = Authenticator.from_config("root", specs)
    assert auth.check(b"root").admin
    assert auth.check(b"tb") == Grant("team-b", False, frozenset({"b", "c"}))
    assert auth.check(b"tb").allows("c") and not auth.check(b"tb").allows("a")
    assert auth.check(b"t") is None and auth.check(b"") is None
    assert auth.granted_namespaces() == {"a", "b", "c"}


def test_tokens_from_the_environment():
    env = {"LMC_SERVER_TOKENS": "[{token_file: /run/a.token, namespaces: [a, b]}]"}
    [spec] = ServerConfig.load(environ=env).tokens
    assert (spec.token_file, spec.namespaces, spec.admin) == ("/run/a.token", ("a", "b"), False)
    [spec] = ServerConfig.load(environ={"LMC_SERVER_TOKENS": "/run/ops.token:admin"}).tokens
    assert spec.admin and spec.token_file == "/run/ops.token"
