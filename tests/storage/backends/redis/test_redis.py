"""Redis tier against real servers: round trips, batching, TTL, prefixes, cluster, TLS,
corrupt values, and servers that die or hang. Every fault must end in the right bytes or a
miss, never in wrong bytes, an exception or a wait past the timeout.

Threat model: ``docs/threats/tiers.md``."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch
from prometheus_client import REGISTRY

from lmc.config import CacheConfig
from lmc.storage.backends.redis.backend import RedisBackend
from lmc.storage.backends.redis.url import parse_target
from lmc.storage.breaker import CircuitBreaker
from lmc.storage.serde import HEADER_SIZE
from tests.deadlines import AT_ONCE_S, HANG_S, SLACK_S

from ..conftest import RedisServer, free_port, require_redis

pytestmark = pytest.mark.integration
SHAPE = (2, 2, 16, 64)
SLACK = SLACK_S  # scheduling on a loaded machine, on top of the configured timeout


def chunks(tier: RedisBackend, n: int, shape=SHAPE, dtype=torch.float16, tokens=None):
    """n random keys and pool objects filled with random bits (the caller releases them)."""
    keys = [os.urandom(16) for _ in range(n)]
    objs = tier.pool.allocate_many(shape, dtype, n, tokens if tokens is not None else shape[2])
    assert len(objs) == n
    for o in objs:
        o.tensor.view(torch.uint8).random_()
    return keys, objs


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def release(objs) -> None:
    for o in objs:
        if o is not None:
            o.release()


# ---------------------------------------------------------------------------- units
@pytest.mark.parametrize("url,nodes,cluster,tls,opts", [
    ("redis://127.0.0.1:7000/2", [("127.0.0.1", 7000)], False, False, {"db": 2}),
    ("redis://cache", [("cache", 6379)], False, False, {}),
    ("valkey://u:p%40ss@h:1/0", [("h", 1)], False, False,
     {"username": "u", "password": "p@ss", "db": 0}),
    ("rediss://h:6380?ssl_ca_certs=/ca.pem", [("h", 6380)], False, True,
     {"ssl_ca_certs": "/ca.pem"}),
    ("valkeys://h", [("h", 6379)], False, True, {}),
    ("redis+cluster://a:7000,b:7001, c:7002", [("a", 7000), ("b", 7001), ("c", 7002)],
     True, False, {}),
    ("rediss+cluster://:pw@[::1]:7000,[::1]:7001", [("::1", 7000), ("::1", 7001)], True, True,
     {"password": "pw"}),
])
def test_url_forms(url, nodes, cluster, tls, opts):
    t = parse_target(url)
    assert list(t.nodes) == nodes and t.cluster == cluster and t.tls == tls
    for k, v in opts.items():
        assert t.options[k] == v
    assert "timeout" not in t.options


@pytest.mark.parametrize("url,needle", [
    ("memcached://h:1", "scheme must be one of"),
    ("redis://a:1,b:2", r"need a \+cluster scheme"),
    ("redis+cluster://a:1,b:2/3", "only database 0"),
    ("redis://h:port", "bad port"),
    ("redis://user:secret@h:x", "bad port"),
])
def test_bad_urls_name_the_problem_not_the_password(url, needle):
    with pytest.raises(ValueError, match=needle) as e:
        parse_target(url)
    assert "secret" not in str(e.value)


def test_breaker_opens_backs_off_probes_and_closes():
    now = [0.0]
    states: list[str] = []
    b = CircuitBreaker(threshold=3, backoff=1.0, max_backoff=4.0, probe_timeout=10.0,
                       clock=lambda: now[0], on_change=states.append)
    for _ in range(2):
        assert b.allow()
        b.failure()
    b.success()                       # consecutive, not total, failures open it
    for _ in range(3):
        assert b.allow()
        b.failure()
    assert b.state == "open" and not b.allow() and b.rejected == 1
    now[0] += 1.3                     # backoff 1 s with at most 20 % jitter
    assert b.allow() and b.state == "half_open"
    assert not b.allow()              # one probe at a time
    b.failure()                       # probe failed: open again, backoff doubled
    assert b.state == "open" and b.backoff == 2.0
    now[0] += 1.5
    assert not b.allow()
    now[0] += 1.0
    assert b.allow()
    b.failure()
    now[0] += 4.9
    assert b.allow() and b.backoff == 4.0  # capped at max_backoff
    b.success()
    assert b.state == "closed" and b.backoff == 1.0 and b.allow()
    assert states == ["open", "half_open", "open", "half_open", "open", "half_open", "closed"]
    assert b.trips == 3 and b.recoveries == 1


def test_breaker_lost_probe_frees_the_slot():
    now = [0.0]
    b = CircuitBreaker(threshold=1, backoff=1.0, probe_timeout=2.0, clock=lambda: now[0])
    b.failure()
    now[0] += 1.3
    assert b.allow() and not b.allow()
    now[0] += 2.5                     # the probe never reported back
    assert b.allow()


# ---------------------------------------------------------------------------- round trips
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 2, 16, 64), (3, 1, 7, 96), (1, 2, 256, 8)])
def test_round_trip_bit_exact(redis_server, tiers, dtype, shape):
    t = tiers(redis_server.url)
    keys, objs = chunks(t, 3, shape, dtype)
    assert t.put(keys, objs) == 3
    got = t.get(keys)
    try:
        for g, o in zip(got, objs):
            assert g is not None
            assert g.shape == o.shape and g.dtype == o.dtype and g.num_tokens == o.num_tokens
            assert same_bytes(g.tensor, o.tensor)
            assert g.pool is t.pool
    finally:
        release(got)
        release(objs)


def test_order_kept_with_misses_and_repeats(redis_server, tiers):
    t = tiers(redis_server.url, remote_connections=3)
    keys, objs = chunks(t, 7)
    assert t.put(keys[::2], objs[::2]) == 4
    assert t.contains(keys) == [True, False] * 3 + [True]
    got = t.get(keys + keys[:1])
    try:
        for i, g in enumerate(got[:7]):
            assert (g is not None) == (i % 2 == 0)
            if g is not None:
                assert same_bytes(g.tensor, objs[i].tensor)
        assert same_bytes(got[7].tensor, objs[0].tensor)
    finally:
        release(got)
        release(objs)
    assert t.get([]) == [] and t.contains([]) == [] and t.put([], []) == 0


def _info(client) -> dict:
    return client.info("everything")


def test_contains_is_one_round_trip(redis_server, tiers):
    t = tiers(redis_server.url)
    keys, objs = chunks(t, 64)
    t.put(keys[:40], objs[:40])
    release(objs)
    t.contains(keys[:1])  # connection made before we count
    with redis_server.client() as c:
        before = _info(c)
        assert t.contains(keys) == [True] * 40 + [False] * 24
        after = _info(c)
    reads = after["total_reads_processed"] - before["total_reads_processed"]
    lookups = (after["cmdstat_strlen"]["calls"]
               - before.get("cmdstat_strlen", {"calls": 0})["calls"])
    assert lookups == 64
    assert reads == 2, "the prompt's 64 lookups must reach the server as one pipeline " \
                       "(1 read for it + 1 for the second INFO)"


def test_put_skips_keys_already_stored(redis_server, tiers):
    t = tiers(redis_server.url)
    keys, objs = chunks(t, 6)
    assert t.put(keys[:4], objs[:4]) == 4
    with redis_server.client() as c:
        sets = c.info("commandstats").get("cmdstat_set", {"calls": 0})["calls"]
        assert t.put(keys, objs) == 6
        assert c.info("commandstats")["cmdstat_set"]["calls"] - sets == 2
    release(objs)
    assert t.stats()["put_present"] == 4


def test_put_skips_chunks_it_cannot_represent_without_any_io(redis_server, tiers):
    """The tier contract's shape rule: a chunk no header describes is skipped and counted,
    and no command reaches Redis for it; a key/object count mismatch is a caller's error."""
    t = tiers(redis_server.url)
    bad = t.pool.allocate((4, 16), torch.float16, 16)
    with redis_server.client() as c:
        sets = c.info("commandstats").get("cmdstat_set", {"calls": 0})["calls"]
        try:
            assert t.put([os.urandom(16)], [bad]) == 0
        finally:
            bad.release()
        assert c.info("commandstats").get("cmdstat_set", {"calls": 0})["calls"] == sets
    assert t.metrics.counts["errors_put_unsupported"] == 1
    with pytest.raises(ValueError, match="2 keys but 0"):
        t.put([b"k" * 16] * 2, [])


