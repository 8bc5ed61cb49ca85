"""``KVSpec``: one description of every engine KV layout, so one gather/scatter serves them all.

A layer's cache holds, for each *plane* (K and V, or the single MLA latent plane), one vector of
``num_kv_heads * head_size`` elements per token slot. Where that element lives is an affine
function of the slot's block, its offset in the block, the head and the dim::

    elem(plane p, slot s, head h, dim d) = base[p] + (s // block_size) * s_blk[p]
                                          + (s % block_size) * s_off[p] + h * s_h[p] + d * s_d[p]

:meth:`KVSpec.plane_strides` returns those numbers; the torch path and the CUDA kernels both
work from them. The stored chunk format never depends on the layout (see ``chunk_shape``), so
KV saved from one layout loads into any other for the same model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

LAYOUTS: tuple[str, ...] = (
    "vllm_flash",       # per layer [2, num_blocks, block_size, kv_heads, head_size]
    "vllm_flashinfer",  # per layer [num_blocks, 2, block_size, kv_heads, head_size]
    "vllm_mla",         # per layer [num_blocks, block_size, latent_dim]
    "vllm_cpu",         # per layer [num_blocks, kv_heads, block_size, 2*head_size], K transposed
    "sglang_mha",       # per layer k_buffer / v_buffer [num_slots, kv_heads, head_size]
    "sglang_mla",       # per layer [num_slots, 1, latent_dim]
)
MLA_LAYOUTS = frozenset({"vllm_mla", "sglang_mla"})
SLOT_LAYOUTS = frozenset({"sglang_mha", "sglang_mla"})  # no blocks: block_size is 1

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(
    d for d in (torch.float32, torch.float16, torch.bfloat16,
                getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if d is not None
)

KVCaches = Any  # list/tuple of tensors, name->tensor mapping, or (k_buffers, v_buffers)


@dataclasses.dataclass(frozen=True)
class PlaneStrides:
    """Element offsets of one plane inside its layer tensor (see the module docstring)."""

    base: int
    s_blk: int
    s_off: int
    s_h: int
    s_d: int


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """Shape of an engine's KV cache. MLA layouts have one plane, ``num_kv_heads == 1`` and
    ``head_size`` equal to the latent dimension."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    layout: str
    num_blocks: int = 0  # capacity of the engine cache (slots for sglang); 0 = not checked

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"KV dtype {self.dtype} is not supported; use one of "
                            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"KVSpec.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.use_mla and self.num_kv_heads != 1:
            raise ValueError(f"MLA layout {self.layout} has one latent 'head', got "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.layout in SLOT_LAYOUTS and self.block_size != 1:
            raise ValueError(f"{self.layout} addresses slots directly: block_size must be 1, "
                             f"got {self.block_size}")

    # ------------------------------------------------------------------ derived
    @property
    def use_mla(self) -> bool:
        return self.layout in MLA_LAYOUTS

    @property
    def num_planes(self) -> int:
        return 1 if self.use_mla else 2

    @property
    def row_width(self) -> int:
        """Elements of one token in one plane of one layer."""
        return self.num_kv_heads * self.head_size

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """The stored, layout-independent format: ``[layers, planes, tokens, heads*dim]``."""
        return (self.num_layers, self.num_planes, num_tokens, self.row_width)

    def chunk_nbytes(self, num_tokens: int) -> int:
        return self.num_layers * self.num_planes * num_tokens * self.row_width * self.element_size

    def namespace_fields(self) -> dict[str, Any]:
        """What identifies stored KV: the layout and cache capacity are deliberately absent."""
        return {
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "mla": self.use_mla,
        }

    def plane_strides(self) -> tuple[PlaneStrides, ...]:
        """Per plane, where a (slot, head, dim) element lives inside its layer tensor.

        For ``sglang_mha`` each plane is its own tensor (``k_buffer``, ``v_buffer``), so both
        planes have ``base == 0`` relative to their own tensor.
        """
        H, D, bs, nb = self.num_kv_heads, self.head_size, self.block_size, self.num_blocks
        W = H * D
        lay = self.layout
        if lay == "vllm_flash":
            return tuple(PlaneStrides(p * nb * bs * W, bs * W, W, D, 1) for p in range(2))
        if lay == "vllm_flashinfer":
            return tuple(PlaneStrides(p * bs * W, 2 * bs * W, W, D, 1) for p in range(2))
        if lay == "vllm_mla":
            return (PlaneStrides(0, bs * W, W, D, 1),)
        if lay == "vllm_cpu":
            slab = bs * 2 * D  # one (block, head) slab: K^T [D, bs] then V [bs, D]
            return (PlaneStrides(0, H * slab, 1, slab, bs),
                    PlaneStrides(D * bs, H * slab, D, slab, 1))
        if lay == "sglang_mha":
            return tuple(PlaneStrides(0, W, 0, D, 1) for _ in range(2))
        return (PlaneStrides(0, W, 0, D, 1),)  # sglang_mla

    # ---------------------------------------------------------- engine tensors
    def layer_shape(self, num_blocks: int | None = None) -> tuple[int, ...]:
        """Expected shape of one layer tensor (of each of k/v for ``sglang_mha``)."""
        nb = self.num_blocks if num_blocks is None else num_blocks
        H, D, bs = self.num_kv_heads, self.head_size, self.block_size
        return {
            "vllm_flash": (2, nb, bs, H, D),
            "vllm_flashinfer": (nb, 2, bs, H, D),
            "vllm_mla": (nb, bs, D),
            "vllm_cpu": (nb, H, bs, 2 * D),
            "sglang_mha": (nb, H, D),
            "sglang_mla": (nb, 1, D),
        }[self.layout]

    def split_layers(self, kv_caches: KVCaches) -> list[tuple[str, tuple[torch.Tensor, ...]]]:
        return split_layers(self.layout, kv_caches)

    def validate(self, kv_caches: KVCaches) -> list[tuple[torch.Tensor, ...]]:
        """Check every layer tensor against this spec; return the per-layer plane tensors.

        The error names the offending layer, its shape/dtype/device and what was expected.
        """
        layers = self.split_layers(kv_caches)
        if len(layers) != self.num_layers:
            raise ValueError(f"kv_caches has {len(layers)} layers, spec expects {self.num_layers}")
        expected = self.layer_shape()
        out = []
        device = None
        for name, tensors in layers:
            for j, t in enumerate(tensors):
                label = name if len(tensors) == 1 else f"{name}.{'kv'[j]}_buffer"
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"kv cache {label} is {type(t).__name__}, not a torch.Tensor")
                shape = tuple(t.shape)
                ok = len(shape) == len(expected) and all(
                    e == 0 or s == e for s, e in zip(shape, expected))
                if not ok:
                    raise ValueError(f"kv cache {label} has shape {shape}, expected {expected} "
                                     f"for layout {self.layout} (0 = any number of blocks)")
                if self.num_blocks == 0 and out and shape != tuple(out[0][0].shape):
                    raise ValueError(f"kv cache {label} has shape {shape}, but layer 0 has "
                                     f"{tuple(out[0][0].shape)}")
                if t.dtype != self.dtype:
                    raise TypeError(f"kv cache {label} has dtype {t.dtype}, spec says {self.dtype}")
                device = t.device if device is None else device
                if t.device != device:
                    raise ValueError(f"kv cache {label} is on {t.device}, layer 0 is on {device}")
                if not t.is_contiguous():
                    raise ValueError(f"kv cache {label} must be contiguous (strides {t.stride()})")
            out.append(tensors)
        return out

    @classmethod
    def from_tensors(cls, kv_caches: KVCaches, layout: str, block_size: int | None = None,
                     num_kv_heads: int | None = None) -> KVSpec:
        """Infer the spec from the engine's tensors. ``block_size`` is checked when given.

        ``num_kv_heads`` is only needed where the shape cannot tell heads from dims
        (``vllm_cpu`` packs both; it is inferred there from dim 1).
        """
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}; known: {', '.join(LAYOUTS)}")
        layers = split_layers(layout, kv_caches)
        if not layers:
            raise ValueError("kv_caches is empty")
        t0 = layers[0][1][0]
        if not isinstance(t0, torch.Tensor):
            raise TypeError(f"kv cache {layers[0][0]} is {type(t0).__name__}, not a torch.Tensor")
        shape = tuple(t0.shape)
        ranks = {"vllm_flash": 5, "vllm_flashinfer": 5, "vllm_mla": 3, "vllm_cpu": 4,
                 "sglang_mha": 3, "sglang_mla": 3}
        if len(shape) != ranks[layout]:
            raise ValueError(f"kv cache {layers[0][0]} has shape {shape}: layout {layout} "
                             f"needs a {ranks[layout]}-d tensor")
        if layout == "vllm_flash":
            two, nb, bs, H, D = shape
            if two != 2:
                raise ValueError(f"kv cache {layers[0][0]} has shape {shape}: vllm_flash "
                                 "needs dim 0 == 2 (K, V)")
        elif layout == "vllm_flashinfer":
            nb, two, bs, H, D = shape
            if two != 2:
                raise ValueError(f"kv cache {layers[0][0]} has shape {shape}: vllm_flashinfer "
                                 "needs dim 1 == 2 (K, V)")
        elif layout == "vllm_mla":
            (nb, bs, D), H = shape, 1
        elif layout == "vllm_cpu":
            nb, H, bs, D2 = shape
            if D2 % 2:
                raise ValueError(f"kv cache {layers[0][0]} has shape {shape}: vllm_cpu needs an "
                                 "even last dim (2 * head_size)")
            D = D2 // 2
        elif layout == "sglang_mha":
            (nb, H, D), bs = shape, 1
        else:
            nb, one, D = shape
            H, bs = 1, 1
            if one != 1:
                raise ValueError(f"kv cache {layers[0][0]} has shape {shape}: sglang_mla needs "
                                 "dim 1 == 1")
        if num_kv_heads is not None and num_kv_heads != H:
            raise ValueError(f"num_kv_heads={num_kv_heads} but the tensors hold {H} heads")
        if block_size is not None and block_size != bs:
            raise ValueError(f"block_size={block_size} but kv cache {layers[0][0]} with shape "
                             f"{shape} has block size {bs} for layout {layout}")
        spec = cls(num_layers=len(layers), num_kv_heads=H, head_size=D, dtype=t0.dtype,
                   block_size=bs, layout=layout, num_blocks=nb)
        spec.validate(kv_caches)
        return spec


