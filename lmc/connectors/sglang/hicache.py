"""lmc under SGLang 0.5.23: a HiCache storage backend and a layer-wise cache linker.

* :class:`LMCHiCacheStorage` is a ``HiCacheStorage``: SGLang keeps its own host tier (L2) and
  hands lmc whole host pages to store and fill (L3), with SGLang doing the layer-wise
  host-to-device load itself::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name":"lmc",
        "module_path":"lmc.connectors.sglang","class_name":"LMCHiCacheStorage",
        "interface_v1":1,"lmc.config_file":"configs/sglang.yaml"}'

* :class:`~lmc.connectors.sglang.linker.LMCCacheLinker` is a ``UnifiedCacheLinker``: lmc's
  tiers linked straight to the device pool, loads pipelined layer by layer through SGLang's
  layer-done counter (see :mod:`lmc.connectors.sglang.linker`).

Both key pages by SGLang's own page hashes in a namespace of their own, because SGLang gives
neither plug-in the tokens (:mod:`lmc.connectors.sglang.pages`). ``lmc.<key>`` entries of the
extra config override any ``CacheConfig`` key of ``lmc.config_file``; ``lmc.model_id`` names
the model in the key namespace, used as given (default: the checkpoint SGLang loaded, by its
bytes or ``lmc.model_revision``: :mod:`lmc.connectors.sglang.model`).

The storage backend's hit count (``batch_exists``) is the load policy's: the held pages that
beat recomputing at the measured tier speeds and the ``load_policy_priors`` prefill rate
(:mod:`lmc.connectors.sglang.policy`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from lmc.cache_engine import CacheEngine
from lmc.connectors.sglang.linker import LMCCacheLinker
from lmc.connectors.sglang.model import running_model, sglang_model_id
from lmc.connectors.sglang.pages import (
    PageStore,
    UnsupportedPool,
    flat_page_view,
    host_pool_spec_and_views,
    load_settings,
    page_namespace,
    per_rank_config,
    side_pool_refusal,
)
from lmc.connectors.sglang.policy import PageHitPolicy

log = logging.getLogger(__name__)

__all__ = ["LMCCacheLinker", "LMCHiCacheStorage", "UnsupportedPool", "load_settings"]


class LMCHiCacheStorage(HiCacheStorage):
    """lmc's tiers as SGLang's HiCache L3. Constructed by SGLang's dynamic factory as
    ``LMCHiCacheStorage(storage_config, kwargs)``; the engine is built when SGLang registers
    the host pool (its geometry and layout are known only then).

    Data-path calls never raise into SGLang's storage threads (an exception there kills the
    thread for the process's life): a failure is logged and reported as misses / False.
    """

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: Mapping[str, Any] | None = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise TypeError("LMCHiCacheStorage(storage_config, kwargs): storage_config must be "
                            f"a HiCacheStorageConfig, got {type(storage_config).__name__}")
        c = storage_config
        if c.dcp_size != 1:
            raise UnsupportedPool("decode context parallelism (dcp_size > 1) is not supported "
                                  "by lmc's SGLang backend")
        if c.should_split_heads:
            raise UnsupportedPool("split-head page layouts (should_split_heads) are not "
                                  "supported by lmc's SGLang backend")
        self.storage_config = c
        self.extra_config = dict(c.extra_config or {})
        self.cache_config, opts = load_settings({**self.extra_config, **dict(kwargs or {})})
        path, revision = running_model()
        self.model_id = sglang_model_id(opts, self.cache_config, path or c.model_name, revision,
                                        "LMCHiCacheStorage", "the extra config")
        self.is_writer = bool(c.is_storage_writer)
        self.engine: CacheEngine | None = None
        self.pages: PageStore | None = None
        self.hit_policy: PageHitPolicy | None = None
        self._pool: Any = None
        self.registered_pools: dict[Any, Any] = {}
        self.stats_counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------- registration
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind to SGLang's host KV pool: build the engine for its geometry (refusing, by
        name, layouts, dtypes and pools lmc cannot move bit for bit)."""
        super().register_mem_pool_host(mem_pool_host)
        with self._lock:
            if self._pool is not None:
                if self._pool is mem_pool_host:
                    return
                raise RuntimeError("LMCHiCacheStorage is already bound to another host pool")
            spec, views = host_pool_spec_and_views(mem_pool_host)
            c = self.storage_config
            ns = page_namespace(self.model_id, spec, page_size=int(mem_pool_host.page_size),
                                tp_rank=c.tp_rank, tp_size=c.tp_size, pp_rank=c.pp_rank,
                                pp_size=c.pp_size, cp_rank=c.attn_cp_rank,
                                cp_size=c.attn_cp_size, rank_replicated=c.is_mla_model,
                                tenant=self.cache_config.tenant)
            tp = (0, 1) if c.is_mla_model else (c.tp_rank, c.tp_size)
            config = per_rank_config(self.cache_config, c.tp_rank, c.tp_size, c.pp_rank,
                                     c.pp_size)
            engine = CacheEngine(config, spec, self.model_id, *tp)
            try:
                pages = PageStore(engine, ns, int(mem_pool_host.page_size), views)
                policy = PageHitPolicy(engine, config, int(mem_pool_host.page_size))
            except BaseException:
                engine.close()
                raise
            self.engine, self.pages, self.hit_policy = engine, pages, policy
            self._pool = mem_pool_host
        log.info("lmc HiCache backend: model %s, %s host pool (%s, %d layers, page %d), "
                 "tp %d/%d pp %d/%d, writer=%s, load policy %s", self.model_id,
                 type(mem_pool_host).__name__, mem_pool_host.layout, spec.num_layers,
                 mem_pool_host.page_size, c.tp_rank, c.tp_size, c.pp_rank, c.pp_size,
                 self.is_writer, policy.describe())

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Only the KV pool: side pools (Mamba, SWA, DSA indexer, ...) are refused at attach
        time, so a hybrid model never half-restores its state."""
        if host_pool_name != PoolName.KV:
            raise side_pool_refusal(f"backend ({type(host_pool).__name__} registered)",
                                    host_pool_name)
        self.registered_pools[host_pool_name] = host_pool
        self.register_mem_pool_host(host_pool)

    def _count(self, name: str, n: int = 1) -> None:
        self.stats_counts[name] = self.stats_counts.get(name, 0) + n

    def _ready(self) -> PageStore:
        if self.pages is None:
            raise RuntimeError("no host pool registered (register_mem_pool_host not called)")
        if self._closed:
            raise RuntimeError("LMCHiCacheStorage is closed")
        return self.pages

    def _failed(self, op: str, e: BaseException) -> None:
        self._count(f"{op}_errors")
        log.warning("lmc HiCache %s failed (%s: %s): reported as a miss", op,
                    type(e).__name__, e)

    # ------------------------------------------------------- zero-copy v1 path
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading pages SGLang should read from lmc: of those some tier holds, the ones
        the load policy loads (:mod:`lmc.connectors.sglang.policy`: a page in a tier slower
        than recomputing is not reported, so SGLang recomputes it and never fetches it)."""
        try:
            found = self._ready().lookup(list(keys))
            policy = self.hit_policy
            return policy.pages(found) if policy is not None else 0
        except Exception as e:
            self._failed("exists", e)
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Fill host pages ``host_indices[i*page:(i+1)*page]`` with page ``keys[i]`` for the
        longest stored prefix: one planned scatter, no per-token work."""
        try:
            out = self._ready().load(list(keys), host_indices)
            self._count("pages_loaded", sum(out))
            return out
        except Exception as e:
            self._failed("get", e)
            return [False] * len(keys)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store host pages under ``keys`` (one planned gather). A replica that is not the
        storage writer (rank-replicated MLA KV) stores nothing: the writer's copy serves all."""
        if not self.is_writer:
            self._count("pages_skipped_not_writer", len(keys))
            return [True] * len(keys)
        try:
            out = self._ready().store(list(keys), host_indices)
            self._count("pages_stored", sum(out))
            return out
        except Exception as e:
            self._failed("set", e)
            return [False] * len(keys)

    # ------------------------------------------------------------ generic path
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Flat pages in the host layout's byte order (``set_from_flat_data_page`` input),
        written into ``target_locations`` when given; None from the first miss on."""
        try:
            pages = self._ready()
            pool = self.mem_pool_host
            if target_locations is None:
                target_locations = [pool.get_data_page(0, flat=True).clone() for _ in keys]
            n = pages.get_chunks(list(keys), [flat_page_view(pool, t) for t in target_locations])
        except Exception as e:
            self._failed("get", e)
            n = 0
        self._count("pages_loaded", n)
        return [t if i < n else None for i, t in enumerate(target_locations or [None] * len(keys))]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat host pages (``get_data_page(i, flat=True)``); True iff all stored."""
        if not self.is_writer:
            self._count("pages_skipped_not_writer", len(keys))
            return True
        try:
            pool = self.mem_pool_host
            out = self._ready().put_chunks(list(keys), [flat_page_view(pool, v) for v in values])
        except Exception as e:
            self._failed("set", e)
            return False
        self._count("pages_stored", sum(out))
        return all(out)

    def exists(self, key: str) -> bool:
        """Whether some tier holds the page (presence, not a hit count: no policy)."""
        try:
            return self._ready().prefix_hits([key]) == 1
        except Exception as e:
            self._failed("exists", e)
            return False

    # ----------------------------------------------------------------- v2 path
    def _kv_only(self, transfers: list[PoolTransfer] | None) -> None:
        for t in transfers or ():
            if t.name != PoolName.KV:
                raise side_pool_refusal("backend", t.name)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: Any = None) -> PoolTransferResult:
        self._kv_only(pool_transfers)
        n = self.batch_exists(keys, extra_info)
        return PoolTransferResult(n, {}, list(range(1, n + 1)))

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None
                     ) -> dict[Any, list[bool]]:
        self._kv_only(transfers)
        return {t.name: self.batch_get_v1(list(t.keys or []), t.host_indices, extra_info)
                for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None
                     ) -> dict[Any, list[bool]]:
        self._kv_only(transfers)
        return {t.name: self.batch_set_v1(list(t.keys or []), t.host_indices, extra_info)
                for t in transfers}

    # --------------------------------------------------------------- lifecycle
    def clear(self) -> None:
        """SGLang's ``/hicache/storage-backend/clear``: lmc's tiers are content-addressed
        and may be shared with other engines, so nothing is deleted; logged and ignored."""
        log.info("lmc HiCache clear(): ignored (lmc tiers are shared, content-addressed)")

    def get_stats(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        """This backend's counters, its load policy's (``policy.*``: decisions, tokens
        loaded by tier, recomputed by choice) and its engine's (diagnostics; Prometheus has
        them too)."""
        out: dict[str, Any] = dict(self.stats_counts)
        if self.hit_policy is not None:
            out.update(self.hit_policy.stats())
        if self.engine is not None and not self._closed:
            out.update(self.engine.stats())
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every stored page has reached the lower tiers."""
        return self.engine.flush(timeout) if self.engine is not None else True

    def close(self) -> None:
        """Called by SGLang when the backend is detached or the engine shuts down: drains the
        write-behind queues (pages written so far reach disk/remote), then closes the tiers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()