def test_ttl_expires_and_is_renewed(redis_server, tiers):
    t = tiers(redis_server.url, remote_ttl=1.0)
    keys, objs = chunks(t, 2)
    assert t.put(keys, objs) == 2
    with redis_server.client() as c:
        ttl = c.pttl(t.remote_key(keys[0]))
        assert 0 < ttl <= 1000
        time.sleep(0.5)
        assert t.put(keys[:1], objs[:1]) == 1            # present: its life is renewed
        assert c.pttl(t.remote_key(keys[0])) > c.pttl(t.remote_key(keys[1]))
    release(objs)
    deadline = time.monotonic() + 10
    while t.contains(keys) != [False, False]:
        assert time.monotonic() < deadline, "values did not expire"
        time.sleep(0.1)
    assert t.get(keys) == [None, None]


def test_key_prefixes_keep_deployments_apart(redis_server, tiers):
    a = tiers(redis_server.url, remote_key_prefix="deployA")
    b = tiers(redis_server.url, remote_key_prefix="deployB")
    keys, objs_a = chunks(a, 3)
    _, objs_b = chunks(b, 3)
    assert a.put(keys, objs_a) == 3
    assert b.contains(keys) == [False] * 3 and b.get(keys) == [None] * 3
    assert b.put(keys, objs_b) == 3
    ga, gb = a.get(keys), b.get(keys)
    try:
        assert all(same_bytes(g.tensor, o.tensor) for g, o in zip(ga, objs_a))
        assert all(same_bytes(g.tensor, o.tensor) for g, o in zip(gb, objs_b))
    finally:
        release(ga + gb + objs_a + objs_b)
    with redis_server.client() as c:
        assert c.exists(f"deployA:{keys[0].hex()}") and c.exists(f"deployB:{keys[0].hex()}")
    assert a.delete(keys) == 3 and b.contains(keys) == [True] * 3
    b.delete(keys)


