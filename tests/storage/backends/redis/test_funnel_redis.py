"""The hit-rate funnel's ``ttl`` reason on a real redis-server: a chunk stored in a Redis
tier with a time to live, gone from L1 and then expired by Redis, is a miss put down to the
TTL (lmc/storage/funnel.py)."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.deadlines import HANG_S
from tests.kvutil import random_tokens
from tests.storage.test_funnel import CHUNK, _delta, _engine, _store


@pytest.mark.integration
def test_a_redis_ttl_is_the_reason_once_the_value_expired(redis_server):
    src, eng = _engine(chunks=4, remote_url=redis_server.url,
                       remote_options={"ttl": 1.0},
                       remote_key_prefix=f"f{uuid.uuid4().hex[:8]}")
    with eng:
        a = random_tokens(4 * CHUNK, 20)
        eng.lookup(a)
        _store(eng, src, a)
        assert eng.flush(HANG_S)
        for seed in (21, 22):  # out of L1; Redis keeps a for its TTL
            _store(eng, src, random_tokens(4 * CHUNK, seed))
        end = time.monotonic() + HANG_S
        while eng.storage.lower[0].contains(eng.db.keys(a)[:1]) == [True]:
            assert time.monotonic() < end, "Redis never expired the value"
            time.sleep(0.1)
        st = eng.stats()
        eng.lookup(a)
        assert _delta(eng, st).get("funnel.miss.ttl") == 64
