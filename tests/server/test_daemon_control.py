"""The daemon's cache control (CLEAR, PIN, UNPIN, PRIORITY; lmc/server/control.py) on real
daemons: scoped to the token's namespaces, bounded with named refusals, pins that outlive
eviction pressure until their TTL, a clear that reaches memory and disk and leaves other
namespaces alone, malformed requests answered and the connection kept. Threat model:
docs/threats/daemon.md."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator

import pytest
import yaml

from lmc.server.daemon import Daemon
from lmc.server.server_config import ServerConfig
from lmc.storage.backends.server import protocol as P
from lmc.storage.control import PinLimitError, TTLError
from tests.deadlines import HANG_S
from tests.server import wire as W
from tests.server.daemon_proc import DaemonProc, free_port

pytestmark = pytest.mark.integration
BIG = dict(tokens=64, width=1024)  # 256 KiB values: a few fill a small pool


def _keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def _authed(d: DaemonProc, secret: str | None) -> W.RawClient:
    c = W.RawClient(d.port, timeout=HANG_S)
    status, meta, _ = c.call(W.hello(secret))
    assert status == P.OK, meta
    return c


def _put(c: W.RawClient, ns: str, keys: list[bytes], **kw) -> None:
    status, meta, _ = c.call(W.put(ns, [W.value_bytes(ns, k, **kw) for k in keys]))
    assert status == P.OK and meta["results"] == bytes(len(keys)), meta


def _present(c: W.RawClient, ns: str, keys: list[bytes]) -> list[int]:
    status, meta, _ = c.call(W.frame(P.EXISTS, {"ns": ns, "keys": keys}))
    assert status == P.OK, meta
    return list(meta["present"])


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    """A daemon with a disk tier and three tokens: alpha (alpha, shared), beta, an admin."""
    tmp = tmp_path_factory.mktemp("ctl")
    secrets = {n: f"{n}-{os.urandom(8).hex()}" for n in ("alpha", "beta", "ops")}
    for n, sec in secrets.items():
        (tmp / f"{n}.token").write_text(sec + "\n")
    cfg = tmp / "d.yaml"
    cfg.write_text(yaml.safe_dump({
        "tokens": [{"token_file": str(tmp / "alpha.token"), "namespaces": ["alpha", "shared"]},
                   {"token_file": str(tmp / "beta.token"), "namespaces": ["beta"]},
                   {"token_file": str(tmp / "ops.token"), "admin": True}],
        "max_pins": 4, "max_pin_ttl": "60s"}))
    d = DaemonProc(tmp / "d", ["--config", str(cfg), "--size", "64MiB",
                               "--disk", str(tmp / "disk"), "--disk-size", "64MiB"]).start()
    yield d, secrets
    try:
        d.audit()
    finally:
        d.kill()


def test_a_tenant_cannot_clear_pin_unpin_prioritise_or_delete_another(tenants):
    d, sec = tenants
    keys = _keys(1, 3)
    beta = _authed(d, sec["beta"])
    _put(beta, "beta", keys)
    alpha = _authed(d, sec["alpha"])
    for req in (W.frame(P.CLEAR, {"ns": "beta"}),
                W.frame(P.PIN, {"ns": "beta", "keys": keys, "ttl": 10}),
                W.frame(P.UNPIN, {"ns": "beta", "keys": keys}),
                W.frame(P.PRIORITY, {"ns": "beta", "keys": keys, "priority": -10}),
                W.frame(P.DELETE, {"ns": "beta", "keys": keys}),
                W.frame(P.CLEAR, {"ns": ""})):
        status, meta, _ = alpha.call(req)
        assert status == P.FORBIDDEN and "does not grant namespace" in meta["error"], meta
    assert _present(beta, "beta", keys) == [1, 1, 1]
    alpha.close()
    beta.close()


def test_clear_reaches_memory_and_disk_and_leaves_other_namespaces(tenants):
    d, sec = tenants
    alpha = _authed(d, sec["alpha"])
    beta = _authed(d, sec["beta"])
    mine, theirs = _keys(2, 4), _keys(3, 4)
    _put(alpha, "alpha", mine)
    _put(alpha, "shared", mine)
    _put(beta, "beta", theirs)
    # the disk tier has them too (write-behind): wait, bounded, for its count to grow
    end = time.monotonic() + HANG_S
    while d.stats(sec["ops"])["tiers"].get("disk.chunks", 0) < 12:
        assert time.monotonic() < end, d.stats(sec["ops"])["tiers"]
        time.sleep(0.05)
    status, meta, _ = alpha.call(W.frame(P.CLEAR, {"ns": "alpha"}))
    assert status == P.OK and meta["deleted"] >= 8, meta  # 4 in memory and 4 on disk
    assert _present(alpha, "alpha", mine) == [0] * 4
    assert _present(alpha, "shared", mine) == [1] * 4
    assert _present(beta, "beta", theirs) == [1] * 4
    # a GET after the clear finds nothing on disk either (no promotion back)
    status, meta, _ = alpha.call(W.frame(P.GET, {"ns": "alpha", "keys": mine}))
    assert status == P.OK and meta["items"] == [None] * 4, meta
    assert "cleared namespace alpha" in d.log()
    alpha.close()
    beta.close()


def test_pin_bounds_refuse_with_the_rules_code_and_keep_the_connection(tenants):
    d, sec = tenants
    alpha = _authed(d, sec["alpha"])
    keys = _keys(4, 6)
    _put(alpha, "alpha", keys)
    status, meta, _ = alpha.call(W.frame(P.PIN, {"ns": "alpha", "keys": keys, "ttl": 10}))
    assert status == P.REFUSED and meta["code"] == "pin_limit", meta
    assert "past the bound of 4 chunks" in meta["error"]
    status, meta, _ = alpha.call(W.frame(P.PIN, {"ns": "alpha", "keys": keys[:2], "ttl": 61}))
    assert status == P.REFUSED and meta["code"] == "ttl", meta
    status, meta, _ = alpha.call(W.frame(P.PIN, {"ns": "alpha", "keys": keys[:2], "ttl": 5,
                                                 "priority": 99}))
    assert status == P.REFUSED and meta["code"] == "priority", meta
    for bad in ({"ttl": "5"}, {"ttl": True}, {}, {"ttl": 5, "owner": b""},
                {"ttl": 5, "owner": b"x" * 65}, {"ttl": 5, "owner": "text"},
                {"ttl": 5, "priority": 1.5}, {"ttl": 5, "priority": False}):
        status, meta, _ = alpha.call(W.frame(P.PIN, {"ns": "alpha", "keys": keys, **bad}))
        assert status == P.BAD_REQUEST, (bad, meta)
    status, meta, _ = alpha.call(W.frame(P.PRIORITY, {"ns": "alpha", "keys": keys}))
    assert status == P.BAD_REQUEST and "priority" in meta["error"], meta
    status, meta, _ = alpha.call(W.frame(P.PIN, {"ns": "alpha", "keys": keys[:4], "ttl": 5,
                                                 "owner": b"session-1"}))
    assert status == P.OK and meta["pinned"] == 4, meta
    status, meta, _ = alpha.call(W.frame(P.UNPIN, {"ns": "alpha", "owner": b"session-1"}))
    assert status == P.OK and meta["unpinned"] == 4, meta
    alpha.close()


def test_the_client_raises_the_named_errors(tenants):
    d, sec = tenants
    c = d.connect(sec["alpha"])
    try:
        with pytest.raises(TTLError, match="max_pin_ttl 60 s"):
            c.pin("alpha", _keys(5, 1), 600)
        with pytest.raises(PinLimitError):
            c.pin("alpha", _keys(4, 6), 5)
        assert c.clear("alpha") >= 0
    finally:
        c.close()


@contextlib.contextmanager
def _daemon_with_clock(now: list[float], **cfg) -> Iterator[Daemon]:
    """A daemon in this process (its asyncio loop on a thread, a real TCP listener) whose
    pins' TTLs run on ``now[0]``, moved by the test: expiry is whatever the test says,
    never how fast a loaded machine gets through the flood."""
    d = Daemon(ServerConfig(port=free_port(), prefault=False, hugepages=False,
                            metrics_port=None, **cfg), clock=lambda: now[0])
    loops: list[asyncio.AbstractEventLoop] = []

    def main() -> None:
        async def run() -> None:
            loops.append(asyncio.get_running_loop())
            await d.serve()
        asyncio.run(run())

    t = threading.Thread(target=main, daemon=True, name="daemon-under-test")
    t.start()
    end = time.monotonic() + HANG_S
    while not loops:
        assert t.is_alive() and time.monotonic() < end, "the daemon's loop did not start"
        time.sleep(0.01)
    try:
        yield d
    finally:
        loops[0].call_soon_threadsafe(d.request_stop)
        t.join(HANG_S)
        assert not t.is_alive(), "the daemon did not stop"
        assert d.pool.leaks == [], "the daemon leaked pool objects"


def test_pins_outlive_eviction_pressure_until_their_ttl_and_not_after():
    """A 4 MiB daemon (16 values of 256 KiB), no disk: pinned values stay through a flood of
    64 others while the pins' clock stays short of the TTL; once it passes, the watchdog
    releases them and a flood evicts them."""
    now = [0.0]
    with _daemon_with_clock(now, size="4MiB", max_pin_ttl="30s") as d:
        c = W.RawClient(d.config.port, timeout=HANG_S)
        status, meta, _ = c.call(W.hello(None))
        assert status == P.OK, meta
        pinned = _keys(6, 4)
        _put(c, "p", pinned, **BIG)
        status, meta, _ = c.call(W.frame(P.PIN, {"ns": "p", "keys": pinned, "ttl": 10.0}))
        assert status == P.OK and meta["pinned"] == 4, meta
        for i in range(8):  # 64 values through 16 slots, the clock moving up to 9.6 s
            now[0] += 1.2
            _put(c, "p", _keys(100 + i, 8), **BIG)
            assert _present(c, "p", pinned) == [1] * 4, f"evicted at t={now[0]:.1f} s"
        assert d.pins.stats()["p"]["pinned_chunks"] == 4
        assert d.stats()["tiers"]["cpu.evictions"] >= 48, "the flood evicted nothing"
        now[0] = 10.5  # past the TTL: the watchdog's next sweep (each second) releases them
        end = time.monotonic() + HANG_S
        while d.pins.stats()["p"]["pinned_chunks"]:
            assert time.monotonic() < end, "the watchdog never released the expired pins"
            time.sleep(0.05)
        assert d.pins.stats()["p"]["pins_expired"] == 4
        for i in range(8):
            _put(c, "p", _keys(120 + i, 8), **BIG)
        assert _present(c, "p", pinned) == [0] * 4, "expired pins still held their values"
        c.close()


def test_pins_are_never_evicted_for_the_namespace_quota():
    now = [0.0]  # the pins' clock stays put: they hold for the whole test, however slow
    with _daemon_with_clock(now, size="16MiB", quota_default="2MiB") as d:
        c = W.RawClient(d.config.port, timeout=HANG_S)
        status, meta, _ = c.call(W.hello(None))
        assert status == P.OK, meta
        pinned = _keys(7, 3)
        _put(c, "q", pinned, **BIG)
        status, meta, _ = c.call(W.frame(P.PIN, {"ns": "q", "keys": pinned, "ttl": 60}))
        assert status == P.OK and meta["pinned"] == 3, meta
        for i in range(6):  # 6 x 4 values of 256 KiB through a 2 MiB quota
            status, meta, _ = c.call(W.put("q", [W.value_bytes("q", k, **BIG)
                                                 for k in _keys(130 + i, 4)]))
            assert status == P.OK, meta
        assert _present(c, "q", pinned) == [1] * 3, "the quota evicted pinned values"
        status, meta, _ = c.call(W.frame(P.DELETE, {"ns": "q", "keys": pinned}))
        assert status == P.OK and meta["deleted"] == 3
        assert d.pins.stats()["q"]["pinned_chunks"] == 0  # gone with the values
        c.close()