# ---------------------------------------------------------------------------- corruption
def _corruptions(raw: bytes, other_raw: bytes) -> dict[str, bytes]:
    def flip(b: bytes, at: int) -> bytes:
        x = bytearray(b)
        x[at] ^= 0x40
        return bytes(x)

    return {
        "payload_bit_flip": flip(raw, len(raw) - 3),
        "header_bit_flip": flip(raw, 30),
        "other_keys_value": other_raw,
        "truncated_payload": raw[:-100],
        "truncated_header": raw[:40],
        "extra_bytes": raw + b"\x00\x01",
        "foreign_bytes": b"not an lmc value at all, just a string someone SET here",
        "random_bytes": os.urandom(len(raw)),
    }


# 3673: the first request (1.25 pieces) plus one piece end exactly at the value's last byte
@pytest.mark.parametrize("piece", [1 << 20, 4096, 3673],
                         ids=["one_piece", "three_pieces", "two_pieces_exactly"])
def test_corrupt_values_are_misses_deleted_and_counted(redis_server, tiers, piece):
    t = tiers(redis_server.url, remote_connections=2, tier_kw={"get_piece": piece})
    keys, objs = chunks(t, 2)
    t.put(keys, objs)
    with redis_server.client() as c:
        raw = c.get(t.remote_key(keys[0]))
        other = c.get(t.remote_key(keys[1]))
        assert len(raw) == HEADER_SIZE + objs[0].nbytes
        for n, (name, bad) in enumerate(_corruptions(raw, other).items(), start=1):
            victim = os.urandom(16)
            if name in ("payload_bit_flip", "header_bit_flip", "truncated_payload",
                        "extra_bytes", "truncated_header", "random_bytes"):
                victim = keys[0]
            c.set(t.remote_key(victim), bad)
            got = t.get([victim, keys[1]])
            assert got[0] is None, name
            assert got[1] is not None and same_bytes(got[1].tensor, objs[1].tensor), name
            release(got)
            assert not c.exists(t.remote_key(victim)), f"{name}: bad value not deleted"
            assert t.stats()["corrupt"] == n, name
            assert t.metrics.get("checksum_failures") == n
    assert t.stats()["breaker"] == "closed"  # a bad value is not a server failure
    release(objs)
    used = t.pool.used_bytes
    assert used == 0, f"corrupt reads leaked {used} bytes of pool memory"


