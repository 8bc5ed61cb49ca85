"""The circuit breaker: opens after repeated failures, lets one trial through after the
backoff, closes on success, doubles the backoff on a failed trial."""

from __future__ import annotations

from lmc.server.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_open_trial_close_cycle():
    clock = Clock()
    b = CircuitBreaker(threshold=2, base=1.0, cap=4.0, clock=clock)
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
    assert b.state == CLOSED and b.allow() and b.stats()["breaker_trips"] == 2


def test_backoff_is_capped():
    clock = Clock()
    b = CircuitBreaker(threshold=1, base=1.0, cap=2.0, clock=clock)
    for _ in range(5):
        b.failure()
        clock.t += 100
        assert b.allow()
    b.failure()
    clock.t += 2.0
    assert b.allow()


def test_probe_policy_probes_while_it_pays():
    from lmc.server.probe import ProbePolicy

    p = ProbePolicy(threshold=0.1, every=4, alpha=0.5)
    assert p.want()  # optimistic start
    for _ in range(6):
        p.saw(0, 16)  # nothing was ever present
    asked = [p.want() for _ in range(8)]
    assert sum(asked) == 2, "only every 4th call probes once probing stopped paying"
    p.saw(16, 16)
    p.saw(16, 16)
    assert all(p.want() for _ in range(4))
