"""Which lmc ``KVSpec`` layout vLLM's KV tensors are, decided from facts, never guessed.

vLLM 0.32 hands ``register_kv_caches`` one 4-D view per layer, logically
``[blocks, kv_heads, block_size, C]``, over one shared allocation. What the bytes mean depends
on the attention backend:

* ``CPU_ATTN`` (verified here): ``C = 2 * head_size`` bytes-wise, but the kernels
  reinterpret each (block, head) slab as K transposed ``[head_size, block_size]`` followed by
  V ``[block_size, head_size]``: lmc's ``vllm_cpu`` layout. The packing is chosen per
  kernel ISA (``_get_attn_isa``): ``vec`` and ``vec16`` pack that way (``vec`` verified end
  to end against K/V computed from the weights, ``vec16`` by the probe below), ``amx`` packs
  differently. So at start-up :func:`verify_cpu_packing` writes known K/V through vLLM's own
  ``cpu_attn_reshape_and_cache`` with the ISA in use and checks every element lands where
  ``vllm_cpu`` says; anything else is refused with a message naming the ISA.
* MLA backends: ``[blocks, 1, block_size, latent]``, contiguous: lmc's ``vllm_mla``. Mapped
  by geometry, but never run against lmc here (no GPU), so accepted only with
  ``vllm.allow_untested: true``.
* Other GPU backends (FLASH_ATTN, FLASHINFER, TRITON_ATTN, ...): 0.32 stores K and V
  interleaved per token and head in the last dim (``C = [K | V]``), which none of lmc's
  layouts describe (``vllm_flash`` / ``vllm_flashinfer`` hold separate K and V planes, the
  layout of earlier vLLM releases). Refused with that explanation; 5-D tensors of the
  earlier layouts are still recognised by shape (for other versions, with
  ``allow_untested``).

fp8 KV caches are refused everywhere: vLLM keeps per-layer scales outside the tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lmc.kv_spec import KVSpec

TESTED_VLLM = ("0.32.",)
VERIFIED_CPU_ISAS = ("vec", "vec16")  # the probe still runs for these at every start-up


class UnsupportedLayout(RuntimeError):
    """vLLM's KV cache is something lmc cannot address correctly: refuse at start-up."""


@dataclass(frozen=True)
class LayoutChoice:
    """The KV tensors as lmc addresses them, in layer order."""

    layout: str
    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    backend: str
    detail: str

    def spec(self) -> KVSpec:
        return KVSpec.from_tensors(list(self.tensors), self.layout)


def check_version(version: str, allow_untested: bool) -> None:
    if version.startswith(TESTED_VLLM):
        return
    msg = (f"lmc's vLLM connector was tested with vLLM {', '.join(TESTED_VLLM)}x only; this "
           f"is vLLM {version}, whose KV layout and connector hooks lmc has not verified")
    if not allow_untested:
        raise UnsupportedLayout(msg + " (set lmc.vllm.allow_untested=true to try anyway)")


def layer_order(names: list[str]) -> list[str]:
    """Layer names sorted by their layer index (``model.layers.12.self_attn.attn``)."""
    def index(name: str) -> tuple[int, str]:
        m = re.search(r"layers\.(\d+)\.", name) or re.search(r"(\d+)", name)
        return (int(m.group(1)) if m else 1 << 30, name)
    return sorted(names, key=index)


def check_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in ("auto", "float16", "bfloat16", "float32", "half", "float"):
        raise UnsupportedLayout(
            f"kv_cache_dtype={kv_cache_dtype!r}: quantized KV caches keep per-layer scales "
            "outside the cache tensors, which lmc does not store; use kv_cache_dtype='auto'")