def test_an_empty_value_is_absent_and_overwritten(redis_server, tiers):
    t = tiers(redis_server.url)
    keys, objs = chunks(t, 1)
    with redis_server.client() as c:
        c.set(t.remote_key(keys[0]), b"")
        assert t.contains(keys) == [False] and t.get(keys) == [None]
        assert t.put(keys, objs) == 1 and c.strlen(t.remote_key(keys[0])) > HEADER_SIZE
    got = t.get(keys)
    assert same_bytes(got[0].tensor, objs[0].tensor)
    release(got + objs)


@pytest.mark.parametrize("piece", [HEADER_SIZE + 1, 1000, 4096, 1 << 20])
def test_values_read_in_pieces_are_bit_exact(redis_server, tiers, piece):
    t = tiers(redis_server.url, remote_connections=2,
              tier_kw={"get_piece": piece, "get_window": 3 * piece})
    for shape in [(1, 1, 1, 8), (2, 2, 16, 64), (3, 2, 7, 100)]:
        keys, objs = chunks(t, 5, shape)
        assert t.put(keys, objs) == 5
        got = t.get(keys)
        try:
            assert all(g is not None and same_bytes(g.tensor, o.tensor)
                       for g, o in zip(got, objs))
        finally:
            release(got + objs)
    # 8264-byte values, pieces of 2543: 3178 + 2 x 2543 ends exactly on the last byte
    t2 = tiers(redis_server.url, tier_kw={"get_piece": 2543})
    keys, objs = chunks(t2, 3)
    t2.put(keys, objs)
    got = t2.get(keys)
    assert all(same_bytes(g.tensor, o.tensor) for g, o in zip(got, objs))
    release(got + objs)


def test_wrong_type_and_nil_replies_are_misses(redis_server, tiers):
    t = tiers(redis_server.url)
    k = os.urandom(16)
    with redis_server.client() as c:
        c.rpush(t.remote_key(k), b"x")          # WRONGTYPE for GET
        assert t.get([k]) == [None]
        assert t.stats()["errors_reply"] == 1
        c.delete(t.remote_key(k))
    assert t.get([k]) == [None]


def test_full_pool_is_a_miss_not_an_error(redis_server, tiers):
    t = tiers(redis_server.url, pool_size=1 << 20)
    keys, objs = chunks(t, 3, (2, 2, 32, 512), torch.float16)  # 3 x 128 KiB
    assert t.put(keys, objs) == 3
    hogs = []
    while (h := t.pool.allocate((1, 1, 4, 1024), torch.uint8, 4)) is not None:
        hogs.append(h)  # fill the pool with small objects
    got = t.get(keys)
    assert got == [None] * 3 and t.stats()["alloc_failures"] == 3
    release(hogs)
    release(objs)
    got = t.get(keys)
    assert all(g is not None for g in got)
    release(got)


