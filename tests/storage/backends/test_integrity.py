"""Keyed integrity on the shared tiers, against a real redis-server and a real lmc daemon: what
a writer to the store without the secret can do to an engine without ``integrity_secret``
(forge values, which are served: the documented limitation) and cannot do to one with it.

Threat model: ``docs/threats/tiers.md``."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

from lmc.memory.pool import MemoryPool
from lmc.storage.backends.server.tags import tag_key
from lmc.storage.serde import (
    HEADER_SIZE,
    TAG_SIZE,
    VERSION_TAGGED,
    decode_header,
    encode_header,
    verify_payload,
)
from tests.server.daemon_proc import DaemonProc

from .redis.test_redis import chunks, release, same_bytes

pytestmark = pytest.mark.integration
SECRET = "integrity-test-secret-0123456789"


def _forge(raw: bytes, key: bytes, head: int) -> tuple[bytes, bytes]:
    """What a writer without the secret can store: the value's payload altered and a
    version-1 header computed for it, consistent in every checksum. Returns (value, payload)."""
    h = decode_header(raw, tagged=raw[4] == VERSION_TAGGED)
    payload = bytearray(raw[head:])
    payload[:64] = os.urandom(64)
    header = encode_header(key, h.shape, h.dtype, h.num_tokens, bytes(payload))
    return header + bytes(payload), bytes(payload)


def _reheader(raw: bytes, key: bytes | None = None, payload: bytes | None = None) -> bytes:
    """A tagged value with its header's key and/or payload replaced and both checksums
    recomputed, the tag kept: it passes every check but the tag's."""
    body = bytearray(raw[: HEADER_SIZE - 8])
    if key is not None:
        body[8:24] = key
    if payload is None:
        payload = raw[HEADER_SIZE + TAG_SIZE:]
    body[56:64] = xxhash.xxh3_64_digest(payload)[::-1]  # the header stores it little-endian
    tag = raw[HEADER_SIZE: HEADER_SIZE + TAG_SIZE]
    return bytes(body) + xxhash.xxh3_64_digest(bytes(body)) + tag + payload


def _passes_unkeyed_checks(value: bytes, key: bytes) -> bool:
    tagged = value[4] == VERSION_TAGGED
    h = decode_header(value, expected_key=key, tagged=tagged)
    verify_payload(h, value[HEADER_SIZE + (TAG_SIZE if tagged else 0):])
    return True


def test_forged_value_is_served_without_the_secret(redis_server, tiers):
    """The limitation: checksums are not a defence against a writer to the store."""
    t = tiers(redis_server.url)
    keys, objs = chunks(t, 1)
    t.put(keys, objs)
    with redis_server.client() as c:
        rk = t.remote_key(keys[0])
        forged, payload = _forge(c.get(rk), keys[0], HEADER_SIZE)
        c.set(rk, forged)
    got = t.get(keys)
    assert got[0] is not None and bytes(got[0].tensor.view(torch.uint8).reshape(-1).numpy()) \
        == payload and not same_bytes(got[0].tensor, objs[0].tensor)
    release(got + objs)


@pytest.mark.parametrize("piece", [1 << 20, 1000], ids=["one_piece", "pieces"])
def test_with_the_secret_forgeries_are_refused_and_deleted(redis_server, tiers, piece):
    t = tiers(redis_server.url, integrity_secret=SECRET, tier_kw={"get_piece": piece})
    keys, objs = chunks(t, 2)
    assert t.put(keys, objs) == 2
    got = t.get(keys)
    assert all(same_bytes(g.tensor, o.tensor) for g, o in zip(got, objs))
    release(got)
    with redis_server.client() as c:
        rk0 = t.remote_key(keys[0])
        raw = c.get(rk0)
        assert len(raw) == HEADER_SIZE + TAG_SIZE + objs[0].nbytes and raw[4] == 2
        forged_v1, _ = _forge(raw, keys[0], HEADER_SIZE + TAG_SIZE)
        altered = bytearray(raw[HEADER_SIZE + TAG_SIZE:])
        altered[-5] ^= 1
        attacks = {
            "unkeyed self-consistent rewrite": (keys[0], forged_v1),
            "payload altered, checksums recomputed, tag kept":
                (keys[0], _reheader(raw, payload=bytes(altered))),
            "random tag": (keys[0], raw[:HEADER_SIZE] + os.urandom(TAG_SIZE)
                           + raw[HEADER_SIZE + TAG_SIZE:]),
            "valid value copied to another key, header rekeyed":
                (keys[1], _reheader(raw, key=keys[1])),
        }
        for corrupt, (name, (victim, value)) in enumerate(attacks.items(), start=1):
            assert _passes_unkeyed_checks(value, victim), name
            c.set(t.remote_key(victim), value)
            assert t.get([victim]) == [None], name
            assert not c.exists(t.remote_key(victim)), f"{name}: not deleted"
            assert t.stats()["corrupt"] == corrupt, name
        assert t.get(keys[:1]) == [None]  # the refused value was deleted, not kept
        c.set(t.remote_key(keys[1]), raw)  # an unmodified copy: its header names keys[0]
        assert t.get([keys[1]]) == [None]
        c.set(rk0, raw)  # the genuine value back: served again
        got = t.get(keys[:1])
        assert same_bytes(got[0].tensor, objs[0].tensor)
        release(got)
    release(objs)


