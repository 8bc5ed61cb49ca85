"""The replay's progress line: its time left (ETA) against the time a replay really had left,
on a clock the test moves (a schedule of known latencies, not a machine's speed).

The schedule is the README's replay: 42 requests of 8 chat sessions, 4 at once
(``--concurrency 4``); each request takes 10 s, the first four 15 s (the engine's first
forwards). The pace so far (elapsed over finished) said 6x the time left at the first
answer."""

from __future__ import annotations

import heapq
import io

import pytest

from lmc.workloads.replay import RequestRecord
from lmc.workloads.report import ProgressBar


def schedule(n: int, slots: int, latency: float, first_wave: float) -> list[float]:
    """Finish times of ``n`` requests due at once, ``slots`` at a time."""
    free = [0.0] * slots
    heapq.heapify(free)
    out = []
    for i in range(n):
        start = heapq.heappop(free)
        end = start + (first_wave if i < slots else latency)
        out.append(end)
        heapq.heappush(free, end)
    return sorted(out)


def etas(finishes: list[float], latency_of, **bar_kw) -> list[tuple[float, float]]:
    """(ETA the bar gives, time really left) at each finish."""
    now = [0.0]
    bar = ProgressBar(len(finishes), stream=io.StringIO(), clock=lambda: now[0], **bar_kw)
    out = []
    for k, t in enumerate(finishes, 1):
        now[0] = t
        bar(RequestRecord(f"r{k}", None, None, 0.0, ttft_s=1.0, latency_s=latency_of(k, t)),
            k, len(finishes))
        if k < len(finishes):
            eta = bar.eta(k, len(finishes))
            assert eta is not None
            out.append((eta, finishes[-1] - t))
    return out


def test_the_first_eta_of_a_capped_replay_is_near_the_time_left():
    finishes = schedule(42, 4, 10.0, 15.0)
    got = etas(finishes, lambda k, t: 15.0 if k <= 4 else 10.0, parallel=4)
    first, truth = got[0]
    assert 0.5 * truth <= first <= 1.6 * truth, (first, truth)
    # and every later one: within a factor of two until the last few requests
    for eta, left in got[:-4]:
        assert 0.5 * left <= eta <= 2 * left, (eta, left)


def test_without_a_cap_the_pace_is_used_and_timed_mode_waits_for_the_last_arrival():
    finishes = [10.0 * k for k in range(1, 11)]  # one at a time: the pace is exact
    for eta, left in etas(finishes, lambda k, t: 10.0):
        assert eta == pytest.approx(left)
    now = [0.0]
    bar = ProgressBar(10, stream=io.StringIO(), clock=lambda: now[0], last_arrival_s=500.0,
                      parallel=4)
    now[0] = 10.0
    bar(RequestRecord("r1", None, None, 0.0, ttft_s=1.0, latency_s=10.0), 1, 10)
    assert bar.eta(1, 10) == pytest.approx(490.0)  # the trace's last request arrives then
