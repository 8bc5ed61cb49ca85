"""``KVSpec``: one description of every engine KV layout, so one gather/scatter serves them all.

A layer's cache holds, for each *plane* (K and V, or the single MLA latent plane), one vector of
``num_kv_heads * head_size`` elements per token slot. Where that element lives is an affine
function of the slot's block, its offset in the block, the head and the dim
(:class:`lmc.transfer.kv_layouts.PlaneStrides`)::

    elem(plane p, slot s, head h, dim d) = base[p] + (s // block_size) * block[p]
                                          + (s % block_size) * token[p] + h * head[p] + d * dim[p]

Each layout is one :class:`lmc.transfer.kv_layouts.Layout` descriptor (its logical axes); the strides
come from the engine tensors' real ``stride()`` (:meth:`KVSpec.plane_strides`), so physical
orders and cross-layer allocations need no code of their own. The torch path and the CUDA
kernels both work from those numbers. The stored chunk format never depends on the layout (see
``chunk_shape``), so KV saved from one layout loads into any other for the same model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lmc.transfer.kv_groups import STATE, KVGroup, check_groups, is_plain
from lmc.transfer.kv_layouts import DESCRIPTORS, Geometry, Layout, PlaneStrides

__all__ = ["KVSpec", "PlaneStrides", "LAYOUTS", "SUPPORTED_DTYPES", "split_layers"]

LAYOUTS: tuple[str, ...] = tuple(DESCRIPTORS)
MLA_LAYOUTS = frozenset(n for n, d in DESCRIPTORS.items() if d.use_mla)
SLOT_LAYOUTS = frozenset(n for n, d in DESCRIPTORS.items() if d.slot_addressed)  # block_size 1

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(
    d for d in (torch.float32, torch.float16, torch.bfloat16,
                getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if d is not None
)

KVCaches = Any  # list/tuple of tensors, name->tensor mapping, or (k_buffers, v_buffers)
LayerTensors = tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """Shape of an engine's KV cache. MLA layouts have one plane, ``num_kv_heads == 1`` and
    ``head_size`` equal to the latent dimension. ``groups``: a hybrid model's KV groups
    (:mod:`lmc.transfer.kv_groups`); empty for the plain case, which one full group over
    every layer is normalised to."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    layout: str
    num_blocks: int = 0  # capacity of the engine cache (slots for sglang); 0 = not checked
    groups: tuple[KVGroup, ...] = ()

    def __post_init__(self) -> None:
        if self.layout not in DESCRIPTORS:
            raise ValueError(f"unknown KV layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"KV dtype {self.dtype} is not supported; use one of "
                            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"KVSpec.{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 0:
            raise ValueError(f"KVSpec.num_blocks must be an int >= 0, got {self.num_blocks!r}")
        if self.use_mla and self.num_kv_heads != 1:
            raise ValueError(f"MLA layout {self.layout} has one latent 'head', got "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.desc.slot_addressed and self.block_size != 1:
            raise ValueError(f"{self.layout} addresses slots directly: block_size must be 1, "
                             f"got {self.block_size}")
        groups = tuple(self.groups)
        check_groups(groups, self.num_layers)
        object.__setattr__(self, "groups", () if is_plain(groups, self.num_layers) else groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether the layers form more than one KV group (see :mod:`lmc.transfer.kv_groups`)."""
        return bool(self.groups)

    def group_spec(self, index: int) -> KVSpec:
        """The plain spec of group ``index``'s attention layers (its own transfer and chunk
        shape); a state group's has one layer per state layer, unused by transfers."""
        g = self.groups[index]
        return dataclasses.replace(self, num_layers=g.num_layers, groups=())

    def group_chunk_shape(self, index: int, num_tokens: int) -> tuple[int, int, int, int]:
        """What group ``index`` stores for a chunk of ``num_tokens``: the attention format
        over its layers, or ``[layers, 1, 1, state_width]`` for a state group."""
        g = self.groups[index]
        if g.kind == STATE:
            return (g.num_layers, 1, 1, g.state_width)
        return (g.num_layers, self.num_planes, num_tokens, self.row_width)

    def group_dtype(self, index: int) -> torch.dtype:
        g = self.groups[index]
        return g.state_dtype if g.kind == STATE and g.state_dtype is not None else self.dtype

    # ------------------------------------------------------------------ derived
    @property
    def desc(self) -> Layout:
        """The layout's descriptor (axes, geometry parsing, strides)."""
        return DESCRIPTORS[self.layout]

    @property
    def use_mla(self) -> bool:
        return self.desc.use_mla

    @property
    def num_planes(self) -> int:
        return self.desc.planes

    @property
    def row_width(self) -> int:
        """Elements of one token in one plane of one layer."""
        return self.num_kv_heads * self.head_size

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    def geometry_only(self) -> KVSpec:
        """This spec without its capacity (``num_blocks=0``): what an engine binds to. vLLM
        allocates its cache after profiling and re-creates it on sleep/wake with another number
        of blocks; a cache of the same layout, layers, heads, head size, block size and dtype
        is the same model's and is accepted whatever its block count (bounds are then read off
        each cache's own tensors)."""
        return self if self.num_blocks == 0 else dataclasses.replace(self, num_blocks=0)

    def geometry(self, num_blocks: int | None = None) -> Geometry:
        nb = self.num_blocks if num_blocks is None else num_blocks
        return Geometry(nb, self.block_size, self.num_kv_heads, self.head_size)

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """The stored, layout-independent format: ``[layers, planes, tokens, heads*dim]``."""
        return (self.num_layers, self.num_planes, num_tokens, self.row_width)

    def chunk_nbytes(self, num_tokens: int) -> int:
        return self.num_layers * self.num_planes * num_tokens * self.row_width * self.element_size

    def namespace_fields(self) -> dict[str, Any]:
        """What identifies stored KV: the layout and cache capacity are deliberately absent;
        a hybrid model's group geometry is present (a plain spec's fields are unchanged)."""
        out: dict[str, Any] = {
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "mla": self.use_mla,
        }
        if self.groups:
            out["groups"] = [g.namespace() for g in self.groups]
        return out

    def plane_strides(self, layer: torch.Tensor | Sequence[torch.Tensor] | None = None
                      ) -> tuple[PlaneStrides, ...]:
        """Per plane, where a (slot, head, dim) element lives inside its layer tensor.

        With ``layer`` (one layer's tensor, or its ``(k, v)`` pair for ``sglang_mha``) the
        strides are that tensor's real ones: what every transfer uses. Without it, those of a
        contiguous tensor of this spec, which for ``vllm_flash`` needs ``num_blocks`` (the V
        plane starts after every K block): refused when it is 0 rather than guessed.
        For ``sglang_mha`` each plane is its own tensor, so both have ``base == 0``.
        """
        d = self.desc
        if layer is None:
            if self.num_blocks == 0 and d.strides_need_num_blocks:
                raise ValueError(f"KVSpec(layout={self.layout!r}, num_blocks=0): the V plane's "
                                 "offset depends on the number of blocks; give num_blocks or "
                                 "read the strides from the tensors (plane_strides(layer), "
                                 "KVSpec.from_tensors)")
            return d.canonical_strides(self.geometry())
        tensors = (layer,) if isinstance(layer, torch.Tensor) else tuple(layer)
        return d.plane_strides([t.shape for t in tensors], [t.stride() for t in tensors],
                               self.geometry(d.parse(tensors[0].shape).num_blocks))

    def num_slots(self, layer0: torch.Tensor) -> int:
        """Token slots an engine cache holds, read off its first layer tensor."""
        return self.desc.parse(layer0.shape).num_blocks * self.block_size

    # ---------------------------------------------------------- engine tensors
    def layer_shape(self, num_blocks: int | None = None) -> tuple[int, ...]:
        """Expected (logical) shape of one layer tensor (of each of k/v for ``sglang_mha``)."""
        return self.desc.shape(self.geometry(num_blocks))

    def split_layers(self, kv_caches: KVCaches) -> list[tuple[str, LayerTensors]]:
        return split_layers(self.layout, kv_caches)

    def validate(self, kv_caches: KVCaches) -> list[LayerTensors]:
        """Check every layer tensor against this spec; return the per-layer plane tensors.

        Layers may be any strided views (vLLM's HND order, cross-layer allocations) as long as
        no two elements share memory and every layer has the same strides. The error names
        the offending layer, its shape/strides/dtype/device and what was expected.
        """
        layers = self.split_layers(kv_caches)
        if len(layers) != self.num_layers:
            raise ValueError(f"kv_caches has {len(layers)} layers, spec expects {self.num_layers}")
        expected = self.layer_shape()
        out: list[LayerTensors] = []
        device = None
        strides0: tuple[PlaneStrides, ...] | None = None
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
                                     f"{self.desc.pretty_axes()} for layout {self.layout} "
                                     "(0 = any number of blocks)")
                if self.num_blocks == 0 and out and shape != tuple(out[0][0].shape):
                    raise ValueError(f"kv cache {label} has shape {shape}, but layer 0 has "
                                     f"{tuple(out[0][0].shape)}")
                if t.dtype != self.dtype:
                    raise TypeError(f"kv cache {label} has dtype {t.dtype}, spec says {self.dtype}")
                device = t.device if device is None else device
                if t.device != device:
                    raise ValueError(f"kv cache {label} is on {t.device}, layer 0 is on {device}")
            try:
                strides = self.plane_strides(tensors)
            except ValueError as e:
                raise ValueError(f"kv cache {name}: {e}") from None
            if strides0 is None:
                strides0 = strides
            elif strides != strides0:
                raise ValueError(f"kv cache {name} has strides "
                                 f"{[tuple(t.stride()) for t in tensors]}, layer 0 has "
                                 f"{[tuple(t.stride()) for t in out[0]]}: every layer must be "
                                 "laid out alike")
            out.append(tensors)
        return out

    @classmethod
    def from_tensors(cls, kv_caches: KVCaches, layout: str, block_size: int | None = None,
                     num_kv_heads: int | None = None) -> KVSpec:
        """Infer the spec from the engine's tensors. ``block_size`` and ``num_kv_heads`` are
        checked when given (every layout's logical shape names both)."""
        if layout not in DESCRIPTORS:
            raise ValueError(f"unknown KV layout {layout!r}; known: {', '.join(LAYOUTS)}")
        layers = split_layers(layout, kv_caches)
        if not layers:
            raise ValueError("kv_caches is empty")
        name0, tensors0 = layers[0]
        t0 = tensors0[0]
        if not isinstance(t0, torch.Tensor):
            raise TypeError(f"kv cache {name0} is {type(t0).__name__}, not a torch.Tensor")
        shape = tuple(t0.shape)
        g = DESCRIPTORS[layout].parse(shape, f"kv cache {name0}")
        if num_kv_heads is not None and num_kv_heads != g.num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} but the tensors hold "
                             f"{g.num_kv_heads} heads")
        if block_size is not None and block_size != g.block_size:
            raise ValueError(f"block_size={block_size} but kv cache {name0} with shape "
                             f"{shape} has block size {g.block_size} for layout {layout}")
        spec = cls(num_layers=len(layers), num_kv_heads=g.num_kv_heads, head_size=g.head_size,
                   dtype=t0.dtype, block_size=g.block_size, layout=layout,
                   num_blocks=g.num_blocks)
        spec.validate(kv_caches)
        return spec


