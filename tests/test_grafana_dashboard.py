"""``docs/grafana*.json``: every metric a panel queries is one lmc really exports, with the
labels it selects and groups by -- read from scrapes, not from what is registered:

* an engine's process (a real ``CacheEngine`` with memory and disk tiers that stored, looked
  up and retrieved), scraped as the reference server's ``/metrics`` serves it;
* a process without an engine that was handed the engine's changes (``lmc.metrics.values`` /
  ``apply``): what vLLM's ``/metrics`` shows, its API server holding no engine;
* the daemon's ``lmc_server_*`` metrics (registered by its module).

A renamed metric, or one that stops reaching the scrape, breaks this test, not an operator's
dashboard."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import lmc.server.metrics  # noqa: F401  (the daemon's lmc_server_* metrics)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DASHBOARDS = sorted(DOCS.glob("grafana*.json"))
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
             "histogram": ("_bucket", "_count", "_sum", "_created"),
             "summary": ("_count", "_sum", "_created")}

ENGINE = textwrap.dedent("""
    import json, sys, torch
    from prometheus_client import generate_latest, REGISTRY
    from lmc import CacheConfig, CacheEngine, metrics
    from tests.kvutil import make_caches, spec_for
    caches = make_caches("vllm_flash", layers=2, heads=2, dim=8, blocks=64, block_size=16)
    spec = spec_for("vllm_flash", caches)
    cfg = CacheConfig(chunk_size=16, local_cpu_size="64MiB", pin_memory="false",
                      local_disk=sys.argv[1], local_disk_size="64MiB")
    tokens = list(range(1, 257))
    slots = torch.arange(256)
    eng = CacheEngine(cfg, spec, "dashboard-test")
    eng.store(tokens, caches, slots)
    eng.close()  # flushes to the disk tier; the next engine finds the chunks there
    eng = CacheEngine(cfg, spec, "dashboard-test")
    assert eng.lookup(tokens) > 0
    eng.retrieve(tokens, caches, slots)
    eng.lookup(list(range(1000, 1064)))  # a miss
    eng.close()
    print(json.dumps({"scrape": generate_latest(REGISTRY).decode(),
                      "labels": {getattr(c, "_name", ""): list(getattr(c, "_labelnames", ()))
                                 for c in list(REGISTRY._collector_to_names)},
                      "values": metrics.values()}))
""")

CARRIED = textwrap.dedent("""
    import json, sys
    from prometheus_client import generate_latest, REGISTRY
    from lmc import metrics
    applied = metrics.apply(json.loads(sys.stdin.read()))
    print(json.dumps({"applied": applied, "scrape": generate_latest(REGISTRY).decode(),
                      "labels": {getattr(c, "_name", ""): list(getattr(c, "_labelnames", ()))
                                 for c in list(REGISTRY._collector_to_names)}}))
""")


def _run(code: str, *args: str, stdin: str = "") -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], input=stdin, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def samples(run: dict) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it has in a process's scrape (lmc's only). A family
    the scrape lists without samples yet (a labelled counter of events that did not happen:
    skips, errors) counts with the label names its process registered it with."""
    out: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(run["scrape"]):
        if not fam.name.startswith("lmc_"):
            continue
        for s in fam.samples:
            out.setdefault(s.name, []).append(dict(s.labels))
        if not fam.samples and fam.type in _SUFFIXES:
            labels = dict.fromkeys(run["labels"].get(fam.name, ()), "")
            for suffix in _SUFFIXES[fam.type]:
                out.setdefault(fam.name + suffix, []).append(
                    {**labels, **({"le": ""} if suffix == "_bucket" else {})})
    return out


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory) -> dict[str, dict[str, list[dict[str, str]]]]:
    engine = _run(ENGINE, str(tmp_path_factory.mktemp("disk")))
    carried = _run(CARRIED, stdin=json.dumps(engine["values"]))
    assert carried["applied"] > 0
    return {"engine": samples(engine), "carried": samples(carried)}


def daemon_series() -> dict[str, list[dict[str, str]]]:
    """The daemon's metrics as registered here (label names, no values)."""
    out: dict[str, list[dict[str, str]]] = {}
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001
        name, kind = getattr(collector, "_name", None), getattr(collector, "_type", None)
        if not name or not name.startswith("lmc_server_") or kind not in _SUFFIXES:
            continue
        labels = dict.fromkeys(getattr(collector, "_labelnames", ()), "")
        for suffix in _SUFFIXES[kind]:
            out[name + suffix] = [{**labels, **({"le": ""} if suffix == "_bucket" else {})}]
    return out


def _exprs(dash: dict) -> list[str]:
    found = []
    for panel in dash["panels"]:
        found += [t["expr"] for t in panel.get("targets", [])]
        found += _exprs({"panels": panel.get("panels", [])})
    return found


def _check(path: Path, known: dict[str, list[dict[str, str]]], where: str,
           skip: tuple[str, ...] = ()) -> None:
    """Every lmc series ``path`` queries is in ``known`` with the labels it uses."""
    label_names = {n: set().union(*(set(ls) for ls in sets)) for n, sets in known.items()}
    for expr in _exprs(json.loads(path.read_text())):
        for name, selector in re.findall(r"\b(lmc_[a-z0-9_]+)(\{[^}]*\})?", expr):
            if name.startswith(skip):
                continue
            assert name in known, f"{path.name}: {name} is not in {where}'s scrape ({expr})"
            used = set(re.findall(r"(\w+)\s*=~?", selector))
            assert used <= label_names[name], \
                f"{path.name}: {name} has no label {used - label_names[name]} in {where}"
        for group in re.findall(r"by \(([^)]*)\)", expr):
            labels = {g.strip() for g in group.split(",")}
            names = [m for m in re.findall(r"\b(lmc_[a-z0-9_]+)", expr)
                     if not m.startswith(skip)]
            if not names:
                continue
            have = set().union(*(label_names[m] for m in names))
            assert labels <= have, f"{path.name}: grouped by {labels - have} in {expr}"


def test_there_is_a_dashboard():
    assert DASHBOARDS, "no docs/grafana*.json"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_engine_panels_query_what_an_engine_exports(path, scrapes):
    _check(path, {**scrapes["engine"], **daemon_series()}, "an engine's process")


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_engine_panels_query_what_reaches_another_process(path, scrapes):
    """vLLM serves /metrics from a process without the engine: the counters and gauges the
    dashboard reads must arrive there (its latency panels read the workers' histograms,
    which stay in the worker)."""
    _check(path, {**scrapes["carried"], **daemon_series()}, "the serving process",
           skip=("lmc_op_seconds", "lmc_tier_seconds"))


def test_the_carried_figures_are_the_engines(scrapes):
    engine, carried = scrapes["engine"], scrapes["carried"]
    for name in ("lmc_lookups_total", "lmc_hit_tokens_total", "lmc_tier_hits_total",
                 "lmc_tier_bytes_total", "lmc_pool_capacity_bytes"):
        assert name in engine and name in carried, name
    tiers = {ls["tier"] for ls in carried["lmc_tier_hits_total"]}
    assert "disk" in tiers, tiers


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_covers_engine_tiers_and_daemon(path):
    text = path.read_text()
    for family in ("lmc_hit_tokens_total", "lmc_tier_hits_total", "lmc_server_requests_total"):
        assert family in text