# ---------------------------------------------------------------------------- topologies
def test_cluster_round_trip_across_slots(redis_cluster, tiers):
    t = tiers(redis_cluster.url, remote_connections=4)
    assert t.target.cluster
    keys, objs = chunks(t, 48)
    assert t.put(keys, objs) == 48
    assert t.contains(keys) == [True] * 48
    got = t.get(keys)
    try:
        assert all(g is not None and same_bytes(g.tensor, o.tensor) for g, o in zip(got, objs))
    finally:
        release(got)
    owners = []
    for node in redis_cluster.nodes:
        with node.client() as c:
            owners.append(c.dbsize())  # only this test writes to the cluster
    assert sum(owners) == 48 and all(n > 0 for n in owners), owners
    assert set(t.stats()["nodes"]) == {f"127.0.0.1:{n.port}" for n in redis_cluster.nodes}
    assert t.delete(keys) == 48 and t.contains(keys) == [False] * 48
    release(objs)


def test_cluster_stale_slot_table_is_a_miss_then_refreshed(redis_cluster, tiers):
    """A slot table that sends every key to one node (as after a resharding): the other
    nodes answer MOVED, those keys are misses (never an error), and the table is re-read."""
    t = tiers(redis_cluster.url)
    keys, objs = chunks(t, 24)
    assert t.put(keys, objs) == 24
    refreshes = t.stats()["slot_refreshes"]
    one = t.router.seeds[0]
    t.router._slots = [one] * len(t.router._slots)
    got = t.get(keys)
    served = [g for g in got if g is not None]
    assert 0 < len(served) < 24
    assert all(same_bytes(g.tensor, objs[i].tensor) for i, g in enumerate(got) if g is not None)
    release(got)
    assert t.stats()["errors_reply"] == 24 - len(served)
    assert t.contains(keys) == [True] * 24  # the next call re-read CLUSTER SLOTS
    assert t.stats()["slot_refreshes"] == refreshes + 1
    t.delete(keys)
    release(objs)


def test_tls_round_trip(tls_redis, tiers):
    t = tiers(tls_redis.url)
    assert t.target.tls
    keys, objs = chunks(t, 4, (2, 2, 64, 256), torch.bfloat16)
    assert t.put(keys, objs) == 4
    assert t.contains(keys) == [True] * 4
    got = t.get(keys)
    try:
        assert all(same_bytes(g.tensor, o.tensor) for g, o in zip(got, objs))
    finally:
        release(got)
        release(objs)
    plain = tiers(f"redis://127.0.0.1:{tls_redis.port}/0", remote_timeout=0.5)
    t0 = time.monotonic()
    assert plain.contains(keys) == [False] * 4  # the server speaks TLS only: a miss
    assert time.monotonic() - t0 < 0.5 + SLACK


def test_password_auth_and_wrong_password(tmp_path, tiers):
    require_redis()
    s = RedisServer(tmp_path / "auth", None, password="s3cr%t").start()
    try:
        good = tiers(f"redis://default:s3cr%25t@127.0.0.1:{s.port}/0")
        keys, objs = chunks(good, 2)
        assert good.put(keys, objs) == 2 and good.contains(keys) == [True, True]
        bad = tiers(f"redis://default:nope@127.0.0.1:{s.port}/0", remote_timeout=1.0)
        for _ in range(4):
            assert bad.contains(keys) == [False, False]
            assert bad.get(keys) == [None, None]
        assert bad.breaker_state() == "open"
        assert "nope" not in repr(bad.stats())
        release(objs)
    finally:
        s.stop()


# ---------------------------------------------------------------------------- faults
def _reader(t: RedisBackend, keys, objs, stop: threading.Event, bad: list, served: list):
    """Loop over gets; every answer must be the stored bytes or a miss."""
    while not stop.is_set():
        got = t.get(keys)
        for g, o in zip(got, objs):
            if g is not None:
                served.append(1)
                if not same_bytes(g.tensor, o.tensor):
                    bad.append("wrong bytes served")
        release(got)


