"""SGLang's KV pages in lmc's tiers: page keys, pool views and keyed page copies.

SGLang 0.5.23 hands its storage plug-ins (``HiCacheStorage`` and ``UnifiedCacheLinker``)
per-page SHA-256 chain hashes and pool slot indices, never the tokens: a linker's ``lookup``
and ``load`` get a request id and the tail's page hashes, ``offload`` a tree node's hashes and
device slots, and a ``HiCacheStorage`` gets hashes and host-pool indices. Reaching the request
or its tokens would take a patch to SGLang. So SGLang pages are keyed by those hashes, mixed
with a namespace of their own (:func:`page_namespace`) that lmc's token-chain keys can never
produce: pages never meet another engine's chunks, another model or another sharding.

What is stored is lmc's layout-independent chunk (``KVSpec.chunk_shape(page_size)``:
``[layers, planes, page_size, heads*dim]``), whatever the pool's layout: SGLang's host
layouts (``layer_first``, ``page_first``, ``page_first_direct``) are strided views lmc's
transfer code reads off the tensors' strides (:func:`host_pool_views`), the device pools
(the linker's) are the ``sglang_mha`` / ``sglang_mla`` layouts. A page written from one layout
therefore loads into any other, and the host layout is deliberately not part of the key.

No SGLang import here: pools are read by their attributes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from lmc.cache_engine import CacheEngine
from lmc.config import CacheConfig
from lmc.layerwise import CopyLease
from lmc.memory.pool import Lease, MemoryObj
from lmc.storage.integrity import Geometry
from lmc.storage.lookup import LookupResult
from lmc.storage.tier import Key
from lmc.transfer.kv_spec import KVSpec
from lmc.transfer.plan import KVTransfer, TransferPlan

log = logging.getLogger(__name__)

PAGE_KEY_FORMAT = 1
HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PREFIX = "lmc."
OPTIONS = ("model_id",)


class UnsupportedPool(ValueError):
    """A pool lmc cannot move bit for bit; the message names what and why."""


# what an SGLang side pool (a PoolName's value) or tree component says about the model
MODEL_KINDS = {
    "swa": "a hybrid sliding-window/full-attention model (Gemma 2/3, gpt-oss, Mistral-style)",
    "mamba": "a hybrid state-space/linear-attention model (Qwen3-Next, Jamba, Nemotron-H)",
    "indexer": "a sparse-attention model with an indexer (DeepSeek V3.2 DSA)",
}


def side_pool_refusal(what: str, name: Any) -> UnsupportedPool:
    """The refusal of a side pool or component ``name`` (SWA, Mamba, ...), naming the model
    kind: lmc stores SGLang's full-attention KV pool only (hybrid models are served through
    vLLM and the reference engine, :mod:`lmc.hybrid`); half a hybrid model's state is never
    restored."""
    key = str(getattr(name, "value", name)).lower()
    kind = MODEL_KINDS.get(key, f"a model with a {key!r} side pool")
    return UnsupportedPool(f"lmc's SGLang {what} stores the full-attention KV pool only; "
                           f"refusing {key!r}: {kind} is not served through SGLang "
                           "(run it on vLLM, where lmc stores every KV cache group)")


def load_settings(extra: Mapping[str, Any] | None) -> tuple[CacheConfig, dict[str, Any]]:
    """``CacheConfig`` and connector options from an SGLang extra config: ``lmc.config_file``
    (YAML) < ``LMC_<KEY>`` variables < ``lmc.<key>`` entries; an unknown ``lmc.`` key fails
    with its name. Keys without the prefix are SGLang's and ignored."""
    ours = {k[len(PREFIX):]: v for k, v in (extra or {}).items()
            if isinstance(k, str) and k.startswith(PREFIX)}
    path = ours.pop("config_file", None)
    opts = {k: ours.pop(k) for k in OPTIONS if k in ours}
    return CacheConfig.load(path, overrides=ours), opts


def per_rank_config(config: CacheConfig, tp_rank: int, tp_size: int, pp_rank: int = 0,
                    pp_size: int = 1) -> CacheConfig:
    """One disk directory per rank (a disk tier is one process's: a second opener is
    refused): ``<local_disk>/tp<r>of<n>[_pp<r>of<n>]`` when there is more than one rank.
    Replicated (MLA) KV written by one rank reaches the others only through a shared remote
    tier (``remote_url``: Redis or lmc's daemon)."""
    if not config.local_disk or (tp_size == 1 and pp_size == 1):
        return config
    sub = f"tp{tp_rank}of{tp_size}" + (f"_pp{pp_rank}of{pp_size}" if pp_size > 1 else "")
    return config.replace(local_disk=os.path.join(config.local_disk, sub))


