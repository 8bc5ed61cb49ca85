"""The pacing policy both replay targets share: arrival times, session order, client slots,
and the due time TTFT is measured from."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmc.workloads import TraceRequest
from lmc.workloads.dispatch import Dispatcher


def _req(rid: str, t: float, session: str | None = None) -> TraceRequest:
    return TraceRequest(t, rid, session, None, [1, 2], None, 1)


def _ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def test_timed_sends_at_arrival_and_sessions_wait_for_answers():
    d = Dispatcher([_req("a0", 0.0, "a"), _req("b0", 0.5, "b"), _req("a1", 1.0, "a"),
                    _req("c", 1.0)])
    assert _ids(d.ready(0.0)) == ["a0"]
    assert d.next_due() == 0.5
    assert _ids(d.ready(0.4)) == []
    assert _ids(d.ready(0.6)) == ["b0"]
    assert _ids(d.ready(1.2)) == ["c"]  # a1 waits for a0's answer; c is not held up by it
    d.done("a0", 2.0)
    assert d.next_due() == 2.0
    assert _ids(d.ready(2.0)) == ["a1"]
    assert d.due == {"a0": 0.0, "b0": 0.5, "c": 1.0, "a1": 2.0}
    for rid in ("b0", "c", "a1"):
        assert not d.all_done
        d.done(rid, 3.0)
    assert d.all_done and d.next_due() is None


def test_fast_ignores_arrivals_but_keeps_session_order():
    d = Dispatcher([_req("a0", 5.0, "a"), _req("a1", 9.0, "a"), _req("x", 20.0)], fast=True)
    assert _ids(d.ready(0.0)) == ["a0", "x"]
    d.done("a0", 0.3)
    assert _ids(d.ready(0.3)) == ["a1"] and d.due["a1"] == 0.3


def test_concurrency_caps_in_flight_and_due_counts_from_a_free_slot():
    d = Dispatcher([_req(f"r{i}", 0.0) for i in range(5)], fast=True, concurrency=2)
    assert _ids(d.ready(0.0)) == ["r0", "r1"]
    assert d.next_due() is None  # slots full: only an answer frees one
    d.done("r0", 1.5)
    assert _ids(d.ready(1.6)) == ["r2"] and d.due["r2"] == 1.5
    d.done("r1", 2.0)
    d.done("r2", 2.5)
    assert _ids(d.ready(3.0)) == ["r3", "r4"]
    assert (d.due["r3"], d.due["r4"]) == (2.0, 2.5)  # each from the slot it took
    timed = Dispatcher([_req("a", 0.0), _req("b", 0.1), _req("c", 4.0)], concurrency=1)
    assert _ids(timed.ready(0.2)) == ["a"]
    timed.done("a", 1.0)
    assert _ids(timed.ready(1.0)) == ["b"] and timed.due["b"] == 1.0
    timed.done("b", 2.0)
    assert _ids(timed.ready(4.0)) == ["c"] and timed.due["c"] == 4.0  # its own arrival


def test_bad_concurrency():
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        Dispatcher([], concurrency=0)


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 3) | st.none(), st.floats(0, 5)), min_size=1,
                max_size=25),
       st.booleans(), st.integers(1, 4) | st.none(), st.randoms(use_true_random=True))
def test_any_trace_any_answer_times(spec, fast, concurrency, rnd):
    """Simulated replay with random answer times: each request goes exactly once, never
    before it is due, after its session's previous answer, within the slot limit."""
    arrivals = sorted(t for _, t in spec)
    reqs = [_req(f"r{i}", arrivals[i], None if s is None else f"s{s}")
            for i, (s, _) in enumerate(spec)]
    d = Dispatcher(reqs, fast=fast, concurrency=concurrency)
    now, in_flight, answered = 0.0, {}, {}
    order: list[str] = []
    while not d.all_done:
        for r in d.ready(now):
            assert r.request_id not in order
            order.append(r.request_id)
            due = d.due[r.request_id]
            assert due <= now and (fast or due >= r.arrival_s)
            in_flight[r.request_id] = now + rnd.uniform(0, 2)
        assert concurrency is None or len(in_flight) <= concurrency
        nxt = d.next_due()
        candidates = list(in_flight.values()) + ([nxt] if nxt is not None else [])
        now = max(now, min(candidates))
        for rid, t in sorted(in_flight.items(), key=lambda kv: kv[1]):
            if t <= now:
                del in_flight[rid]
                answered[rid] = t
                d.done(rid, t)
    assert sorted(order) == sorted(r.request_id for r in reqs)
    by_session: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        if r.session_id is not None:
            by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        for a, b in zip(turns, turns[1:]):  # trace order kept, and b waited for a's answer
            assert order.index(a.request_id) < order.index(b.request_id)
            assert d.due[b.request_id] >= answered[a.request_id]
