"""Cache control's rules, shared by every surface that steers the cache (the engine's API,
the daemon's PIN/CLEAR ops, the HTTP admin endpoints, the CLI): the bounds of a pin's TTL
and of a retention priority, and the named errors a refused request raises.

Each error carries a short ``code`` (``pin_limit``, ``ttl``, ``priority``, ``namespace``)
that wire protocols and HTTP answers pass on, and a one-line message naming the bound and
the value that broke it, so an operator reads what to change without a traceback.
"""

from __future__ import annotations

import math
from typing import Any

MIN_PRIORITY, MAX_PRIORITY = -10, 10
"""Retention priorities: higher is kept longer; 0 is every chunk's until set."""
DEFAULT_MAX_TTL = 3600.0
"""The TTL ceiling of a pin (seconds) unless configured (``max_pin_ttl``)."""


class ControlError(ValueError):
    """A cache-control request was refused; ``code`` says which rule (module doc)."""

    code = "control"


class PinLimitError(ControlError):
    """A pin would take a namespace past its bound of pinned chunks or bytes."""

    code = "pin_limit"


class TTLError(ControlError):
    """A pin's TTL is not a positive number of seconds within the ceiling."""

    code = "ttl"


class PriorityError(ControlError):
    """A retention priority is not an integer within [MIN_PRIORITY, MAX_PRIORITY]."""

    code = "priority"


class NamespaceError(ControlError):
    """The caller asked about a namespace it does not serve or is not granted."""

    code = "namespace"


ERRORS: dict[str, type[ControlError]] = {
    c.code: c for c in (ControlError, PinLimitError, TTLError, PriorityError, NamespaceError)}
"""By code: what a client raises for a refusal a server answered."""


def check_ttl(ttl: object, ceiling: float) -> float:
    """``ttl`` as seconds, refused (:class:`TTLError`) unless a finite number in
    (0, ``ceiling``]."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise TTLError(f"ttl must be a number of seconds, got {type(ttl).__name__}")
    t = float(ttl)
    if not math.isfinite(t) or t <= 0:
        raise TTLError(f"ttl must be > 0 seconds, got {ttl!r}")
    if t > ceiling:
        raise TTLError(f"ttl {t:g} s exceeds the ceiling max_pin_ttl {ceiling:g} s")
    return t


def check_priority(priority: object) -> int:
    """``priority`` as an int, refused (:class:`PriorityError`) outside the range."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise PriorityError(f"priority must be an integer, got {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise PriorityError(f"priority {priority} is outside [{MIN_PRIORITY}, "
                            f"{MAX_PRIORITY}] (higher is kept longer; 0 is the default)")
    return priority


# ---------------------------------------------------------------- a request's cache hints
MAX_SESSION = 256
"""Characters of a session id (a request's ``lmc_session`` hint, a pin's owner)."""


def hint_session(v: Any) -> str | None:
    return v if isinstance(v, str) and 0 < len(v) <= MAX_SESSION else None


def hint_priority(v: Any) -> int | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and MIN_PRIORITY <= v <= MAX_PRIORITY
    return v if ok else None


def hint_ttl(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    return float(v) if ok else None


def body_hints(value: Any) -> dict[str, Any]:
    """A request body's ``cache_hints`` object as ``kv_transfer_params`` keys; ``ValueError``
    naming the field that is wrong (a server answers it 400)."""
    if not isinstance(value, dict):
        raise ValueError("cache_hints must be an object with session, priority and ttl")
    extra = sorted(set(value) - {"session", "priority", "ttl"})
    if extra:
        raise ValueError(f"cache_hints: unknown field {str(extra[0])[:64]!r} (session, "
                         "priority, ttl)")
    out: dict[str, Any] = {}
    for name, key, check, rule in (
            ("session", "lmc_session", hint_session, f"a string of 1-{MAX_SESSION} characters"),
            ("priority", "lmc_priority", hint_priority,
             f"an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]"),
            ("ttl", "lmc_ttl", hint_ttl, "a number of seconds > 0")):
        if name in value:
            if check(value[name]) is None:
                raise ValueError(f"cache_hints.{name} must be {rule}")
            out[key] = value[name]
    return out
