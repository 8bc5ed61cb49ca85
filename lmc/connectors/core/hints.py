"""Cache hints a request carries: a session id, a retention priority and a TTL.

vLLM requests carry them in ``kv_transfer_params`` (``{"lmc_session": "agent-7",
"lmc_priority": 5, "lmc_ttl": 300}``), the reference server's requests the same, or its
body's ``cache_hints`` object (``{"session", "priority", "ttl"}``), which the server turns
into those keys (:func:`lmc.storage.control.body_hints`). The scheduler half reads them when a request arrives and hands them to the
worker half with each of the request's saves (:class:`~lmc.connectors.core.metadata.SaveSpec`
``hints``); once a save is committed the worker

* pins the request's chain so far for ``ttl`` seconds, owned by the session (each turn's pin
  replaces the last: the next turn's prompt contains this one's, so the conversation stays
  in L1 between turns) or, without one, by the request;
* sets the chain's retention ``priority`` (background traffic sent with a negative one is
  evicted before everything else).

Both cover the chain's full chunks only: a prompt's partial last chunk is never the next
turn's (the next prompt's chunk at that place is longer: another key), so holding it, or
ranking it over other traffic, would only take room from what the session will reuse.

Hints never fail a request: a value out of range is dropped (one rate-limited warning), a pin
past the engine's bounds pins what fits (``ttl_pins_refused`` counts the rest).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from lmc.ratelog import RateLimitedWarnings
from lmc.storage.control import (
    MAX_PRIORITY,
    MAX_SESSION,
    MIN_PRIORITY,
    hint_priority,
    hint_session,
    hint_ttl,
)

log = logging.getLogger(__name__)
_warn = RateLimitedWarnings(limit=5, window=60.0, logger=log)
KEYS = {"lmc_session": "session", "lmc_priority": "priority", "lmc_ttl": "ttl"}


@dataclass(frozen=True)
class CacheHints:
    """What a request asks of the cache (module doc); picklable, it crosses processes."""

    session: str | None = None
    priority: int | None = None
    ttl: float | None = None

    def __bool__(self) -> bool:
        return self.priority is not None or self.ttl is not None


def parse_hints(params: Any) -> CacheHints | None:
    """The hints in a request's ``kv_transfer_params`` (``None``: none, or none valid).
    The TTL is capped later by the engine's ``max_pin_ttl``."""
    if not isinstance(params, dict) or not any(k in params for k in KEYS):
        return None
    hints = CacheHints(hint_session(params.get("lmc_session")),
                       hint_priority(params.get("lmc_priority")), hint_ttl(params.get("lmc_ttl")))
    bad = [k for k, name in KEYS.items() if k in params and getattr(hints, name) is None]
    if bad:
        _warn("lmc: ignoring the cache hint(s) %s: lmc_session is 1-%d characters, "
              "lmc_priority an integer in [%d, %d], lmc_ttl seconds > 0", ", ".join(bad),
              MAX_SESSION, MIN_PRIORITY, MAX_PRIORITY)
    return hints if hints else None
