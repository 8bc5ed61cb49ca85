"""Counters read from another process's page (a server's ``/lmc/stats`` JSON, its
``/metrics`` Prometheus text): each value checked before lmc does arithmetic on it.

Why one helper: such a page is written by whoever answers the URL, and a lying one must make
the figure unknown, never a traceback. Python converts what it parsed without complaint up to
the point where it cannot: ``float(10**400)`` raises ``OverflowError``, ``float("1e999")`` is
``inf`` and ``float("1.2.3")`` raises ``ValueError``; a JSON page may also be nested 100,000
deep. Every reader of a remote counter page (the hit-rate funnel of ``lmc replay`` and
``lmc stats --url``, the replay's per-tier token counts) takes its numbers through
:func:`counter` and its JSON through :func:`json_page`; the caller bounds the page's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lmc.strict_json import InputError, parse_json

MAX_COUNTER = float(2**63)
"""A counter's largest believable value: an int64 counter's range (Prometheus clients and
lmc count in 64 bits). Sums of a page's counters stay finite far beyond any page size."""


def counter(raw: Any) -> float | None:
    """``raw`` (a JSON number, or a Prometheus sample's text) as a counter's value: a finite
    float in ``[0, MAX_COUNTER]``; None for anything else (a bool, a string that is not a
    number, a list, NaN, 1e999, 10**400, a negative count)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        return None
    if isinstance(raw, str) and len(raw) > 64:  # no counter needs more characters
        return None
    try:
        x = float(raw)
    except (ValueError, OverflowError):
        return None
    return x if math.isfinite(x) and 0.0 <= x <= MAX_COUNTER else None


def json_page(text: str, where: str) -> dict[str, Any] | None:
    """A JSON object page as a map, or None when it is not one (malformed, nested deeper
    than :data:`lmc.strict_json.MAX_JSON_DEPTH`, a key given twice, a number too long, a
    list)."""
    try:
        page = parse_json(text, where)
    except InputError:
        return None
    return page if isinstance(page, dict) else None


def counters(page: Mapping[str, Any]) -> dict[str, float]:
    """The page's counters by key: those whose value passes :func:`counter` (the others are
    unknown, left out); strings are not counters in a JSON page."""
    return {k: v for k, raw in page.items()
            if not isinstance(raw, str) and (v := counter(raw)) is not None}
