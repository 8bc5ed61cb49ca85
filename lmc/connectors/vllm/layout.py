"""Which lmc ``KVSpec`` layout vLLM's KV tensors are, decided from facts, never guessed.

vLLM 0.32 hands ``register_kv_caches`` one 4-D view per layer, logically
``[blocks, kv_heads, block_size, C]``, over one shared allocation
(``vllm/v1/worker/utils.py:allocate_kv_cache`` ->
``vllm/v1/kv_cache_interface.py:create_kv_cache_views``, called from
``gpu_model_runner.py:initialize_kv_cache_tensors``). The *physical* order of those axes is
the KV-cache layout vLLM resolved once for the model
(``vllm/v1/attention/backends/utils.py:resolve_kv_cache_layout``: ``VLLM_KV_CACHE_LAYOUT``
wins, the legacy names NHD/HND meaning LBNHC/LBHNC, then a connector's required layout, then
the backends' preference, LBNHC by default), recorded in ``cache_config.kv_cache_layout``.
Its names (``vllm/v1/kv_cache_layout.py:KVCacheLayout``) spell the order of
``L(ayer) B(lock) H(ead) N(token) C``; block-outer ones (BL.., BHL..) interleave the layers
inside each block. lmc reads the strides from the tensors, so every order is one layout; the
resolved name is only cross-checked against them. What the bytes mean depends on the backend:

* ``FLASH_ATTN``, ``TRITON_ATTN``, ``FLASHINFER``: ``C = 2 * head_size``, K then V per
  (block, head, token): lmc's ``vllm_gpu``. The attention reads it as
  ``kv.transpose(1, 2).split(head_size, -1)`` (``flash_attn.py:FlashAttentionImpl.forward``,
  ``triton_attn.py:TritonAttentionImpl.forward``) or, for FlashInfer, permuted to its
  physical order first (``flashinfer.py:FlashInferImpl.forward``, ``layer_view_order``).
* ``FLASHMLA``: ``[blocks, 1, block_size, latent]``, which the MLA layer squeezes to
  ``[blocks, block_size, latent]`` (``mla_attention.py:MLAAttention.bind_kv_cache``): lmc's
  ``vllm_mla``.
* ``CPU_ATTN`` (verified here): ``C = 2 * head_size`` bytes-wise, but the kernels
  reinterpret each (block, head) slab as K transposed ``[head_size, block_size]`` followed by
  V ``[block_size, head_size]``: lmc's ``vllm_cpu``. The packing is chosen per kernel ISA
  (``_get_attn_isa``): ``vec`` and ``vec16`` pack that way, ``amx`` packs differently. So at
  start-up :func:`verify_cpu_packing` writes known K/V through vLLM's own
  ``cpu_attn_reshape_and_cache`` with the ISA in use and checks every element lands where
  ``vllm_cpu`` says; anything else is refused with a message naming the ISA.
* Any other backend is refused by name (5-D tensors of the layouts of earlier vLLM releases
  are still recognised by shape, with ``allow_untested``).

Quantized KV caches are refused everywhere: vLLM keeps scales outside the tensors (or, per
token and head, inline, which changes ``C``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lmc.transfer.kv_spec import KVSpec

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
        idx = ps.base + (s // bs) * ps.block + (s % bs) * ps.token + h * ps.head + d * ps.dim
        if not torch.equal(flat[idx], want):
            raise UnsupportedLayout(
                f"vLLM CPU attention ISA {isa!r} ({dtype}, block_size {bs}, head_size {D}) "
                f"packs {what} differently from lmc's vllm_cpu layout; lmc refuses rather "
                "than guess (AMX packs bf16 blocks in tiles: run with float16/float32, or a "
                "CPU without AMX)")


def _ordered(kv_caches: Mapping[str, torch.Tensor], group_of: Mapping[str, int] | None = None
             ) -> tuple[list[str], list[torch.Tensor]]:
    """Layer names in order and their tensors. ``group_of``: a hybrid model's KV cache
    group per layer: vLLM's hybrid allocator overlays the groups' tensors (a block id is
    one group's at a time), so only layers of one group must not share memory."""
    names = layer_order(list(kv_caches))
    tensors = [kv_caches[n] for n in names]
    seen: dict[tuple[int, int, int], str] = {}
    for n, t in zip(names, tensors):
        sig = (t.data_ptr(), int(t.storage_offset()), (group_of or {}).get(n, 0))
        if sig in seen:
            raise UnsupportedLayout(f"layers {seen[sig]} and {n} share one KV cache (cross-layer "
                                    "KV sharing); lmc's chunk format has one entry per layer")
        seen[sig] = n
    return names, tensors


def resolve_cpu(kv_caches: Mapping[str, torch.Tensor], isa: str,
                group_of: Mapping[str, int] | None = None) -> LayoutChoice:
    names, tensors = _ordered(kv_caches, group_of)
    t0 = tensors[0]
    if t0.dim() != 4 or t0.shape[-1] % 2:
        raise UnsupportedLayout(f"CPU_ATTN cache {names[0]} has shape {tuple(t0.shape)}; "
                                "expected [blocks, kv_heads, block_size, 2*head_size]")
    nb, H, bs, D2 = t0.shape
    verify_cpu_packing(isa, t0.dtype, bs, H, D2 // 2)
    how = "verified end to end" if isa == "vec" else "verified by the packing probe"
    return LayoutChoice("vllm_cpu", tuple(names), tuple(tensors), "CPU_ATTN",
                        f"CPU_ATTN isa={isa} ({how})")


GPU_INTERLEAVED = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")  # -> vllm_gpu
GPU_MLA = ("FLASHMLA",)                                        # -> vllm_mla
# vLLM's legacy layout names (resolve_kv_cache_layout treats them as aliases)
LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


def physical_order(kv_cache_layout: str) -> str:
    """The memory order (outermost first) of a per-layer ``[B, H, N, C]`` view under vLLM's
    layout name: its letters without L (``KVCacheLayout.layer_view_order``)."""
    name = LAYOUT_ALIASES.get(kv_cache_layout, kv_cache_layout)
    if sorted(name) != sorted("LBHNC"):
        raise UnsupportedLayout(f"unknown vLLM KV cache layout {kv_cache_layout!r}")
    return name.replace("L", "")


def check_layout_order(name: str, t: torch.Tensor, kv_cache_layout: str) -> None:
    """The tensor's strides must put B, H, N, C in the order vLLM's layout name says (axes
    of size 1 excepted): lmc reads the strides either way, but a disagreement means vLLM built
    something this adapter does not understand."""
    order = physical_order(kv_cache_layout)
    axes = [a for a in order if t.shape["BHNC".index(a)] > 1]
    strides = [t.stride("BHNC".index(a)) for a in axes]
    if strides != sorted(strides, reverse=True) or len(set(strides)) != len(strides):
        raise UnsupportedLayout(
            f"vLLM resolved KV cache layout {kv_cache_layout} (physical order {order}), but "
            f"cache {name} has shape {tuple(t.shape)} with strides {t.stride()}")


def resolve_gpu(kv_caches: Mapping[str, torch.Tensor], backend: str, allow_untested: bool,
                kv_cache_layout: str | None = None, head_size: int | None = None,
                group_of: Mapping[str, int] | None = None) -> LayoutChoice:
    """``kv_cache_layout``: ``cache_config.kv_cache_layout`` (checked against the strides
    when given). ``head_size``: the model's, checked against ``C = 2 * head_size`` of the
    interleaved backends (inline scales or padding would change it). ``group_of``: as
    :func:`_ordered`'s."""
    names, tensors = _ordered(kv_caches, group_of)
    t0 = tensors[0]
    shape = tuple(t0.shape)
    four_d = t0.dim() == 4  # vLLM 0.32's [B, H, N, C]; 5-D: an earlier release's layouts
    if backend in GPU_INTERLEAVED + GPU_MLA and four_d:
        if kv_cache_layout is not None:
            for n, t in zip(names, tensors):
                check_layout_order(n, t, kv_cache_layout)
        how = f"layout {kv_cache_layout or 'read from strides'}, strides {t0.stride()}"
    if backend in GPU_INTERLEAVED and four_d:
        if head_size is not None and shape[3] != 2 * head_size:
            raise UnsupportedLayout(f"{backend} cache {names[0]} has C = {shape[3]}, not 2 * "
                                    f"head_size {head_size}: padded or with inline scales")
        return LayoutChoice("vllm_gpu", tuple(names), tuple(tensors), backend,
                            f"{backend} as vllm_gpu ({how})")
    if backend in GPU_MLA and four_d:
        if shape[1] != 1:
            raise UnsupportedLayout(f"{backend} cache {names[0]} has shape {shape}: MLA needs "
                                    "one latent head (dim 1 == 1)")
        return LayoutChoice("vllm_mla", tuple(names), tuple(t.squeeze(1) for t in tensors),
                            backend, f"{backend} as vllm_mla ({how})")
    refusal = (f"attention backend {backend} with this cache is not one lmc addresses (vLLM 0.32: "
               f"{', '.join(GPU_INTERLEAVED)} as vllm_gpu, {', '.join(GPU_MLA)} as vllm_mla, "
               f"CPU_ATTN as vllm_cpu); cache {names[0]} has shape {shape}, strides "
               f"{t0.stride()}")
    if t0.dim() == 5 and shape[0] == 2:
        choice = LayoutChoice("vllm_flash", tuple(names), tuple(tensors), backend,
                              f"{backend} as vllm_flash (shape match)")
    elif t0.dim() == 5 and shape[1] == 2:
        choice = LayoutChoice("vllm_flashinfer", tuple(names), tuple(tensors), backend,
                              f"{backend} as vllm_flashinfer (shape match)")
    else:
        raise UnsupportedLayout(refusal + "; lmc refuses rather than store wrong KV")
    if not allow_untested:
        raise UnsupportedLayout(f"{refusal}; it maps onto lmc's {choice.layout} by shape (an "
                                "earlier vLLM's layout). Set lmc.vllm.allow_untested=true to "
                                "use it anyway")
    return choice
