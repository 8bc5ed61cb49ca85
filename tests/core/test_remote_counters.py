"""Numbers read from another process's counter page are checked before any arithmetic:
a lying page (``/lmc/stats``, ``/metrics``) makes a figure unknown, never an exception.
End to end against a real ``lmc replay``: tests/workloads/test_replay_hostile_server.py."""

from __future__ import annotations

import math

import pytest

from lmc.remote_counters import MAX_COUNTER, counter, counters, json_page
from lmc.storage.funnel_report import from_metrics, http_reader, numbers
from lmc.workloads.http_target import parse_lmc_stats, parse_tier_metrics

LIES = [10**400, 1e308 * 10, math.nan, -1, -0.5, 2**64, True, None, [1], {"a": 1}, "1.2.3",
        "1e999", "NaN", "-Inf", "", "9" * 400, "x"]


@pytest.mark.parametrize("raw", LIES, ids=repr)
def test_a_value_no_counter_holds_is_unknown(raw):
    assert counter(raw) is None


@pytest.mark.parametrize("raw, value", [(0, 0.0), (5, 5.0), (1.5, 1.5), ("1.5e3", 1500.0),
                                        (2**63, MAX_COUNTER), ("0", 0.0)])
def test_a_counter_is_read_as_a_float(raw, value):
    assert counter(raw) == value


def test_a_json_page_keeps_only_its_believable_counters():
    page = {"a": 3, "b": 10**400, "c": "7", "d": -2, "e": True, "f": 2.5}
    assert counters(page) == {"a": 3.0, "f": 2.5}
    assert numbers(page) == {"a": 3.0, "f": 2.5}
    assert parse_lmc_stats({"worker.tokens_from_cpu": 10**400, "worker.tokens_from_disk": 4,
                            "worker.load_failures": math.inf}) == ({"disk": 4.0}, None)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a": 1, "a": 2}', "[1]", "{", "1" * 5000,
                                  '{"a": ' + "[" * 40 + "]" * 40 + "}"],
                         ids=["deep", "duplicate", "list", "truncated", "huge-int", "depth-41"])
def test_a_json_page_that_is_not_a_flat_object_is_none(text):
    assert json_page(text, "/lmc/stats") is None


def test_a_prometheus_sample_no_counter_holds_is_left_out():
    page = "\n".join([
        'lmc_funnel_tokens_total{stage="prompt"} 1.2.3',
        'lmc_funnel_tokens_total{stage="best"} 1e999',
        'lmc_funnel_tokens_total{stage="found"} -5',
        'lmc_funnel_tokens_total{stage="used"} NaN',
        'lmc_funnel_found_tokens_total{tier="cpu"} 64',
        'lmc_funnel_found_tokens_total{tier="cpu"} 32.0',
    ])
    assert from_metrics(page) == {"funnel.found.cpu": 96.0}
    tiers = parse_tier_metrics('lmc:connector_total{stat="tokens_from_cpu"} 1e999\n'
                               'lmc:connector_total{stat="tokens_from_disk"} 8\n'
                               'lmc:connector_total{stat="load_failures"} -1\n')
    assert tiers == ({"disk": 8.0}, None)


def test_the_funnel_reader_survives_every_lying_page():
    """Every page of a lying server at once: the reader answers the figures it could
    believe (none here), no exception."""
    pages = {"/metrics": b'lmc_funnel_tokens_total{stage="prompt"} 1.2.3\n',
             "/lmc/stats": b"[" * 100_000}
    assert http_reader(lambda path: (200, pages[path]))() == {}
    pages["/lmc/stats"] = b'{"funnel.prompt": ' + b"9" * 400 + b', "funnel.best": 12}'
    assert http_reader(lambda path: (200, pages[path]))() == {"funnel.best": 12.0}
