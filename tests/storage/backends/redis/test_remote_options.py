"""A remote tier that cannot work says so at start, not by serving misses in silence: URL
options neither lmc nor redis-py takes are refused with the closest name; a server that does
not answer at start-up gets one warning naming the URL (refused, or frozen: SIGSTOP); the
first failed call is logged with its server, later ones are counted, not logged each."""

from __future__ import annotations

import logging
import os
import time

import pytest

from lmc.config import CacheConfig
from lmc.settings import ConfigError
from lmc.storage import chain
from lmc.storage.backends.redis.url import parse_target

from ..conftest import free_port, require_redis

LOG = "lmc.storage.backends.redis"


@pytest.mark.parametrize("query, typo, near", [
    ("tll=1h", "tll", "ttl"),
    ("conections=8", "conections", "connections"),
    ("ssl_ca_cert=/ca.pem", "ssl_ca_cert", "ssl_ca_certs"),
    ("socket_keepalive=true&helth_check_interval=3", "helth_check_interval",
     "health_check_interval"),
])
def test_unknown_url_options_name_the_closest(query, typo, near):
    with pytest.raises(ValueError) as e:
        parse_target(f"redis://user:hunter2@127.0.0.1:6379/0?{query}")
    msg = str(e.value)
    assert f"unknown option {typo!r}" in msg and f"did you mean {near!r}" in msg, msg
    assert "hunter2" not in msg


@pytest.mark.parametrize("url", [
    "rediss://h:6380?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required",
    "redis://h/3?socket_keepalive=true&client_name=engine-1",
    "redis://h?health_check_interval=30",  # taken by redis-py's URLs, ignored by lmc
])
def test_options_redis_py_takes_pass(url):
    parse_target(url)


def test_chain_check_refuses_what_a_backends_check_spec_refuses(tmp_path):
    """``lmc config`` and every server's preflight run ``check_chain``: a backend with a
    ``check_spec`` gets its URL checked there, before anything is built."""
    cfg = CacheConfig(remote_url="redis://127.0.0.1:6379/?tll=1h")
    with pytest.raises(ConfigError, match="did you mean 'ttl'"):
        chain.check_chain(cfg)


@pytest.mark.parametrize("url, near", [
    ("lmc://127.0.0.1:7000?conections=8", "connections"),
    ("lmc+unix:///run/lmc/lmc.sock?nss=team-a", "ns"),
])
def test_the_daemon_tier_refuses_a_query_name_it_does_not_take(url, near):
    """The ``lmc://`` tier took any query name and ignored it (``**_``): a typo served with
    the default in silence. Now ``lmc config``'s chain check names it, as for Redis."""
    with pytest.raises(ConfigError, match=f"did you mean {near!r}"):
        chain.check_chain(CacheConfig(remote_url=url))
    chain.check_chain(CacheConfig(remote_url="lmc://127.0.0.1:7000?ns=a&connections=8"))


def test_chain_check_names_a_disk_directory_it_cannot_make(tmp_path):
    ok = CacheConfig(local_disk=str(tmp_path / "a" / "b"))
    chain.check_chain(ok)
    assert not (tmp_path / "a").exists()  # checked, not made
    with pytest.raises(ConfigError, match="local_disk '/proc/lmc-x'.*cannot create"):
        chain.check_chain(CacheConfig(local_disk="/proc/lmc-x"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="--disk .*not a directory"):
        chain.check_chain(CacheConfig(local_disk=str(blocker / "d")),
                          where={"local_disk": "--disk"})


def _wait_checked(tier, timeout: float = 10.0) -> None:
    assert tier.router.checked.wait(timeout), "start-up check did not end"


@pytest.mark.integration
def test_unreachable_server_is_one_warning_naming_the_url(tiers, caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    port = free_port()
    t = tiers(f"redis://127.0.0.1:{port}/0", remote_timeout=0.3)
    _wait_checked(t)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "did not answer at start-up" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"redis://127.0.0.1:{port}/0" in warnings[0] and "Connection" in warnings[0]
    assert t.router.unreachable == [f"127.0.0.1:{port}"]


@pytest.mark.integration
def test_frozen_server_warns_at_start_and_logs_its_first_failure_once(own_redis, tiers,
                                                                      caplog):
    require_redis()
    caplog.set_level(logging.INFO, logger=LOG)
    own_redis.pause()  # accepts connections, never answers
    try:
        t = tiers(own_redis.url, remote_timeout=0.3, tier_kw={"breaker_threshold": 50})
        _wait_checked(t)
        keys = [os.urandom(16) for _ in range(4)]
        for _ in range(5):
            assert t.contains(keys) == [False] * 4
    finally:
        own_redis.resume()
    text = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    start = [m for m in text if "did not answer at start-up" in m]
    first = [m for m in text if "a call to" in m and "failed" in m]
    assert len(start) == 1 and own_redis.url.split("?")[0] in start[0], text
    assert len(first) == 1, text  # once, not once per call
    assert f"127.0.0.1:{own_redis.port}" in first[0]
    assert t.stats()["errors_timeout"] >= 5


@pytest.mark.integration
def test_reachable_server_says_so_in_one_line(redis_server, tiers, caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    t = tiers(redis_server.url)
    _wait_checked(t)
    t0 = time.monotonic()
    lines = [r.getMessage() for r in caplog.records if "answered in" in r.getMessage()]
    assert len(lines) == 1 and f"127.0.0.1:{redis_server.port}" in lines[0]
    assert not t.router.unreachable
    assert time.monotonic() - t0 < 5


def test_a_dead_daemon_is_warned_about_twice_then_counted(caplog, tmp_path):
    """A dead ``lmc://`` daemon: one line for the first failure, one when the circuit opens,
    then the failed probes (every ≤ 2 s) are counted for the next line a minute later. Each
    probe failure logged a line of its own (HALF_OPEN -> OPEN looked like a new opening)."""
    from lmc.memory.pool import MemoryPool
    from lmc.storage.backends.server.backend import ServerBackend

    port = free_port()  # nothing listens: every call is refused at once
    cfg = CacheConfig(remote_url=f"lmc://127.0.0.1:{port}", remote_timeout=0.2)
    pool = MemoryPool(1 << 20, pin_memory=False)
    tier = ServerBackend(config=cfg, pool=pool)
    try:
        with caplog.at_level(logging.WARNING, logger="lmc.storage.backends.server.backend"):
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                tier.contains([b"k" * 16])
                time.sleep(0.05)
        lines = [r.getMessage() for r in caplog.records if "server tier" in r.getMessage()]
        assert tier.stats()["failures"] >= 3, tier.stats()  # the breaker's probes did fail
        assert len(lines) == 2, lines
        assert "circuit open" in lines[1] and f"127.0.0.1:{port}" in lines[0]
    finally:
        tier.close()
        pool.close()
