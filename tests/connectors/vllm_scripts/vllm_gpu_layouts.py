"""Run with the vLLM venv's python: vLLM 0.32's own KV-cache layout resolution and allocation
on CPU tensors, lmc's adapter on the result, and vLLM's attention-side reads of what lmc wrote.

For every GPU backend lmc accepts and every layout vLLM can resolve for it:

1. the layout comes from ``resolve_kv_cache_layout`` (with ``VLLM_KV_CACHE_LAYOUT`` set, or
   the backends' own preference when unset), the per-layer tensors from
   ``get_kv_cache_config_from_groups`` + ``allocate_kv_cache``, exactly what the GPU model
   runner does (only the device differs);
2. ``lmc.connectors.vllm.layout.resolve_gpu`` maps them to a KVSpec;
3. known K/V written through lmc (a scatter) are read back with the attention's own view
   expression, and K/V written at vLLM's positions are read back through lmc (a gather);
4. KV saved from the vLLM-built cache loads bit-exact into vllm_flash and sglang_mha caches
   of the same model, and back.

Prints one JSON line: the cases checked. Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import json
import os
import sys
import types

import torch
from vllm.config import CacheConfig
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.worker.utils import allocate_kv_cache

from lmc import CacheConfig as LmcConfig
from lmc import CacheEngine, KVSpec
from lmc.connectors.vllm.layout import resolve_gpu
from lmc.transfer.torch_copy import TorchTransfer

L, H, D, BS, NB, LATENT = 3, 2, 8, 4, 12, 24
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
ALL_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def backend_layouts(name: str) -> list[str]:
    """What the backend declares (``supported_kv_cache_layouts``); FlashInfer's module needs
    the flashinfer package, absent here: it declares LBHNC/BLHNC on compute capability 10
    and nothing (vLLM's default preference) elsewhere, so both sets are tried."""
    try:
        classes = [AttentionBackendEnum[name].get_class()]
    except ModuleNotFoundError:
        classes = []  # vLLM's default preference, which holds LBHNC and BLHNC too
    return [x.name for x in get_supported_kv_cache_layouts(classes)]


def vllm_caches(name: str, requested: str | None, dtype: torch.dtype):
    supported = backend_layouts(name)
    if requested is not None and requested not in supported and requested not in ("NHD", "HND"):
        return None, None
    cc = CacheConfig(block_size=BS)
    vc = types.SimpleNamespace(cache_config=cc, kv_transfer_config=None,
                               attention_config=types.SimpleNamespace(hisparse_config=None))
    if requested is None:
        os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    else:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = requested
    layout = resolve_kv_cache_layout(vc, [supported])
    if name == "FLASHMLA":
        spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=LATENT, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=dtype)
    groups = [KVCacheGroupSpec(LAYERS, spec)]
    cc.num_gpu_blocks_override = NB
    config = get_kv_cache_config_from_groups(vc, groups, available_memory=10**9)
    caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    return layout, caches


def attention_view(name: str, layout, kv: torch.Tensor, b: int, o: int, h: int):
    """(K, V) of block b, token o, head h, read the way vLLM's attention reads the cache."""
    if name == "FLASHMLA":  # mla_attention.py:MLAAttention.bind_kv_cache
        return kv.squeeze(1)[b, o], None
    if name == "FLASHINFER":  # flashinfer.py:FlashInferImpl.forward
        perm = kv.permute(*layout.layer_view_order)
        k, v = perm.split(D, dim=-1)
        axes = [("B", "H", "N")[i] for i in layout.layer_view_order[:3]]
        idx = tuple({"B": b, "H": h, "N": o}[a] for a in axes)
        return k[idx], v[idx]
    k, v = kv.transpose(1, 2).split(D, dim=-1)  # flash_attn.py / triton_attn.py forward
    return k[b, o, h], v[b, o, h]