# ---------------------------------------------------------------------------- keys
def page_namespace(model_id: str, spec: KVSpec, *, page_size: int, tp_rank: int, tp_size: int,
                   pp_rank: int = 0, pp_size: int = 1, cp_rank: int = 0, cp_size: int = 1,
                   rank_replicated: bool = False, tenant: str | None = None) -> bytes:
    """The 16-byte seed of every SGLang page key: what must match for two pages' KV to be
    interchangeable. Rank-replicated KV (MLA) leaves the TP rank out, so every rank shares
    the one copy the writer rank stored."""
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    doc = {
        "format": PAGE_KEY_FORMAT,
        "kind": "sglang-page-sha256",
        "model": model_id,
        "kv": spec.namespace_fields(),
        "tp": None if rank_replicated else [tp_rank, tp_size],
        "pp": [pp_rank, pp_size],
        "cp": [cp_rank, cp_size],
        "page": page_size,
        "tenant": tenant,
    }
    return xxhash.xxh3_128_digest(json.dumps(doc, sort_keys=True).encode())


def sglang_page_hashes(tokens: Sequence[int], page_size: int, prior_hash: str | None = None
                       ) -> list[str]:
    """SGLang's page-hash chain over ``tokens`` (its ``get_hash_str``; a partial last page
    is hashed too, as SGLang does):
    ``h_i = SHA-256(h_{i-1} || page i's ids as little-endian uint32)``, a page holding an id
    above 2**32-1 being hashed as a 0xff tag and uint64 ids instead. Lets a process that has
    the tokens (another engine, a tool) name the pages SGLang stores, without SGLang."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    prior = bytes.fromhex(prior_hash) if prior_hash else b""
    out = []
    for start in range(0, len(tokens), page_size):
        page = [int(t) for t in tokens[start:start + page_size]]
        if any(t < 0 for t in page):
            raise ValueError("token ids must be non-negative")
        wide = any(t > 0xFFFFFFFF for t in page)
        data = (b"\xff" + struct.pack(f"<{len(page)}Q", *page) if wide
                else struct.pack(f"<{len(page)}I", *page))
        prior = hashlib.sha256(prior + data).digest()
        out.append(prior.hex())
    return out


def page_keys(namespace: bytes, hashes: Sequence[str]) -> list[Key]:
    """lmc keys of SGLang page hashes (any strings; SGLang's are 64 hex digits)."""
    return [xxhash.xxh3_128_digest(namespace + h.encode()) for h in hashes]


# ---------------------------------------------------------------------------- pools
def _check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype == torch.uint8:
        raise UnsupportedPool(
            f"{what} stores fp8 KV as uint8: refused, since the bytes do not say which fp8 "
            "format they hold and a page stored under one would load as the other; use a "
            "bf16/fp16/fp32 KV cache with lmc")


def host_pool_spec_and_views(pool: Any) -> tuple[KVSpec, list[torch.Tensor]]:
    """An lmc spec and per-layer views of a HiCache host pool (``MHATokenToKVPoolHost`` or
    ``MLATokenToKVPoolHost``) in any of :data:`HOST_LAYOUTS`.

    Each MHA layer is ``[2, pages, page_size, heads, head_dim]`` (the ``vllm_flash`` axes:
    descriptors carry axes, not engines), each MLA layer ``[pages, page_size, latent]``
    (``vllm_mla``); the views share the pool's memory, so host index ``i`` is slot ``i``."""
    layout = getattr(pool, "layout", None)
    if layout not in HOST_LAYOUTS:
        raise UnsupportedPool(f"HiCache host layout {layout!r} is not supported by lmc; use "
                              f"--hicache-mem-layout one of {', '.join(HOST_LAYOUTS)}")
    if getattr(pool, "dcp_size", 1) != 1:
        raise UnsupportedPool("decode context parallelism (dcp_size > 1) splits pages across "
                              "ranks; lmc's SGLang backend does not support it")
    buf, ps, nl = pool.kv_buffer, int(pool.page_size), int(pool.layer_num)
    _check_dtype(buf.dtype, f"host pool {type(pool).__name__}")
    mla = hasattr(pool, "kv_lora_rank")
    if not mla and int(getattr(pool, "v_head_dim", pool.head_dim)) != int(pool.head_dim):
        raise UnsupportedPool(f"MHA pool with v_head_dim={pool.v_head_dim} != head_dim="
                              f"{pool.head_dim}: K and V pages differ in width; not supported")
    if layout != "page_first_direct" and int(pool.size) % ps:
        raise UnsupportedPool(f"host pool of {pool.size} tokens is not a whole number of "
                              f"{ps}-token pages")
    if mla:
        if layout == "layer_first":      # [L, size, 1, d]
            views = [buf[i, :, 0].unflatten(0, (-1, ps)) for i in range(nl)]
        elif layout == "page_first":     # [size, L, 1, d]
            views = [buf[:, i, 0].unflatten(0, (-1, ps)) for i in range(nl)]
        else:                            # [pages, L, page, 1, d]
            views = [buf[:, i, :, 0] for i in range(nl)]
        name = "vllm_mla"
    else:
        if layout == "layer_first":      # [2, L, size, H, D]
            views = [buf[:, i].unflatten(1, (-1, ps)) for i in range(nl)]
        elif layout == "page_first":     # [2, size, L, H, D]
            views = [buf[:, :, i].unflatten(1, (-1, ps)) for i in range(nl)]
        else:                            # [2, pages, L, page, H, D]
            views = [buf[:, :, i] for i in range(nl)]
        name = "vllm_flash"
    return KVSpec.from_tensors(views, name, block_size=ps), views


def device_pool_spec_and_caches(pool: Any) -> tuple[KVSpec, Any]:
    """An lmc spec and the cache tensors of an SGLang device pool: ``MHATokenToKVPool``
    (``sglang_mha``: its ``k_buffer``/``v_buffer`` lists) or ``MLATokenToKVPool``
    (``sglang_mla``: its ``kv_buffer`` list)."""
    if hasattr(pool, "kv_lora_rank"):
        caches: Any = list(pool.kv_buffer)
        _check_dtype(caches[0].dtype, f"device pool {type(pool).__name__}")
        return KVSpec.from_tensors(caches, "sglang_mla"), caches
    if not (hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer")):
        raise UnsupportedPool(f"device pool {type(pool).__name__} is neither an MHA pool "
                              "(k_buffer/v_buffer) nor an MLA pool (kv_buffer, kv_lora_rank)")
    ks, vs = list(pool.k_buffer), list(pool.v_buffer)
    if ks[0].shape[-1] != vs[0].shape[-1]:
        raise UnsupportedPool(f"MHA pool with v_head_dim={vs[0].shape[-1]} != head_dim="
                              f"{ks[0].shape[-1]}: not supported")
    _check_dtype(ks[0].dtype, f"device pool {type(pool).__name__}")
    return KVSpec.from_tensors((ks, vs), "sglang_mha"), (ks, vs)


def flat_page_view(pool: Any, flat: torch.Tensor) -> torch.Tensor:
    """A flat host page (``get_data_page(i, flat=True)``, the generic storage path's format,
    in the pool layout's byte order) viewed as lmc's chunk ``[layers, planes, page, row]``."""
    L, ps, layout = int(pool.layer_num), int(pool.page_size), pool.layout
    if hasattr(pool, "kv_lora_rank"):
        d = flat.numel() // (L * ps)
        if layout == "page_first":
            return flat.view(ps, L, d).transpose(0, 1).unsqueeze(1)
        return flat.view(L, ps, d).unsqueeze(1)          # layer_first, page_first_direct
    row = flat.numel() // (2 * L * ps)
    if layout == "page_first":
        return flat.view(2, ps, L, row).permute(2, 0, 1, 3)
    return flat.view(2, L, ps, row).transpose(0, 1)      # layer_first, page_first_direct


# ---------------------------------------------------------------------------- copies
class PageStore:
    """Keyed page copies between one SGLang pool and a :class:`CacheEngine`'s tiers.

    Pages are lmc chunks of ``page_size`` tokens; page ``i`` of a call covers
    ``slots[i*page_size:(i+1)*page_size]``. Built on the engine's public parts only: its cached
    transfer for the pool's tensors, its tiers by key (``engine.chunks``,
    :class:`lmc.keyed_chunks.KeyedChunks`), its speeds and metrics.

    What another process may have written is checked before it is used: the lower tiers
    refuse (count, delete, miss) a value whose header is not a page of this pool's geometry
    (``KeyedChunks.expect_geometry``), and a page of another shape or dtype met anyway
    is deleted and ends the prefix. What SGLang hands in is checked before it is stored: a
    page with an unmapped (negative) slot is refused, as ``CacheEngine.store`` refuses such a
    chunk (its KV would be partly missing), and a page tensor of another dtype than the
    pool's is refused by name, never converted."""

    def __init__(self, engine: CacheEngine, namespace: bytes, page_size: int,
                 kv_caches: Any) -> None:
        self.engine = engine
        self.namespace = namespace
        self.page_size = page_size
        self.kv_caches = kv_caches  # held: the engine's transfer cache keeps weak references
        self.spec = engine.spec
        self.shape = self.spec.chunk_shape(page_size)
        # every value under these keys is exactly one page of this pool
        engine.chunks.expect_geometry(Geometry.of(self.spec, page_size, page_size))

    def transfer(self) -> KVTransfer:
        return self.engine.transfer_for(self.kv_caches)

    def keys(self, hashes: Sequence[str]) -> list[Key]:
        return page_keys(self.namespace, hashes)

    def lookup(self, hashes: Sequence[str]) -> LookupResult:
        """The leading pages present in some tier and, per page, the index of the fastest
        tier holding it (one batched pass over the tiers; counted in lmc's lookup metrics,
        in tokens): what the load policy decides from (:mod:`lmc.connectors.sglang.policy`)."""
        eng, ps = self.engine, self.page_size
        if not hashes:
            return LookupResult.miss(ps, eng.tier_names)
        t0 = time.perf_counter()
        sources = eng.chunks.sources(self.keys(hashes))
        eng.metrics.lookup(len(hashes) * ps, len(sources) * ps, time.perf_counter() - t0)
        return LookupResult(len(sources) * ps, ps, eng.tier_names, bytes(sources))

    def prefix_hits(self, hashes: Sequence[str]) -> int:
        """Leading pages present in any tier."""
        return self.lookup(hashes).tokens // self.page_size

    def _plan(self, tr: KVTransfer, slots: torch.Tensor, pages: Sequence[int]) -> TransferPlan:
        ps = self.page_size
        return tr.plan(slots, [(i * ps, (i + 1) * ps) for i in pages])

    def _slots(self, tr: KVTransfer, slots: torch.Tensor, n: int) -> torch.Tensor:
        slots = slots.detach().to("cpu") if slots.device.type != "cpu" else slots
        if slots.numel() < n * self.page_size:
            raise ValueError(f"{slots.numel()} slots for {n} pages of {self.page_size}")
        return tr.check_slots(slots[: n * self.page_size], n * self.page_size)

    def _unmapped(self, slots: torch.Tensor, n: int) -> list[bool]:
        """Per page, whether one of its slots is unmapped (negative)."""
        neg = (slots[: n * self.page_size] < 0).reshape(n, self.page_size).any(dim=1)
        return neg.tolist()

    def store(self, hashes: Sequence[str], slots: torch.Tensor) -> list[bool]:
        """Copy the pages at ``slots`` into L1 (and, by write-behind, the lower tiers) under
        ``hashes``: one planned gather for all of them. Pages already in L1 are not copied.
        Per page, whether it is stored (False: the pool was full of referenced chunks, or a
        slot of the page is unmapped: a page is stored whole or not at all)."""
        if not hashes:
            return []
        t0 = time.perf_counter()
        eng, tr = self.engine, self.transfer()
        slots = self._slots(tr, slots, len(hashes))
        keys = self.keys(hashes)
        unmapped = self._unmapped(slots, len(hashes))
        if True in unmapped:
            eng.metrics.skipped("unmapped_slots", sum(unmapped))
        present = eng.chunks.touch(keys)
        todo = [i for i, p in enumerate(present) if not p and not unmapped[i]]
        out = [p and not u for p, u in zip(present, unmapped)]
        if not todo:
            return out
        objs = eng.chunks.allocate(self.shape, self.spec.dtype, len(todo), self.page_size)
        if len(objs) < len(todo):
            eng.metrics.skipped("pool_full", len(todo) - len(objs))
            todo = todo[: len(objs)]
        if not todo:
            return out
        with CopyLease(objs) as lease:  # the gather owns objs until its handle is done
            lease.attach(tr.gather(self._plan(tr, slots, todo), [o.tensor for o in objs])).wait()
            eng.chunks.put([keys[i] for i in todo], objs)
        for i in todo:
            out[i] = True
        eng.metrics.transfer("store", len(todo) * self.page_size,
                             sum(o.nbytes for o in objs), time.perf_counter() - t0)
        return out

    def fetch(self, hashes: Sequence[str]) -> list[MemoryObj]:
        """The longest stored prefix of ``hashes`` as acquired chunks (release them); a chunk
        of another shape or dtype ends the prefix (never loaded as if it fitted)."""
        keys = self.keys(hashes)
        objs = self.engine.chunks.get_prefix(keys) if hashes else []
        for i, o in enumerate(objs):
            if tuple(o.shape) != self.shape or o.dtype != self.spec.dtype:
                log.error("page %d holds %s %s, expected %s %s: deleted, treated as a miss", i,
                          tuple(o.shape), o.dtype, self.shape, self.spec.dtype)
                Lease(objs[i:]).release()
                self.engine.chunks.delete(keys[i:i + 1])
                self.engine.metrics.skipped("bad_page", 1)
                return objs[:i]
        return objs

    def load(self, hashes: Sequence[str], slots: torch.Tensor) -> list[bool]:
        """Copy the longest stored prefix of ``hashes`` into the pool at ``slots`` (all layers,
        one planned scatter); per page, whether it was loaded."""
        if not hashes:
            return []
        t0 = time.perf_counter()
        tr = self.transfer()
        slots = self._slots(tr, slots, len(hashes))
        unmapped = self._unmapped(slots, len(hashes))
        if True in unmapped:  # a page loads whole or not at all: the prefix ends before it
            hashes = hashes[: unmapped.index(True)]
        objs = self.fetch(hashes) if hashes else []
        if objs:
            nbytes = sum(o.nbytes for o in objs)
            with CopyLease(objs) as lease:
                arrays = [o.array for o in objs] if tr.device.type == "cpu" else None
                plan = self._plan(tr, slots, range(len(objs)))
                t1 = time.perf_counter()
                lease.attach(tr.scatter(plan, [o.tensor for o in objs], arrays=arrays)).wait()
                copied = time.perf_counter() - t1
            if tr.device.type == "cpu" and self.engine.speeds.tiers:
                # L1's speed is the copy into the pool (the load policy's rule); a host
                # pool's copy ends when wait() returns, a device pool's copy is not timed
                self.engine.speeds.tiers[0].observe(nbytes, copied)
            self.engine.metrics.transfer("retrieve", len(objs) * self.page_size, nbytes,
                                         time.perf_counter() - t0)
        return [True] * len(objs) + [False] * (len(unmapped) - len(objs))

    def _check_page(self, i: int, t: torch.Tensor, what: str) -> None:
        """A page tensor SGLang handed in: this pool's dtype and chunk shape, or refused."""
        if t.dtype != self.spec.dtype:
            raise TypeError(f"{what} {i} is {str(t.dtype).removeprefix('torch.')}, the host "
                            f"pool's KV is {str(self.spec.dtype).removeprefix('torch.')}: "
                            "refused (never converted)")
        if tuple(t.shape) != self.shape:
            raise ValueError(f"{what} {i} has shape {tuple(t.shape)}, expected {self.shape}")

    # ---------------------------------------------------- generic (flat page) path
    def put_chunks(self, hashes: Sequence[str], chunks: Sequence[torch.Tensor]) -> list[bool]:
        """Store pages given as chunk-shaped tensors (any strides): the generic path."""
        eng = self.engine
        if len(chunks) < len(hashes):
            raise ValueError(f"{len(chunks)} pages for {len(hashes)} keys")
        for i in range(len(hashes)):  # all refused before any is stored
            self._check_page(i, chunks[i], "page")
        keys = self.keys(hashes)
        present = eng.chunks.touch(keys)
        out = list(present)
        todo = [i for i, p in enumerate(present) if not p]
        objs = eng.chunks.allocate(self.shape, self.spec.dtype, len(todo),
                                   self.page_size) if todo else []
        todo = todo[: len(objs)]
        with Lease(objs):
            for i, o in zip(todo, objs):
                o.tensor.copy_(chunks[i])
            if todo:
                eng.chunks.put([keys[i] for i in todo], objs)
        for i in todo:
            out[i] = True
        return out

    def get_chunks(self, hashes: Sequence[str], outs: Sequence[torch.Tensor]) -> int:
        """Copy the longest stored prefix into ``outs`` (chunk-shaped views); pages copied."""
        for i, dst in enumerate(outs[: len(hashes)]):
            self._check_page(i, dst, "target page")
        objs = self.fetch(hashes)
        with Lease(objs):
            for o, dst in zip(objs, outs):
                dst.copy_(o.tensor)
        return len(objs)
