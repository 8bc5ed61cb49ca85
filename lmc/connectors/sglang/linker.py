"""``LMCCacheLinker``: lmc's tiers linked straight to SGLang's device KV pool, loading layer by
layer while the forward computes.

Selected with::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker":"LMCCacheLinker",
        "linker_module_path":"lmc.connectors.sglang",
        "linker_extra_config":{"lmc.config_file":"configs/sglang.yaml"}}'

SGLang owns matching, slot allocation and locks; the linker answers ``lookup`` (restorable
page prefixes, as many as the load policy loads: :mod:`lmc.connectors.sglang.policy`), copies stored pages into the slots SGLang allocated and persists finished
tree nodes. The flow per prefill batch:

1. ``load(rid, transfers)`` acquires the request's pages from lmc's tiers at once (a lower-tier
   hit is promoted into L1 here), so nothing can be evicted between the answer and the copy;
   a page missing by then refuses the load and SGLang recomputes.
2. ``start_layer_wise_loading()`` hands the batch to the load thread and returns the counter
   index the forward's ``wait_until(layer)`` consults. The thread scatters layer 0, marks it
   done, layer 1, ... so layer ``i+1`` is copied while layer ``i`` computes, and layer ``i``
   is in the pool before ``wait_until(i)`` returns.
3. ``finish_layer_wise_loading(index)`` after the forward: False when any layer failed, and
   SGLang aborts the batch's loading requests (``FINISH_ABORT``): never a forward on KV
   that was not loaded.

``offload`` queues a node's pages to a background thread that waits for the events SGLang
records (the forward has written the pages), gathers every layer in one planned copy and
stores them; lower tiers are reached by write-behind, which ``close`` drains.

Keys are SGLang's page hashes in their own namespace (tokens are not reachable from a linker
without patching SGLang: see :mod:`lmc.connectors.sglang.pages`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from queue import Queue
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from lmc.cache_engine import CacheEngine
from lmc.connectors.sglang.model import sglang_model_id
from lmc.connectors.sglang.pages import (
    PageStore,
    UnsupportedPool,
    device_pool_spec_and_caches,
    load_settings,
    page_namespace,
    per_rank_config,
    side_pool_refusal,
)
from lmc.connectors.sglang.policy import PageHitPolicy
from lmc.layerwise import LayerwiseRetrieve
from lmc.memory.pool import Lease, MemoryObj

log = logging.getLogger(__name__)


def _rank(params: Any) -> tuple[int, int]:
    """This worker's (tp_rank, tp_size) in its attention-TP group."""
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group",
                                                                    None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return (torch.distributed.get_rank(group=group),
                torch.distributed.get_world_size(group=group))
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        return int(par.tp_rank), int(par.tp_size)
    except Exception:  # no published parallel context: a single-rank engine
        return 0, 1


@dataclass
class _Load:
    rid: str
    keys: list[str]
    slots: torch.Tensor
    objs: list[MemoryObj]