def verify_cpu_packing(isa: str, dtype: torch.dtype, block_size: int, num_kv_heads: int,
                       head_size: int) -> None:
    """Write known K/V with vLLM's own packing op for ``isa`` and check each element sits
    where lmc's ``vllm_cpu`` layout puts it. Raises :class:`UnsupportedLayout` otherwise."""
    from vllm._custom_ops import cpu_attn_reshape_and_cache

    H, D, bs, nb = num_kv_heads, head_size, block_size, 2
    spec = KVSpec(1, H, D, dtype, bs, "vllm_cpu", num_blocks=nb)
    cache = torch.zeros(spec.layer_shape(), dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(bs, H, D, generator=gen).to(dtype)
    value = torch.randn(bs, H, D, generator=gen).to(dtype)
    slots = torch.arange(bs, 2 * bs, dtype=torch.long)  # all of block 1
    k_cache, v_cache = cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
    try:
        cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
    except Exception as e:
        raise UnsupportedLayout(f"vLLM CPU attention ISA {isa!r}: its packing op failed on a "
                                f"probe ({type(e).__name__}: {e})") from e
    flat = cache.view(-1)
    s = slots.view(-1, 1, 1)
    h = torch.arange(H).view(1, -1, 1)
    d = torch.arange(D).view(1, 1, -1)
    for ps, want, what in zip(spec.plane_strides(), (key, value), "KV"):
        idx = ps.base + (s // bs) * ps.s_blk + (s % bs) * ps.s_off + h * ps.s_h + d * ps.s_d
        if not torch.equal(flat[idx], want):
            raise UnsupportedLayout(
                f"vLLM CPU attention ISA {isa!r} ({dtype}, block_size {bs}, head_size {D}) "
                f"packs {what} differently from lmc's vllm_cpu layout; lmc refuses rather "
                "than guess (AMX packs bf16 blocks in tiles: run with float16/float32, or a "
                "CPU without AMX)")


def _ordered(kv_caches: Mapping[str, torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
    names = layer_order(list(kv_caches))
    tensors = [kv_caches[n] for n in names]
    seen: dict[tuple[int, int], str] = {}
    for n, t in zip(names, tensors):
        sig = (t.data_ptr(), t.storage_offset())
        if sig in seen:
            raise UnsupportedLayout(f"layers {seen[sig]} and {n} share one KV cache (cross-layer "
                                    "KV sharing); lmc's chunk format has one entry per layer")
        seen[sig] = n
    return names, tensors


def resolve_cpu(kv_caches: Mapping[str, torch.Tensor], isa: str) -> LayoutChoice:
    names, tensors = _ordered(kv_caches)
    t0 = tensors[0]
    if t0.dim() != 4 or t0.shape[-1] % 2:
        raise UnsupportedLayout(f"CPU_ATTN cache {names[0]} has shape {tuple(t0.shape)}; "
                                "expected [blocks, kv_heads, block_size, 2*head_size]")
    nb, H, bs, D2 = t0.shape
    verify_cpu_packing(isa, t0.dtype, bs, H, D2 // 2)
    how = "verified end to end" if isa == "vec" else "verified by the packing probe"
    return LayoutChoice("vllm_cpu", tuple(names), tuple(tensors), "CPU_ATTN",
                        f"CPU_ATTN isa={isa} ({how})")


def resolve_gpu(kv_caches: Mapping[str, torch.Tensor], backend: str, allow_untested: bool
                ) -> LayoutChoice:
    names, tensors = _ordered(kv_caches)
    t0 = tensors[0]
    shape = tuple(t0.shape)
    untested = (f"attention backend {backend} was never run against lmc (no GPU where lmc "
                "is tested)")
    if "MLA" in backend.upper():
        if t0.dim() == 4 and shape[1] == 1 and all(t.is_contiguous() for t in tensors):
            choice = LayoutChoice("vllm_mla", tuple(names),
                                  tuple(t.view(shape[0], shape[2], shape[3]) for t in tensors),
                                  backend, f"{backend} as vllm_mla (geometry match)")
        elif t0.dim() == 3:
            choice = LayoutChoice("vllm_mla", tuple(names), tuple(tensors), backend,
                                  f"{backend} as vllm_mla (shape match)")
        else:
            raise UnsupportedLayout(f"{backend} cache {names[0]} has shape {shape}, strides "
                                    f"{t0.stride()}: not a contiguous [blocks, block_size, "
                                    "latent] cache")
    elif t0.dim() == 5 and shape[0] == 2:
        choice = LayoutChoice("vllm_flash", tuple(names), tuple(tensors), backend,
                              f"{backend} as vllm_flash (shape match)")
    elif t0.dim() == 5 and shape[1] == 2:
        choice = LayoutChoice("vllm_flashinfer", tuple(names), tuple(tensors), backend,
                              f"{backend} as vllm_flashinfer (shape match)")
    else:
        raise UnsupportedLayout(
            f"attention backend {backend}: cache {names[0]} is a {shape} view with strides "
            f"{t0.stride()}, i.e. K and V interleaved per token and head in the last dim. "
            "lmc's layouts vllm_flash / vllm_flashinfer expect separate K and V planes (the "
            "layout before vLLM 0.32), so lmc refuses rather than store wrong KV")
    if not allow_untested:
        raise UnsupportedLayout(f"{untested}; its cache maps onto lmc's {choice.layout} by "
                                "shape. Set lmc.vllm.allow_untested=true to use it anyway")
    return choice