def test_killed_server_gives_fast_misses_then_recovers(own_redis, tiers):
    timeout = 0.5
    t = tiers(own_redis.url, remote_timeout=timeout, remote_connections=2,
              tier_kw={"breaker_backoff": 0.1, "breaker_max_backoff": 0.5})
    keys, objs = chunks(t, 4)
    assert t.put(keys, objs) == 4
    stop, bad, served = threading.Event(), [], []
    th = threading.Thread(target=_reader, args=(t, keys, objs, stop, bad, served))
    th.start()
    try:
        time.sleep(0.2)
        own_redis.kill()
        for _ in range(6):
            t0 = time.monotonic()
            assert t.contains(keys) == [False] * 4
            assert time.monotonic() - t0 < timeout + SLACK
            t0 = time.monotonic()
            assert t.get(keys) == [None] * 4
            assert time.monotonic() - t0 < timeout + SLACK
            t0 = time.monotonic()
            assert t.put(keys, objs) == 0
            assert time.monotonic() - t0 < timeout + SLACK
        st = t.stats()
        assert st["breaker"] in ("open", "half_open") and st["nodes"][
            f"127.0.0.1:{own_redis.port}"]["trips"] >= 1
        assert st.get("rejected_keys", 0) > 0  # an open breaker answers without calling
        node = f"127.0.0.1:{own_redis.port}"
        assert REGISTRY.get_sample_value("lmc_redis_breaker_trips_total", {"node": node}) >= 1

        own_redis.start()  # same port, empty: nobody tells the tier
        deadline = time.monotonic() + 20
        while t.put(keys, objs) != 4:
            assert time.monotonic() < deadline, f"tier did not recover: {t.stats()}"
            time.sleep(0.05)
        got = t.get(keys)
        assert all(g is not None and same_bytes(g.tensor, o.tensor) for g, o in zip(got, objs))
        release(got)
        assert t.breaker_state() == "closed"
        assert REGISTRY.get_sample_value("lmc_redis_breaker_state", {"node": node}) == 0
        time.sleep(0.2)
    finally:
        stop.set()
        th.join(30)
    assert not bad, bad
    assert served, "the reader never saw a hit"
    release(objs)


def test_hung_server_calls_end_within_the_timeout(own_redis, tiers):
    timeout = 0.4
    t = tiers(own_redis.url, remote_timeout=timeout, tier_kw={"breaker_backoff": 0.1})
    keys, objs = chunks(t, 3)
    assert t.put(keys, objs) == 3
    fresh = tiers(own_redis.url, remote_timeout=timeout)  # no pooled connection yet
    own_redis.pause()
    try:
        for tier in (t, fresh, t):
            t0 = time.monotonic()
            assert tier.contains(keys) == [False] * 3
            assert time.monotonic() - t0 < timeout + SLACK
            t0 = time.monotonic()
            assert tier.get(keys) == [None] * 3
            assert time.monotonic() - t0 < timeout + SLACK
        assert t.stats()["errors_timeout"] >= 2
    finally:
        own_redis.resume()
    deadline = time.monotonic() + 10
    while t.contains(keys) != [True] * 3:
        assert time.monotonic() < deadline, "tier did not come back after the server resumed"
        time.sleep(0.05)
    got = t.get(keys)
    assert all(same_bytes(g.tensor, o.tensor) for g, o in zip(got, objs))
    release(got)
    release(objs)


def test_server_restarted_between_calls_costs_no_miss(own_redis, tiers):
    """Pooled connections to a server that restarted are stale; the tier must notice and
    reconnect, not report the server as failing."""
    t = tiers(own_redis.url)
    keys, objs = chunks(t, 2)
    assert t.put(keys, objs) == 2
    own_redis.restart()
    assert t.put(keys, objs) == 2  # the first call after the restart already works
    assert t.contains(keys) == [True, True]
    assert t.stats()["nodes"][f"127.0.0.1:{own_redis.port}"]["consecutive_failures"] == 0
    release(objs)


