"""``docs/grafana*.json``: every metric a panel queries is one lmc exports (engine, tiers or
daemon), with the labels it selects and groups by; a renamed metric breaks this test, not an
operator's dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import lmc.memory.prefault  # noqa: F401  (registers lmc_pool_prefaulted_bytes)
import lmc.metrics as engine_metrics
import lmc.server.metrics  # noqa: F401  (the daemon's lmc_server_* metrics)

DOCS = Path(__file__).resolve().parents[1] / "docs"
DASHBOARDS = sorted(DOCS.glob("grafana*.json"))
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
             "histogram": ("_bucket", "_count", "_sum", "_created"),
             "summary": ("_count", "_sum", "_created")}


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, for every lmc metric this process can export."""
    engine_metrics.engine_collectors()  # engine series exist once an engine does
    out: dict[str, set[str]] = {}
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001
        name, kind = getattr(collector, "_name", None), getattr(collector, "_type", None)
        if not name or not name.startswith("lmc_") or kind not in _SUFFIXES:
            continue
        labels = set(getattr(collector, "_labelnames", ()))
        for suffix in _SUFFIXES[kind]:
            out[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def _exprs(dash: dict) -> list[str]:
    found = []
    for panel in dash["panels"]:
        found += [t["expr"] for t in panel.get("targets", [])]
        found += _exprs({"panels": panel.get("panels", [])})
    return found


def test_there_is_a_dashboard():
    assert DASHBOARDS, "no docs/grafana*.json"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_queried_metric_exists(path):
    dash = json.loads(path.read_text())
    known = exported()
    exprs = _exprs(dash)
    assert exprs, f"{path.name} queries nothing"
    for expr in exprs:
        for name, selector in re.findall(r"\b(lmc_[a-z0-9_]+)(\{[^}]*\})?", expr):
            assert name in known, f"{path.name}: {name} is not exported by lmc ({expr})"
            used = set(re.findall(r"(\w+)\s*=~?", selector))
            assert used <= known[name], f"{path.name}: {name} has no label {used - known[name]}"
        for group in re.findall(r"by \(([^)]*)\)", expr):
            labels = {g.strip() for g in group.split(",")}
            metrics = re.findall(r"\b(lmc_[a-z0-9_]+)", expr)
            have = set().union(*(known[m] for m in metrics))
            assert labels <= have, f"{path.name}: grouped by {labels - have} in {expr}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_covers_engine_tiers_and_daemon(path):
    text = path.read_text()
    for family in ("lmc_hit_tokens_total", "lmc_tier_hits_total", "lmc_server_requests_total"):
        assert family in text