def split_layers(layout: str, kv_caches: KVCaches) -> list[tuple[str, LayerTensors]]:
    """Normalise what the engine holds to ``[(name, plane_tensors)]`` per layer.

    ``plane_tensors`` is ``(layer_tensor,)`` for single-tensor layouts and ``(k, v)`` for
    split-plane layouts (``sglang_mha``). Raises ``TypeError`` for a container of the wrong
    kind.
    """
    if DESCRIPTORS[layout].split_planes:
        if not (isinstance(kv_caches, (tuple, list)) and len(kv_caches) == 2
                and all(isinstance(x, (list, tuple)) for x in kv_caches)):
            raise TypeError(f"{layout} kv_caches must be a pair (k_buffers, v_buffers) "
                            f"of per-layer tensor lists, got {type(kv_caches).__name__}")
        ks, vs = kv_caches
        if len(ks) != len(vs):
            raise ValueError(f"{layout}: {len(ks)} k_buffers but {len(vs)} v_buffers")
        return [(f"layer{i}", (k, v)) for i, (k, v) in enumerate(zip(ks, vs))]
    if isinstance(kv_caches, Mapping):
        items = list(kv_caches.items())
    elif isinstance(kv_caches, Sequence) and not isinstance(kv_caches, torch.Tensor):
        items = [(f"layer{i}", t) for i, t in enumerate(kv_caches)]
    else:
        raise TypeError("kv_caches must be a list of per-layer tensors or a name->tensor "
                        f"mapping, got {type(kv_caches).__name__}")
    return [(str(name), (t,)) for name, t in items]