def test_wrong_secret_and_mixed_settings_are_misses(redis_server, tiers):
    prefix = f"mix{os.urandom(4).hex()}"
    keyed = tiers(redis_server.url, integrity_secret=SECRET, remote_key_prefix=prefix)
    other = tiers(redis_server.url, integrity_secret=SECRET[::-1], remote_key_prefix=prefix)
    plain = tiers(redis_server.url, remote_key_prefix=prefix)
    keys, objs = chunks(keyed, 3)
    assert keyed.put(keys[:2], objs[:2]) == 2
    assert other.get(keys[:1]) == [None]        # wrong secret: refused (and deleted)
    assert plain.get(keys[1:2]) == [None]       # tagged value, no secret here: a miss
    assert keyed.contains(keys[:2]) == [False, False]
    pkeys, pobjs = chunks(plain, 1)
    assert plain.put(pkeys, pobjs) == 1
    assert keyed.get(pkeys) == [None]           # untagged value: refused by a keyed reader
    assert other.stats()["corrupt"] == 1 and keyed.stats()["corrupt"] == 1
    release(objs + pobjs)


# ------------------------------------------------------------------ the lmc:// server tier
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProc(tmp_path_factory.mktemp("daemon"), ["--size", "64MiB"])
    d.start()
    yield d
    d.kill()


@pytest.fixture
def daemon_tiers(daemon, tiers):
    """``make(secret=None)`` -> a tier on the daemon over its own pool, one namespace per
    test (a tier with no secret plays the writer without it)."""
    ns = f"i{os.urandom(4).hex()}"
    return lambda secret=None: tiers(f"{daemon.url}?ns={ns}", 16 << 20, remote_timeout=10.0,
                                     integrity_secret=secret)


def _objs(pool: MemoryPool, n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    objs = pool.allocate_many((2, 2, 16, 64), torch.float16, n, 16)
    for o in objs:
        o.tensor.view(torch.int16).copy_(torch.randint(-2**15, 2**15, o.shape, generator=g))
    return objs


def test_daemon_tier_tags_round_trip_and_refuse_forgeries(daemon_tiers):
    keyed, plain = daemon_tiers(SECRET), daemon_tiers()
    keys = [os.urandom(16) for _ in range(3)]
    objs = _objs(keyed.pool, 3, seed=1)
    assert keyed.put(keys, objs) == 3
    got = keyed.get(keys)
    assert all(same_bytes(g.tensor, o.tensor) for g, o in zip(got, objs))
    release(got)

    # a writer without the secret replaces chunk 0 (the daemon checks its header: consistent)
    forged = _objs(plain.pool, 1, seed=2)
    assert plain.delete(keys[:1]) == 1 and plain.put(keys[:1], forged) == 1
    seen = plain.get(keys[:1])  # the limitation: without a secret the forgery is served
    assert same_bytes(seen[0].tensor, forged[0].tensor)
    release(seen)
    assert keyed.get(keys[:1]) == [None]
    assert plain.contains([keys[0], tag_key(keys[0])]) == [False, False], "not deleted"

    # a valid chunk and its tag copied to another key: the key is authenticated
    stolen = plain.get([keys[1], tag_key(keys[1])])
    other = os.urandom(16)
    assert plain.put([tag_key(other), other], stolen) == 2
    release(stolen)
    assert keyed.get([other]) == [None]

    # another secret, and a chunk stored without any tag
    assert daemon_tiers(SECRET[::-1]).get(keys[2:3]) == [None]
    untagged = os.urandom(16)
    assert plain.put([untagged], forged) == 1
    assert keyed.get([untagged]) == [None]
    assert keyed.stats()["corrupt"] == 3
    release(forged + objs)


def test_daemon_tier_lost_tag_is_a_miss_and_the_chunk_is_rewritten(daemon_tiers):
    keyed, plain = daemon_tiers(SECRET), daemon_tiers()
    key = os.urandom(16)
    objs = _objs(keyed.pool, 1, seed=3)
    assert keyed.put([key], objs) == 1
    assert plain.delete([tag_key(key)]) == 1  # as if the daemon had evicted the tag
    assert keyed.get([key]) == [None]
    assert keyed.put([key], objs) == 1        # stored again, with a tag
    got = keyed.get([key])
    assert same_bytes(got[0].tensor, objs[0].tensor)
    release(got + objs)
