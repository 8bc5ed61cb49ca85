"""Scheduler half of the vLLM connector: vLLM's scheduler hooks onto :class:`SchedulerConnector`.

Runs in vLLM's EngineCore process. It holds no tensors and no cache: lookups go to the
workers through :class:`~lmc.connectors.core.lookup_service.LookupClient` (minimum over tensor-parallel
ranks, bounded by a timeout), and each step's plan goes to them as picklable metadata.
Where the hits of an admitted load lie (L1 or lower tiers, vLLM's cache-hit sources) comes
from the request's own lookup result, kept by the core. Duck-typed on vLLM's ``Request`` and ``SchedulerOutput`` (no vLLM
import), so it is tested without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from lmc.connectors.core.hints import parse_hints
from lmc.connectors.core.load_policy import LoadPolicy
from lmc.connectors.core.lookup_service import LookupClient
from lmc.connectors.core.metadata import ConnectorMetadata
from lmc.connectors.core.pd_params import producer_params, remote_prefill_tokens
from lmc.connectors.core.scheduler import ConnectorConfig, SchedulerConnector
from lmc.connectors.vllm.groups import group_tables
from lmc.connectors.vllm.requests import RequestTracker, cacheable, key_tag
from lmc.storage.lookup import LookupResult
from lmc.storage.tier import Medium

log = logging.getLogger(__name__)


class SchedulerSide:
    """Lookups, admissions and per-step metadata for one vLLM engine."""

    def __init__(self, config: ConnectorConfig, client: LookupClient,
                 policy: LoadPolicy | None = None, groups: int = 1) -> None:
        """``policy``: how much of each hit to load (``None``: all of it); the answer to
        ``get_num_new_matched_tokens`` is the part it chose. ``groups``: vLLM's KV cache
        groups (a hybrid model has several: their block tables travel to the workers, and
        every load is asynchronous, ``config.async_loads``)."""
        self.client = client
        self.core = SchedulerConnector(config, self._lookup, policy,
                                       prefetch=getattr(client, "prefetch", None),
                                       tagged_lookup=self._tagged_lookup)
        self.tracker = RequestTracker(config.save_decode, groups)
        self._start: dict[str, int] = {}  # request id -> tokens it had before the lookup
        self._async: set[str] = set()  # matched as prefill/decode (asynchronous) loads
        self.pd_requests = 0  # requests that arrived with a producer's kv_transfer_params
        # request id -> (lmc caches it, its key tag: LoRA, cache_salt; None for a plain one)
        self._tags: dict[str, tuple[bool, bytes | None]] = {}
        self.untagged_refusals = 0  # requests left to the engine: a field lmc cannot key by

    def _lookup(self, token_ids: Sequence[int]) -> LookupResult:
        return self.client.lookup(token_ids)

    def _tagged_lookup(self, token_ids: Sequence[int], tag: bytes) -> LookupResult:
        return self.client.lookup(token_ids, tag)

    def _tag(self, request: Any) -> tuple[bool, bytes | None]:
        """(lmc caches it, its key tag), worked out once per request."""
        rid = request.request_id
        got = self._tags.get(rid)
        if got is None:
            got = (False, None)
            if cacheable(request):
                try:
                    got = (True, key_tag(request))
                except (TypeError, ValueError) as e:
                    self.untagged_refusals += 1
                    log.warning("lmc leaves request %s to the engine: %s", rid, e)
            self._tags[rid] = got
        return got

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        ok, tag = self._tag(request)
        if not ok:
            return 0, False
        rid = request.request_id
        self._start[rid] = num_computed_tokens
        self.core.set_hints(rid, parse_hints(getattr(request, "kv_transfer_params", None)))
        remote = remote_prefill_tokens(request)
        if remote is not None and self.core.config.load:
            # another instance prefilled it: pulled in the background, vLLM waits for it
            n = self.core.match_remote(rid, list(request.all_token_ids), num_computed_tokens,
                                       remote)
            if n:
                self._async.add(rid)
                return n, True
        hit = self.core.get_num_new_matched_tokens(rid, list(request.all_token_ids),
                                                   num_computed_tokens, tag)
        if hit and self.core.config.async_loads:  # a hybrid model's: before it is scheduled
            self._async.add(rid)
            return hit, True
        return hit, False  # loads from lmc's own tiers are synchronous (layer-wise, in-step)

    def update_state_after_alloc(self, request: Any, num_external_tokens: int,
                                 blocks: Any = None) -> None:
        rid = request.request_id
        ok, tag = self._tag(request)
        if not ok:
            return
        self.tracker.admit(request, tag)
        start = self._start.pop(rid, request.num_computed_tokens)
        block_ids = None
        tables: tuple[tuple[int, ...], ...] = ()
        if rid in self._async:
            self._async.discard(rid)
            all_ids = blocks.get_block_ids() if blocks is not None else None
            block_ids = list(all_ids[0]) if all_ids else None
            if self.tracker.groups > 1:
                tables = group_tables(all_ids)
            params = getattr(request, "kv_transfer_params", None)
            if num_external_tokens > 0 and isinstance(params, dict) and \
                    remote_prefill_tokens(request) is not None:
                params["do_remote_prefill"] = False  # one transfer per request
                self.pd_requests += 1
        self.core.update_state_after_alloc(rid, list(request.all_token_ids), start,
                                           num_external_tokens, block_ids, tag,
                                           group_block_ids=tables)

    def hit_sources(self, request: Any, num_external_tokens: int) -> tuple[int, int]:
        """(tokens from L1, tokens from lower tiers) of the load just admitted; all lower
        where the lookup did not say."""
        by_tier = list(self.core.load_sources(request.request_id).values())
        if not by_tier or sum(by_tier) != num_external_tokens:
            return 0, num_external_tokens
        return by_tier[0], num_external_tokens - by_tier[0]

    def hit_media(self, request: Any, num_external_tokens: int,
                  media: Mapping[str, Medium]) -> dict[Medium | None, int]:
        """Tokens of the load just admitted by the medium its tier declares (``media``: tier
        name -> medium, :func:`lmc.storage.chain.chain_media`); ``None`` counts tokens whose
        medium is unknown (an unattributed load over lower tiers of several media, a tier
        not in ``media``). Zero counts are left out."""
        by_tier = self.core.load_sources(request.request_id)
        if not by_tier or sum(by_tier.values()) != num_external_tokens:
            lower = set(list(media.values())[1:])  # all lower, as hit_sources says
            where = lower.pop() if len(lower) == 1 else None
            return {where: num_external_tokens} if num_external_tokens > 0 else {}
        out: dict[Medium | None, int] = {}
        for name, n in by_tier.items():
            if n:
                m = media.get(name)
                out[m] = out.get(m, 0) + n
        return out

    def build_meta(self, so: Any) -> ConnectorMetadata:
        finished = set(getattr(so, "finished_req_ids", ()) or ())
        preempted = set(getattr(so, "preempted_req_ids", None) or ())
        self.tracker.forget(finished)
        steps = self.tracker.step_requests(so)
        return self.core.build_metadata(steps, finished, preempted)

    def request_finished(self, request: Any, engine_id: str = "") -> dict[str, Any] | None:
        """Forget the request; a producer answers the ``kv_transfer_params`` a consumer
        needs (vLLM puts them in the request's output; ``lmc pd-proxy`` forwards them).
        Blocks are never held past this: the saves are in lmc's pool already, exported
        from there, so the consumer reads lmc's copy, not vLLM's blocks."""
        rid = request.request_id
        self.core.request_finished(rid)
        self.tracker.drop(rid)
        self._start.pop(rid, None)
        self._tags.pop(rid, None)
        self._async.discard(rid)
        params = getattr(request, "kv_transfer_params", None)
        if not (self.core.config.save and isinstance(params, dict)
                and params.get("do_remote_decode")):
            return None
        return producer_params(request.num_prompt_tokens, engine_id)

    def stats(self) -> dict[str, float]:
        out = {f"scheduler.{k}": v for k, v in vars(self.core.stats).items() if k != "extra"}
        out.update({f"lookup.{k}": v for k, v in vars(self.client.stats).items()})
        out.update(self.core.policy_stats())
        out["scheduler.tracked_requests"] = len(self.tracker)
        out["scheduler.pd_requests"] = self.pd_requests
        out["scheduler.untagged_refusals"] = self.untagged_refusals
        return out

    def close(self) -> None:
        self.client.close()