class LMCCacheLinker(UnifiedCacheLinker):
    """See the module docstring. Constructed by SGLang's linker factory as
    ``LMCCacheLinker(server_args, params, components=..., extra_config=...,
    forward_stream=...)``."""

    def __init__(self, server_args: Any, params: Any, *, components: set[Any],
                 extra_config: Mapping[str, Any] | None = None,
                 forward_stream: Any = None) -> None:
        other = sorted(c.name for c in components if c != ComponentType.FULL)
        if other:
            raise side_pool_refusal(f"linker (components {other})", other[0])
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kv = params.token_to_kv_pool_allocator.get_kvcache()
        spec, caches = device_pool_spec_and_caches(kv)
        self.pools = {PoolName.KV: kv}
        self.num_layers = spec.num_layers
        cache_config, opts = load_settings(extra_config)
        tp_rank, tp_size = _rank(params)
        replicated = spec.use_mla
        self.model_id = sglang_model_id(opts, cache_config,
                                        getattr(server_args, "model_path", None),
                                        getattr(server_args, "revision", None),
                                        "LMCCacheLinker", "linker_extra_config")
        ns = page_namespace(self.model_id, spec, page_size=self.page_size, tp_rank=tp_rank,
                            tp_size=tp_size, pp_rank=int(getattr(params, "pp_rank", 0)),
                            pp_size=int(getattr(params, "pp_size", 1)),
                            cp_rank=int(getattr(params, "attn_cp_rank", 0)),
                            cp_size=int(getattr(params, "attn_cp_size", 1)),
                            rank_replicated=replicated, tenant=cache_config.tenant)
        tp = (0, 1) if replicated else (tp_rank, tp_size)
        pp_rank, pp_size = int(getattr(params, "pp_rank", 0)), int(getattr(params, "pp_size", 1))
        self.engine = CacheEngine(per_rank_config(cache_config, tp_rank, tp_size, pp_rank,
                                                  pp_size), spec, self.model_id, *tp)
        try:
            self.pages = PageStore(self.engine, ns, self.page_size, caches)
            self.hit_policy = PageHitPolicy(self.engine, cache_config, self.page_size,
                                            num_layers=self.num_layers)
        except BaseException:
            self.engine.close()
            raise
        self.offload_owner = not replicated or tp_rank == 0  # one writer for replicated KV
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        self.counts: dict[str, int] = {}
        self._queued: dict[str, _Load] = {}
        self._lock = threading.Lock()
        self._load_q: Queue = Queue()
        self._offload_q: Queue = Queue()
        self._results: deque[bool] = deque()
        self._closed = False
        self._threads = [threading.Thread(target=self._load_loop, name="lmc-sglang-load",
                                          daemon=True),
                         threading.Thread(target=self._offload_loop, name="lmc-sglang-offload",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    @staticmethod
    def _kv(transfers: Sequence[PoolTransfer]) -> PoolTransfer:
        for t in transfers:
            if t.name == PoolName.KV:
                return t
        raise UnsupportedPool(f"no KV transfer among {[str(t.name) for t in transfers]}")

    # ------------------------------------------------------------------ lookup / load
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        """Every restorable prefix length in pages: 1..n for the n leading stored pages the
        load policy loads (the rest are recomputed, never read)."""
        try:
            n = self.hit_policy.pages(self.pages.lookup(list(self._kv(transfers).keys or [])))
        except Exception as e:
            self._count("lookup_errors")
            log.warning("lmc linker lookup failed (%s: %s): a miss", type(e).__name__, e)
            return []
        self._count("lookup_hit_pages", n)
        return list(range(1, n + 1))

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        """Acquire the request's pages now (safe from eviction until copied); False, so
        SGLang recomputes, when any page is gone."""
        t = self._kv(transfers)
        keys = list(t.keys or [])
        slots = t.device_indices
        if slots is None or slots.numel() != len(keys) * self.page_size:
            log.error("lmc linker load %s: %s slots for %d pages of %d", rid,
                      None if slots is None else slots.numel(), len(keys), self.page_size)
            return False
        if bool((slots < 0).any()):  # a page loads whole or not at all: recomputed
            self._count("load_refused_unmapped")
            log.error("lmc linker load %s: unmapped (negative) device slots: recomputed", rid)
            return False
        try:
            objs = self.pages.fetch(keys)
        except Exception as e:
            self._count("load_errors")
            log.warning("lmc linker load failed (%s: %s): recomputed", type(e).__name__, e)
            return False
        if len(objs) < len(keys):
            Lease(objs).release()
            self._count("load_refused_missing")
            return False
        with self._lock:
            old = self._queued.pop(rid, None)
            self._queued[rid] = _Load(rid, keys, slots.detach().to("cpu", torch.int64), objs)
        if old is not None:
            Lease(old.objs).release()
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        with self._lock:
            job = self._queued.pop(rid, None)
        if job is None:
            return False
        Lease(job.objs).release()
        return True

    def start_layer_wise_loading(self) -> int:
        """Hand the queued loads to the load thread as one batch; its counter index (-1:
        nothing to load)."""
        with self._lock:
            batch, self._queued = list(self._queued.values()), {}
        if not batch:
            return -1
        index = self.layer_done_counter.update_producer()
        self._load_q.put((index, batch))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """Wait until the batch stops writing the pool; True iff every layer landed."""
        return self.layer_done_counter.finish(counter_index)

    def _retrieve_for(self, batch: list[_Load]) -> LayerwiseRetrieve:
        """One layer-wise retrieve for the whole batch: a single plan over every request's
        pages (the retrieve owns the chunks' references from here on)."""
        ps = self.page_size
        chunks, objs, slots = [], [], []
        pos = 0
        for job in batch:
            for key, obj in zip(self.pages.keys(job.keys), job.objs):
                chunks.append((pos, pos + ps, key))
                objs.append(obj)
                pos += ps
            slots.append(job.slots)
            job.objs = []
        tr = self.pages.transfer()
        slot_t = tr.check_slots(torch.cat(slots), pos)
        try:
            plan = tr.plan(slot_t, [(s, e) for s, e, _ in chunks])
        except BaseException:
            Lease(objs).release()
            raise
        return LayerwiseRetrieve(self.engine, tr, plan, chunks, objs)

    def _load_layer(self, retrieve: LayerwiseRetrieve, layer: int) -> None:
        """Copy one layer of the batch into the pool; returns once it is there."""
        retrieve.load(layer)

    def _load_loop(self) -> None:
        while True:
            task = self._load_q.get()
            try:
                if task is None:
                    return
                index, batch = task
                retrieve = None
                try:
                    retrieve = self._retrieve_for(batch)
                    for layer in range(self.num_layers):
                        self._load_layer(retrieve, layer)
                        self.layer_done_counter.complete(index, layer)
                    self._count("loaded_pages", len(retrieve.chunks))
                except BaseException as e:  # every waiter wakes; finish() reports it
                    self._count("load_failures")
                    log.warning("lmc linker load of batch %d failed (%s: %s): its requests "
                                "are aborted", index, type(e).__name__, e)
                    self.layer_done_counter.fail(index, e)
                finally:
                    if retrieve is not None:
                        retrieve.close()
                    for job in batch:  # references not yet handed to a retrieve
                        Lease(job.objs).release()
            finally:
                self._load_q.task_done()

    # ------------------------------------------------------------------ offload
    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        """Queue a node's pages for persisting; the result arrives through
        ``pop_completed_offload``."""
        t = self._kv(transfers)
        if self._closed:
            return False
        self._offload_q.put((list(t.keys or []), t.device_indices, self.record_offload_ready()))
        return True

    def _offload_loop(self) -> None:
        while True:
            task = self._offload_q.get()
            try:
                if task is None:
                    return
                keys, slots, ready = task
                ok = True
                if self.offload_owner:
                    try:
                        for event in ready:  # the forward has written these pages
                            event.synchronize()
                        ok = all(self.pages.store(keys, slots.detach().to("cpu")))
                        self._count("offloaded_pages" if ok else "offload_partial", len(keys))
                    except Exception as e:
                        ok = False
                        self._count("offload_errors")
                        log.warning("lmc linker offload failed (%s: %s)", type(e).__name__, e)
                with self._lock:
                    self._results.append(ok)
            finally:
                self._offload_q.task_done()

    def num_completed_offloads(self) -> int:
        with self._lock:
            return len(self._results)

    def pop_completed_offload(self) -> bool:
        with self._lock:
            return self._results.popleft()

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Quiesce: drop queued loads, let started loads and offloads finish, forget their
        results and the counter's state."""
        with self._lock:
            queued, self._queued = list(self._queued.values()), {}
        for job in queued:
            Lease(job.objs).release()
        self._load_q.join()
        self._offload_q.join()
        with self._lock:
            self._results.clear()
        self.layer_done_counter.reset()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued offloads, then for lower-tier writes."""
        self._offload_q.join()
        return self.engine.flush(timeout)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counts)
        out.update(self.hit_policy.stats())
        if not self._closed:
            out.update(self.engine.stats())
        return out

    def close(self) -> None:
        """Finish loads and offloads, stop the threads, drain lower-tier writes, close."""
        if self._closed:
            return
        self.reset()
        self._closed = True
        self._load_q.put(None)
        self._offload_q.put(None)
        for t in self._threads:
            t.join()
        self.engine.close()
