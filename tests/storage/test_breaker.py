"""The one circuit breaker (``lmc.storage.breaker``) with the server tier's settings: opens after
repeated failures, lets one trial through after the backoff, closes on success, doubles the
backoff on a failed trial up to its cap; and the shared batch splitter."""

from __future__ import annotations

import random

import pytest

from lmc.storage.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from lmc.storage.remote import split_batch


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_open_trial_close_cycle():
    clock = Clock()
    b = CircuitBreaker(threshold=2, backoff=1.0, max_backoff=4.0, jitter=0, clock=clock)
    assert b.allow()
    b.failure()
    assert b.state == CLOSED and b.allow()
    b.failure()
    assert b.state == OPEN and not b.allow()
    clock.t = 1.0
    assert b.allow() and b.state == HALF_OPEN
    assert not b.allow(), "only one trial call while half-open"
    b.failure()  # the trial failed: open again, backoff doubled
    assert b.state == OPEN
    clock.t = 2.5
    assert not b.allow()
    clock.t = 3.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow() and b.stats()["trips"] == 2


def test_backoff_is_capped():
    clock = Clock()
    b = CircuitBreaker(threshold=1, backoff=1.0, max_backoff=2.0, jitter=0, clock=clock)
    for _ in range(5):
        b.failure()
        clock.t += 100
        assert b.allow()
    b.failure()
    assert b.backoff == 2.0
    clock.t += 2.0
    assert b.allow()


def test_jitter_stays_within_its_bounds():
    clock = Clock()
    for _ in range(50):
        b = CircuitBreaker(threshold=1, backoff=1.0, jitter=0.2, clock=clock)
        b.failure()
        assert 0.8 <= b.retry_at - clock.t <= 1.2


@pytest.mark.parametrize("kw, needle", [
    ({"threshold": 0}, "threshold"), ({"backoff": 0}, "backoff"),
    ({"backoff": 3.0, "max_backoff": 2.0}, "max_backoff"), ({"jitter": 1.0}, "jitter"),
    ({"probe_timeout": 0}, "probe_timeout")])
def test_bad_settings_are_named(kw, needle):
    with pytest.raises(ValueError, match=needle):
        CircuitBreaker(**kw)


def test_split_batch_balances_counts_and_weights():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    assert split_batch([], 4) == []
    assert split_batch([5], 4) == [(0, 1)]
    assert split_batch([1] * 5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert split_batch([1] * 4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert split_batch([9, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    for _ in range(200):
        n, parts = rng.randint(1, 40), rng.randint(1, 8)
        w = [rng.randint(1, 100) for _ in range(n)]
        got = split_batch(w, parts)
        assert len(got) == min(parts, n)
        assert got[0][0] == 0 and got[-1][1] == n
        assert all(a < b for a, b in got) and all(x[1] == y[0] for x, y in zip(got, got[1:]))
        if len(set(w)) == 1:  # equal weights: counts differ by at most one
            sizes = [b - a for a, b in got]
            assert max(sizes) - min(sizes) <= 1, (w, parts, got)
    with pytest.raises(ValueError, match="parts"):
        split_batch([1], 0)


def test_probe_policy_probes_while_it_pays():
    from lmc.storage.backends.server.probe import ProbePolicy

    p = ProbePolicy(threshold=0.1, every=4, alpha=0.5)
    assert p.want()  # optimistic start
    for _ in range(6):
        p.saw(0, 16)  # nothing was ever present
    asked = [p.want() for _ in range(8)]
    assert sum(asked) == 2, "only every 4th call probes once probing stopped paying"
    p.saw(16, 16)
    p.saw(16, 16)
    assert all(p.want() for _ in range(4))
