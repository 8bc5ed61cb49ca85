"""The hit-rate funnel as a report (``lmc replay``'s, ``lmc stats --url``'s): read from a
target's counters (an in-process engine's connector stats; a server's ``/lmc/stats``, else
its ``/metrics`` ``lmc_funnel_*`` series; a router's predicted cached tokens from its own
``/metrics``), the difference put in the funnel's rows by
:func:`lmc.storage.funnel.funnel_view`. Here, beside the funnel, rather than with the
replay: the daemon's ``lmc stats`` prints it too, and a service does not import a feature.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from lmc import units
from lmc.remote_counters import counter, counters, json_page
from lmc.storage.funnel import funnel_view

_SAMPLE = re.compile(r'^(lmc_funnel_\w+|lmc_router_predicted_cached_tokens)_total\{([^}]*)\}'
                     r'\s+(\S+)\s*$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')
STAGE_KEYS = {"prompt": "funnel.prompt", "best": "funnel.best", "found": "funnel.found",
              "used": "scheduler.used_tokens", "local": "scheduler.engine_local_tokens"}


def from_metrics(text: str) -> dict[str, float]:
    """Funnel figures from a Prometheus page, keyed as the connector's stats are; a sample
    whose value is not a counter's (:func:`lmc.remote_counters.counter`) is left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        value = counter(m.group(3)) if m else None
        if m is None or value is None:
            continue
        name, labels = m.group(1), dict(_LABEL.findall(m.group(2)))
        if name == "lmc_router_predicted_cached_tokens":
            key = "router.predicted_tokens"
        elif name == "lmc_funnel_tokens":
            key = STAGE_KEYS.get(labels.get("stage", ""), "")
        elif name == "lmc_funnel_found_tokens":
            key = f"funnel.found.{labels.get('tier', '?')}"
        elif name == "lmc_funnel_miss_tokens":
            r = labels.get("reason", "?")
            key = "scheduler.recomputed_by_choice_tokens" if r == "recomputed_by_choice" \
                else f"funnel.miss.{r}"
        else:
            key = ""
        if key:
            out[key] = out.get(key, 0.0) + value
    return out


def numbers(stats: Mapping[str, Any]) -> dict[str, float]:
    """The counters of a stats map (a connector's, or a server's ``/lmc/stats`` page):
    finite, in a counter's range; any other value is unknown, left out."""
    return counters(stats)


def http_reader(get: Callable[[str], tuple[int, bytes]]) -> Callable[[], dict[str, float]]:
    """A reader of a server's funnel figures: ``/lmc/stats`` (lmc's reference server),
    plus ``/metrics`` (vLLM's lmc series, a router's predictions); ``{}`` when neither.
    ``get`` bounds a page's bytes; a page that lies (nested too deep, a number no counter
    holds) is unknown, in whole or in the figures it lied about, never an exception."""
    def read() -> dict[str, float]:
        out: dict[str, float] = {}
        for path in ("/metrics", "/lmc/stats"):
            try:
                status, body = get(path)
            except OSError:
                continue
            if status != 200:
                continue
            text = body.decode("utf-8", "replace")
            if path == "/metrics":
                out.update(from_metrics(text))
            else:
                page = json_page(text, path)
                if page is not None:
                    out.update(numbers(page))
        return out
    return read


def delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def view(d: Mapping[str, float]) -> dict[str, Any] | None:
    """The funnel's rows, or None when the target reported none of it."""
    rows = funnel_view(d)
    if not rows["prompt_tokens"] and not rows["engine_used"]:
        return None
    if d.get("router.predicted_tokens"):
        rows["router_predicted"] = d["router.predicted_tokens"]
    return rows


def format_funnel(rows: Mapping[str, Any]) -> list[str]:
    """The report's lines (shares of the prompt tokens lmc looked up)."""
    total = rows["prompt_tokens"] or rows.get("engine_used") or 0

    def share(n: float) -> str:
        return units.ratio(n, total) if total else f"{n:,.0f} tokens"

    lines = ["", "hit-rate funnel (prompt tokens looked up; misses by reason)"]
    order = [("best possible", rows["best_possible"]),
             *([("router predicted", rows["router_predicted"])]
               if "router_predicted" in rows else []),
             ("lmc found", rows["lmc_found"]), ("loaded", rows["loaded"]),
             ("engine used", rows["engine_used"])]
    for name, n in order:
        lines.append(f"  {name:<18}{share(n)}")
    for name, by in (("found", rows["found_by_tier"]), ("loaded", rows["loaded_by_tier"])):
        if by:
            lines.append(f"  {name + ' by tier':<18}" + ", ".join(
                f"{t} {share(n)}" for t, n in by.items()))
    for reason, n in rows["misses"].items():
        lines.append(f"  miss: {reason.replace('_', ' '):<12}{share(n)}")
    return lines
