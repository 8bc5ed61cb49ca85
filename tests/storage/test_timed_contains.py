"""A lookup's existence checks with a deadline (lmc/storage/timed_contains.py), on a real
CPU tier behind a wrapper whose ``contains`` blocks until the test releases it: a stuck
tier is a miss for the lookup, holds at most ``MAX_IN_FLIGHT`` threads, and a tier's own
error is still a miss. No clock decides an outcome: a blocked call never answers in time,
however fast the machine, and an unblocked one always does (its deadline is ``HANG_S``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lmc import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.manager import UNANSWERED, StorageManager
from lmc.storage.speeds import PrefillRate, Speeds
from lmc.storage.tier import create_backend
from lmc.storage.timed_contains import MAX_IN_FLIGHT, budget_s
from lmc.storage.wrappers import WrapperTier
from tests.deadlines import HANG_S


class Stuck(WrapperTier):
    """``contains`` waits for :attr:`released` (then answers the wrapped tier's), or raises
    when :attr:`fail` is set."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        object.__setattr__(self, "released", threading.Event())
        object.__setattr__(self, "fail", False)
        object.__setattr__(self, "calls", 0)

    def contains(self, keys):
        object.__setattr__(self, "calls", self.calls + 1)
        if self.fail:
            raise ConnectionError("tier down")
        assert self.released.wait(HANG_S), "never released"
        return self.inner.contains(keys)


@pytest.fixture
def manager():
    cfg = CacheConfig(local_cpu_size=1 << 20)
    pools = [MemoryPool(1 << 20, pin_memory=False) for _ in range(2)]
    l1 = create_backend("cpu", cfg, pools[0])
    low = Stuck(config=cfg, pool=pools[1], inner=create_backend("cpu", cfg, pools[1]))
    sm = StorageManager([l1, low])
    keys = [bytes([i]) * 16 for i in range(3)]
    o = pools[1].allocate((8,), torch.float32, 1)
    low.inner.put(keys[:1], [o])
    o.release()
    # a compute estimate: without one the call is inline (and would block)
    sm.speeds = Speeds([("cpu", "memory", True), ("low", "memory", False)], {"prefill": 1})
    sm.chunk_tokens = HANG_S  # 1 token/s: a budget of 0.1 * HANG_S * 3 s, far past any wait
    yield sm, low, keys
    low.released.set()
    sm.close()


def test_budget_is_a_share_of_recomputing_with_a_floor() -> None:
    assert budget_s(None, 1000) is None
    assert budget_s(PrefillRate(0.0, 1e-3, 0.0), 1000) == pytest.approx(0.1)
    assert budget_s(PrefillRate(0.0, 1e-9, 0.0), 10) == 0.02  # MIN_S


def test_a_stuck_tier_is_a_miss_and_holds_a_bounded_number_of_threads(manager) -> None:
    sm, low, keys = manager
    sm.chunk_tokens = 1e-9  # recomputing costs nothing: each tier gets MIN_S
    for _ in range(MAX_IN_FLIGHT):
        assert sm.sources(keys) == [UNANSWERED] * 3
    calls = low.calls
    st = sm.stats()
    assert st[f"{low.name}.lookup_late"] >= MAX_IN_FLIGHT
    # every thread held by a stuck call: not asked at all, a miss at once
    assert sm.prefix_lookup(keys) == ([], True)
    assert low.calls == calls and sm.stats()[f"{low.name}.lookup_busy"] >= 1
    low.released.set()  # the stuck calls end; their threads are free again once they return
    sm.chunk_tokens = HANG_S
    deadline = time.monotonic() + HANG_S  # hang guard only
    while (got := sm.prefix_lookup(keys)) != ([1], False):
        assert got == ([], True) and time.monotonic() < deadline, got  # busy until then
        time.sleep(0.01)


def test_a_tier_that_answers_in_time_is_used_and_its_error_is_a_miss(manager) -> None:
    sm, low, keys = manager
    low.released.set()
    assert sm.sources(keys) == [1, -1, -1]
    low.fail = True
    assert sm.sources(keys) == [-1, -1, -1]
    assert sm.stats()[f"{low.name}.errors_lookup_ConnectionError"] == 1
