"""Prefill/decode ``kv_transfer_params``: what an lmc producer answers for a request it
prefilled for another instance, and how a consumer reads it. Engine-neutral (the vLLM and
reference-engine connectors share it; ``lmc pd-proxy`` only forwards the dict).

The shape is vLLM's (``do_remote_prefill``/``do_remote_decode``, ``remote_num_tokens``,
``remote_engine_id``), so proxies written for vLLM's own connectors pass it on unchanged.
No block ids, addresses or handshake: chunks are named by content, so the consumer finds
the producer's chunks in the P2P directory from its own copy of the prompt.
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)

PD_MARK = "lmc_pd"  # set by an lmc producer: its consumer is an lmc consumer


def producer_params(num_prompt_tokens: int, engine_id: str) -> dict[str, Any]:
    """What a producer returns for a request it prefilled for another instance."""
    return {"do_remote_prefill": True, "do_remote_decode": False, PD_MARK: 1,
            "remote_num_tokens": int(num_prompt_tokens), "remote_engine_id": engine_id}


def remote_prefill_tokens(request: Any) -> int | None:
    """Prompt tokens a producer prefilled for ``request`` (from its ``kv_transfer_params``),
    or None when the request was not prefilled elsewhere by an lmc producer."""
    params = getattr(request, "kv_transfer_params", None)
    if not (isinstance(params, dict) and params.get("do_remote_prefill")
            and params.get(PD_MARK)):
        return None
    n = params.get("remote_num_tokens")
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n < 0:
        log.warning("request %s: kv_transfer_params remote_num_tokens=%r is not a token "
                    "count: prefilled here", getattr(request, "request_id", "?"), n)
        return None
    return int(n)


def wants_remote_decode(params: Any) -> bool:
    """Whether a request asks its (producer) instance to prefill for another one."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))