def check_case(name: str, requested: str | None, dtype: torch.dtype) -> str | None:
    layout, caches = vllm_caches(name, requested, dtype)
    if layout is None:
        return None
    choice = resolve_gpu(caches, name, allow_untested=False, kv_cache_layout=layout.name,
                         head_size=None if name == "FLASHMLA" else D)
    spec = choice.spec()
    tensors = list(choice.tensors)
    gen = torch.Generator().manual_seed(len(name) + len(layout.name))
    slots = torch.randperm(NB * BS, generator=gen)[:10]
    n = slots.numel()
    src = torch.randint(0, 256, (*spec.chunk_shape(n)[:-1], spec.row_width * dtype.itemsize),
                        dtype=torch.uint8, generator=gen).view(dtype)
    tr = TorchTransfer(spec, tensors)
    tr.scatter(tr.plan(slots, [(0, n)]), [src])
    heads = 1 if name == "FLASHMLA" else H
    for li, lname in enumerate(LAYERS):
        kv = caches[lname]
        for i, s in enumerate(slots.tolist()):
            b, o = divmod(s, BS)
            for h in range(heads):
                k, v = attention_view(name, layout, kv, b, o, h)
                w = spec.head_size
                want_k = src[li, 0, i, h * w:(h + 1) * w]
                if not torch.equal(k.view(torch.uint8), want_k.contiguous().view(torch.uint8)):
                    sys.exit(f"{name} {layout.name}: K of layer {li} slot {s} head {h} differs")
                if v is not None and not torch.equal(
                        v.view(torch.uint8), src[li, 1, i, h * w:(h + 1) * w].view(torch.uint8)):
                    sys.exit(f"{name} {layout.name}: V of layer {li} slot {s} head {h} differs")
    # nothing else was written: the allocation held zeros
    touched = sum(int(caches[x].view(torch.uint8).count_nonzero()) for x in LAYERS)
    written = int(src.view(torch.uint8).count_nonzero())
    if touched != written:
        sys.exit(f"{name} {layout.name}: {touched} nonzero bytes in the cache, {written} written")
    # the other way: what sits at vLLM's positions comes back through lmc's gather
    out = torch.zeros_like(src)
    tr.gather(tr.plan(slots, [(0, n)]), [out])
    if not torch.equal(out.view(torch.uint8), src.view(torch.uint8)):
        sys.exit(f"{name} {layout.name}: gather differs")
    if name != "FLASHMLA":
        cross_layout(spec, tensors, slots, name, layout.name)
    return f"{name}:{requested or 'default'}->{layout.name}:{str(dtype).removeprefix('torch.')}"


def hand_over(src: CacheEngine, dst: CacheEngine, keys: list) -> None:
    """Give ``dst`` the chunks ``src`` holds, as a shared tier would: bytes copied into
    ``dst``'s own pool (an L1 refuses another pool's objects)."""
    objs = src.storage.get_prefix(keys)
    copies = []
    for o in objs:
        c = dst.pool.allocate(o.shape, o.dtype, o.num_tokens)
        c.tensor.copy_(o.tensor)
        copies.append(c)
        o.release()
    dst.storage.put(keys[: len(copies)], copies)
    for c in copies:
        c.release()


def cross_layout(spec: KVSpec, tensors, slots, name: str, lay: str) -> None:
    """KV saved from the vLLM-built cache loads into vllm_flash and sglang_mha, and back."""
    n = slots.numel()
    toks = list(range(100, 100 + n))
    cfg = LmcConfig(chunk_size=BS * 2, local_cpu_size="4MiB")
    dt = spec.dtype
    flash = [torch.zeros(2, NB, BS, H, D, dtype=dt) for _ in range(L)]
    sgl = ([torch.zeros(NB * BS, H, D, dtype=dt) for _ in range(L)],
           [torch.zeros(NB * BS, H, D, dtype=dt) for _ in range(L)])
    for other_layout, other in (("vllm_flash", flash), ("sglang_mha", sgl)):
        ospec = KVSpec.from_tensors(other, other_layout)
        back = [torch.zeros_like(t) for t in tensors]
        with CacheEngine(cfg, spec, "m") as a, CacheEngine(cfg, ospec, "m") as b:
            a.store(toks, tensors, slots)
            keys = a.db.keys(toks)
            hand_over(a, b, keys)
            dst_slots = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(9))[:n]
            if b.retrieve(toks, other, dst_slots) != n:
                sys.exit(f"{name} {lay} -> {other_layout}: retrieve missed")
            mine, theirs = TorchTransfer(spec, tensors), TorchTransfer(ospec, other)
            x = torch.empty(spec.chunk_shape(n), dtype=dt)
            y = torch.empty(spec.chunk_shape(n), dtype=dt)
            mine.gather(mine.plan(slots, [(0, n)]), [x])
            theirs.gather(theirs.plan(dst_slots, [(0, n)]), [y])
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                sys.exit(f"{name} {lay} -> {other_layout}: KV differs after the load")
        back_spec = KVSpec.from_tensors(back, "vllm_gpu")  # and back, into vLLM's layout
        with CacheEngine(cfg, ospec, "m") as b2, CacheEngine(cfg, back_spec, "m") as c:
            b2.store(toks, other, dst_slots)
            keys = b2.db.keys(toks)
            hand_over(b2, c, keys)
            if c.retrieve(toks, back, slots) != n:
                sys.exit(f"{other_layout} -> {name} {lay}: retrieve missed")
        z = torch.empty(spec.chunk_shape(n), dtype=dt)
        tb = TorchTransfer(back_spec, back)
        tb.gather(tb.plan(slots, [(0, n)]), [z])
        if not torch.equal(z.view(torch.uint8), x.view(torch.uint8)):
            sys.exit(f"{other_layout} -> {name} {lay}: KV differs after the load back")


def main() -> None:
    done = []
    for name in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLASHMLA"):
        for requested in (None, "NHD", "HND", *ALL_LAYOUTS):
            dtypes = ((torch.bfloat16, torch.float16, torch.float32) if requested in (None, "HND")
                      else (torch.bfloat16,))
            for dtype in dtypes:
                case = check_case(name, requested, dtype)
                if case:
                    done.append(case)
    print(json.dumps({"cases": done}))


if __name__ == "__main__":
    main()