def split_layers(layout: str, kv_caches: KVCaches) -> list[tuple[str, tuple[torch.Tensor, ...]]]:
    """Normalise what the engine holds to ``[(name, plane_tensors)]`` per layer.

    ``plane_tensors`` is ``(layer_tensor,)`` for single-tensor layouts and ``(k, v)`` for
    ``sglang_mha``. Raises ``TypeError`` for a container of the wrong kind.
    """
    if layout == "sglang_mha":
        if not (isinstance(kv_caches, (tuple, list)) and len(kv_caches) == 2
                and all(isinstance(x, (list, tuple)) for x in kv_caches)):
            raise TypeError("sglang_mha kv_caches must be a pair (k_buffers, v_buffers) "
                            f"of per-layer tensor lists, got {type(kv_caches).__name__}")
        ks, vs = kv_caches
        if len(ks) != len(vs):
            raise ValueError(f"sglang_mha: {len(ks)} k_buffers but {len(vs)} v_buffers")
        return [(f"layer{i}", (k, v)) for i, (k, v) in enumerate(zip(ks, vs))]
    if isinstance(kv_caches, Mapping):
        items = list(kv_caches.items())
    elif isinstance(kv_caches, Sequence) and not isinstance(kv_caches, torch.Tensor):
        items = [(f"layer{i}", t) for i, t in enumerate(kv_caches)]
    else:
        raise TypeError("kv_caches must be a list of per-layer tensors or a name->tensor "
                        f"mapping, got {type(kv_caches).__name__}")
    return [(str(name), (t,)) for name, t in items]