def test_unreachable_url_never_raises(tiers):
    t = tiers(f"redis://127.0.0.1:{free_port()}/0", remote_timeout=HANG_S)
    keys, objs = chunks(t, 2)
    t0 = time.monotonic()
    for _ in range(5):
        assert t.contains(keys) == [False, False]
        assert t.get(keys) == [None, None]
        assert t.put(keys, objs) == 0
        assert t.delete(keys) == 0
    assert time.monotonic() - t0 < AT_ONCE_S  # refused at once: no call waits the timeout
    assert t.breaker_state() == "open"
    release(objs)


def test_concurrent_callers_never_see_wrong_bytes(redis_server, tiers):
    t = tiers(redis_server.url, remote_connections=3)
    keys, objs = chunks(t, 12)
    errors: list[str] = []

    def work(seed: int) -> None:
        idx = [(seed + 5 * i) % 12 for i in range(6)]
        for _ in range(15):
            t.put([keys[i] for i in idx], [objs[i] for i in idx])
            got = t.get([keys[i] for i in idx])
            for i, g in zip(idx, got):
                if g is not None and not same_bytes(g.tensor, objs[i].tensor):
                    errors.append(f"wrong bytes for key {i}")
            release(got)
            t.delete([keys[idx[0]]])

    ths = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    assert not errors
    release(objs)


# ---------------------------------------------------------------------------- through the engine
def test_engine_shares_kv_through_redis_and_keeps_serving_l1_when_it_dies(own_redis):
    """Engine A stores; engine B (fresh L1) retrieves bit-exact from Redis. Then Redis is
    killed: B keeps serving its L1 hits, and Redis lookups become misses within the timeout."""
    from lmc import CacheEngine
    from tests.kvutil import assert_bits_equal, make_caches, spec_for, token_kv

    chunk, n = 16, 80
    timeout = 0.5
    cfg = CacheConfig(chunk_size=chunk, local_cpu_size="2MiB", remote_url=own_redis.url,
                      remote_timeout=timeout, remote_key_prefix=f"eng{uuid.uuid4().hex[:8]}")
    src = make_caches("vllm_flash", blocks=64, block_size=4, seed=5)
    spec = spec_for("vllm_flash", src)
    slots = torch.arange(n) + 8
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 30000, (n,), generator=g).tolist()
    other = torch.randint(0, 30000, (n,), generator=g).tolist()

    with CacheEngine(cfg, spec, "m") as a:
        a.store(toks, src, slots)
        assert a.flush(10)
    with own_redis.client() as c:
        assert len(c.keys(f"{cfg.remote_key_prefix}:*")) == n // chunk

    with CacheEngine(cfg, spec, "m") as b:
        assert not b.contains_chunks(toks).any()
        assert b.lookup(toks) == n
        dst = make_caches("vllm_flash", blocks=64, block_size=4, zeros=True)
        assert b.retrieve(toks, dst, slots) == n
        assert_bits_equal(token_kv(spec, dst, slots), token_kv(spec, src, slots), "via redis")
        st = b.stats()
        assert st["redis.get_hits"] == n // chunk and st["redis.breaker"] == "closed"

        own_redis.kill()
        for _ in range(4):
            t0 = time.monotonic()
            assert b.lookup(other) == 0
            assert b.retrieve(other, make_caches("vllm_flash", blocks=64, block_size=4,
                                                 zeros=True), slots) == 0
            assert time.monotonic() - t0 < 2 * timeout + SLACK  # two calls, each bounded
            t0 = time.monotonic()
            dst2 = make_caches("vllm_flash", blocks=64, block_size=4, zeros=True)
            assert b.lookup(toks) == n                 # L1 still answers ...
            assert b.retrieve(toks, dst2, slots) == n  # ... and serves, without waiting
            assert time.monotonic() - t0 < timeout + SLACK
            assert_bits_equal(token_kv(spec, dst2, slots), token_kv(spec, src, slots), "L1")
        b.store(other, src, slots)  # a store lands in L1; the dead tier only drops its copy
        assert b.contains_chunks(other).all()
        # never closed while the server is dead; half-open when the store's write-behind
        # batch happens to be the probe after the backoff (a loaded machine is slow enough)
        assert b.stats()["redis.breaker"] in ("open", "half_open")


