"""How many of the pages lmc holds SGLang is told about: the load policy's count.

SGLang asks its storage backend ``batch_exists(keys)`` for the leading pages it can read
(``batch_exists_v2`` for hybrid models), then reads exactly that many pages into its host
pool (``batch_get_v1``) and recomputes the rest. Reporting every page lmc holds, whatever
tier holds it, loads a disk or remote hit even where recomputing it is faster (issue 23:
2.5x slower on an H200). :class:`PageHitPolicy` reports the policy's count instead: the
pages that beat recomputing, decided by lmc's one rule
(:class:`~lmc.connectors.core.load_policy.LoadPolicy`, :func:`choose_split`) from the tier of
each page (:meth:`PageStore.lookup`, one pass over the tiers) and the engine's speeds
(:class:`lmc.storage.speeds.Speeds`: the storage manager times every lower-tier read,
SGLang's ``batch_get`` included, and :meth:`PageStore.load` times the copy into the host
pool as L1's).

**Why ``num_layers=1``.** SGLang's HiCache reads L3 pages into host memory before the
request's forward (its prefetch thread, while the request waits); only the host-to-device
copy that follows is layer-wise under the compute, and that copy is SGLang's, paid for a
host hit just the same. So nothing lmc does hides under the compute: TTFT(N) = lmc's reads
and copy of N tokens + the compute of the rest, which is the rule with one layer (its
``max + min / L`` is then the sum), and no tier overlaps (marked so: with one layer the
flag changes nothing).

**What the backend cannot see, and why the count is still right.** It sees neither a
forward's time nor the request: no step times (so the engine's prefill rate is the
``load_policy_priors: {prefill: <tokens/s>}`` prior; without one, :data:`NO_PRIOR` is said
once and every held page is reported, as before) and no prompt length or position (SGLang
asks in batches of up to 128 pages, each from the end of the previous one, and stops at a
batch it is not given whole). Each batch is decided on its own with the rest of the prompt
left out: with the prior's linear compute (``c0 = c2 = 0``) the rest costs the same
whatever the split, so the best split does not depend on it (only the 3% near-tie band,
relative to a smaller total, narrows a little), and each batch's reads pay
their tier's latency once as SGLang's per-batch reads do. A batch answered short ends the
hit: a later batch of L1 pages behind recomputed slow ones is not loaded (a prefix).

**The layer-wise linker** (``LMCCacheLinker.lookup``) is told the same count with the rule's
other shape: its ``load`` reads every page from lmc's tiers when SGLang queues the load
(lower tiers: before the forward, not overlapping), then copies them into the device pool
layer by layer under the forward (L1's copy, overlapping, over ``num_layers`` layers).

**SGLang's prefetch** (``hicache_storage_prefetch_policy``: ``best_effort`` schedules the
request with whatever has landed, ``wait_complete`` waits for every reported page,
``timeout`` waits up to a deadline) only ever reads the pages this count reports: a page not
reported is recomputed, never fetched. The rule charges the reported pages' reads as if the
request did not wait in the queue (an idle engine's case); time spent waiting only makes a
load cheaper than predicted. A recomputed page SGLang writes back later (write-through)
lands in lmc's L1 (a fast hit next time) and is not written again to a tier that holds it
(the write-behind asks the tier first). SGLang's ``prefetch_threshold`` still applies to the
count, and tensor-parallel ranks keep the least of their counts: each a prefix every rank
can serve.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

from lmc.cache_engine import CacheEngine
from lmc.config import CacheConfig
from lmc.connectors.core.load_policy import Costs, LoadPolicy
from lmc.storage.lookup import LookupResult

log = logging.getLogger(__name__)

NO_PRIOR = ("lmc SGLang backend: load_policy is auto but no prefill rate is known (SGLang's "
            "storage backend never sees a forward's time), so every held page is loaded, "
            "from any tier; set load_policy_priors: {prefill: <the engine's prefill "
            "tokens/s>} to load only what beats recomputing (load_policy: load_all keeps "
            "loading everything)")


class PageHitPolicy:
    """The pages to report for one HiCache query, by the load policy (module docstring).
    Decision counters are :meth:`stats` (``policy.*``)."""

    def __init__(self, engine: CacheEngine, config: CacheConfig, page_size: int,
                 num_layers: int = 1) -> None:
        """``num_layers``: the layers a load pipelines over under the forward (1: none, the
        HiCache backend; the model's layers for the linker)."""
        if page_size < 1 or num_layers < 1:
            raise ValueError(f"page_size and num_layers must be >= 1, got {page_size}, "
                             f"{num_layers}")
        self.engine = engine
        self.page_size = page_size
        self.num_layers = num_layers
        self.bytes_per_token = engine.spec.chunk_nbytes(page_size) / page_size
        self.policy = LoadPolicy(self._costs, enabled=config.load_policy == "auto")
        self._queries = itertools.count(1)
        self.prefill_known = engine.speeds.snapshot().prefill is not None
        if self.policy.enabled and not self.prefill_known:
            log.info(NO_PRIOR)

    def _costs(self) -> Costs | None:
        """The engine's current speeds as SGLang's paths pay them: no lower tier's read
        overlaps the compute (the module docstring); ``None`` (load every page) while the
        compute is unknown."""
        snap = self.engine.speeds.snapshot()
        if snap.prefill is None or not snap.tiers:
            return None
        tiers = tuple(dataclasses.replace(t, overlaps=False) for t in snap.tiers)
        return Costs(tiers, snap.prefill, self.bytes_per_token, num_layers=self.num_layers)

    def describe(self) -> str:
        """The policy in a few words, for the backend's start-up line."""
        if not self.policy.enabled:
            return "load_all"
        p = self.engine.speeds.snapshot().prefill
        if p is None:
            return "auto (no prefill rate: loading every page)"
        return f"auto (prefill {p.tokens_per_s(1024):,.0f} tokens/s)"

    def pages(self, found: LookupResult) -> int:
        """Of the ``found.tokens // page_size`` leading pages lmc holds (``found`` from
        :meth:`~lmc.connectors.sglang.pages.PageStore.lookup`), how many to report: never
        more than are held."""
        held = found.tokens // self.page_size
        if held == 0:
            return 0
        hit = held * self.page_size
        end = self.policy.decide(f"sglang-query-{next(self._queries)}", found, 0, hit, hit,
                                 align=self.page_size)
        return max(0, min(end, hit)) // self.page_size

    def stats(self) -> dict[str, float]:
        return self.policy.stats()