@pytest.mark.parametrize("secret", [None, "neighbour-test-secret-0123456789"],
                         ids=["plain", "tagged"])
@pytest.mark.parametrize("piece", [1 << 20, 1000], ids=["one_piece", "pieces"])
def test_reads_and_writes_stay_inside_the_object(redis_server, tiers, secret, piece):
    """A 5000-byte value between sentinel-filled objects: neither the write nor the piecewise
    read (header, optional 32-byte tag, then the payload at its offset) touches them."""
    t = tiers(redis_server.url, pool_size=64 << 10, integrity_secret=secret,
              tier_kw={"get_piece": piece})
    value = t.pool.allocate((1, 1, 5, 500), torch.float16, 5)
    after = t.pool.allocate((16 << 10,), torch.uint8)
    value.tensor.view(torch.uint8).random_()
    after.tensor.fill_(0xAB)
    want = value.tensor.clone()
    key = os.urandom(16)
    assert t.put([key], [value]) == 1
    value.release()
    (got,) = t.get([key])
    assert got is not None and got.offset == value.offset  # the read landed in that block
    assert same_bytes(got.tensor, want)
    assert bool((after.tensor == 0xAB).all()), "a read or write spilled past the object"
    release([got, after])


def test_a_fresh_tiers_first_lookup_does_not_pay_the_connection_set_up(redis_server, tiers):
    """Every new connection to the server takes 1 s to open (a real relay holds it), twice
    ``remote_timeout``: the tier makes its data connections at start-up, so a fresh tier's
    first lookup finds one made and hits (it used to connect inside the lookup's 0.5 s and
    miss: the README's Redis config lost a fresh engine's first hit in 3 of 6 runs)."""
    from tests.slow_link import SlowConnects

    writer = tiers(redis_server.url)
    keys, objs = chunks(writer, 3)
    assert writer.put(keys, objs) == 3
    link = SlowConnects(("127.0.0.1", redis_server.port), delay=1.0)
    try:
        fresh = tiers(f"redis://127.0.0.1:{link.port}/0", remote_timeout=0.5,
                      remote_key_prefix=writer.prefix.decode().rstrip(":"),
                      tier_kw={"connections": 1})
        assert fresh.contains(keys) == [True] * 3, fresh.stats()
        got = fresh.get(keys)
        assert all(g is not None and same_bytes(g.tensor, o.tensor) for g, o in zip(got, objs))
        release(got)
        assert fresh.stats().get("errors_timeout", 0) == 0
    finally:
        link.close()
        release(objs)


def test_a_miss_the_server_caused_is_said_once_in_a_plain_script(own_redis):
    """A script with no logging set up, its Redis frozen: the lookups miss within their
    deadline, and stderr says why once for the start-up check and once for the calls (later
    failures are counted)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[4]

    own_redis.pause()
    script = textwrap.dedent(f"""
        import os
        from lmc.config import CacheConfig
        from lmc.memory.pool import MemoryPool
        from lmc.storage.tier import create_backend
        pool = MemoryPool(8 << 20, pin_memory="false")
        cfg = CacheConfig(remote_url="{own_redis.url}", remote_timeout=0.5)
        tier = create_backend("{own_redis.url}", cfg, pool,
                              breaker_threshold=50)  # every call reaches the frozen server
        for _ in range(3):
            assert tier.contains([bytes(16)]) == [False]
        print("timeouts", tier.stats().get("errors_timeout"), flush=True)
        os._exit(0)
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                              text=True, timeout=HANG_S,
                              env={**os.environ, "PYTHONPATH": str(root)})
    finally:
        own_redis.resume()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "timeouts 3" in proc.stdout, proc.stdout
    said = [ln for ln in proc.stderr.splitlines() if "a call to" in ln and "failed" in ln]
    assert len(said) == 1 and f"127.0.0.1:{own_redis.port}" in said[0], proc.stderr[-3000:]
    assert sum("did not answer at start-up" in ln for ln in proc.stderr.splitlines()) == 1
