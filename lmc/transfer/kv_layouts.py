"""Engine KV layouts as data: one :class:`Layout` descriptor per layout.

A descriptor lists the *logical* axes of one layer tensor, outermost first. Everything else
(reading the model's geometry off a shape, the expected shape of a layer, where each plane's
elements live given the tensor's real ``stride()``) is derived from that list by the code
here, so a new layout is one more entry in :data:`DESCRIPTORS` and the transfer paths never
switch on layout names.

Axis names:

``kv``      the plane: K = 0, V = 1 (size = number of planes)
``block``   paged block id                ``token``  token within its block
``slot``    token slot of a slot-addressed pool (block size 1)
``head``    KV head                       ``dim``    element of one head
``kv_dim``  ``2 * head_size``: K's elements then V's, per (token, head)
``one``     an axis of size 1 (the single latent "head" of an MLA pool)

Physical order is *not* part of a layout: the strides are read from the tensor, so the same
``vllm_gpu`` descriptor serves vLLM's NHD and HND orders and its cross-layer allocations
(where a layer is a view whose block stride spans every layer).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

Shape = Sequence[int]


@dataclasses.dataclass(frozen=True)
class PlaneStrides:
    """Where element (slot s, head h, dim d) of one plane lives, in elements from the start
    of the layer tensor that holds the plane: ``base + (s // block_size) * block +
    (s % block_size) * token + h * head + d * dim``."""

    base: int   # offset of element 0 of the plane
    block: int  # between consecutive blocks (between slots for slot-addressed layouts)
    token: int  # between consecutive tokens of a block (0 when block_size is 1)
    head: int   # between consecutive KV heads
    dim: int    # between consecutive elements of a head

    def offset(self, slot: int, head: int, dim: int, block_size: int) -> int:
        b, o = divmod(slot, block_size)
        return self.base + b * self.block + o * self.token + head * self.head + dim * self.dim


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What a layer tensor's shape says about the model and the cache."""

    num_blocks: int  # slots, for slot-addressed layouts
    block_size: int
    num_kv_heads: int
    head_size: int


def contiguous_strides(shape: Shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def _dense_cpu_slab(layout: Layout, shape: Shape, stride: Shape,
                    g: Geometry) -> tuple[PlaneStrides, ...]:
    """vLLM CPU_ATTN: each (block, head) slab of ``block_size * 2 * head_size`` elements holds
    K transposed ``[head_size, block_size]`` then V ``[block_size, head_size]``. The slab must
    be dense for that reinterpretation to mean anything."""
    bs, D = g.block_size, g.head_size
    s_blk, s_h, s_tok, s_c = (int(x) for x in stride)
    if (bs > 1 and s_tok != 2 * D) or s_c != 1:
        raise ValueError(f"layout {layout.name}: each (block, head) slab must be dense "
                         f"(strides {tuple(stride)} for shape {tuple(shape)})")
    return (PlaneStrides(0, s_blk, 1, s_h, bs), PlaneStrides(D * bs, s_blk, D, s_h, 1))


@dataclasses.dataclass(frozen=True)
class Layout:
    """One engine KV layout; see the module docstring for the axis names."""

    name: str
    axes: tuple[str, ...]
    planes: int                  # 2 (K, V) or 1 (MLA latent)
    split_planes: bool = False   # each plane is its own tensor (SGLang k_buffer / v_buffer)
    # Layouts whose bytes are not a strided view of (slot, head, dim) map the strides here.
    packing: Callable[[Layout, Shape, Shape, Geometry], tuple[PlaneStrides, ...]] | None = None
    description: str = ""

    @property
    def rank(self) -> int:
        return len(self.axes)

    @property
    def slot_addressed(self) -> bool:
        return "slot" in self.axes

    @property
    def use_mla(self) -> bool:
        return self.planes == 1

    @property
    def block_axis(self) -> int:
        return self.axes.index("slot" if self.slot_addressed else "block")

    @property
    def strides_need_num_blocks(self) -> bool:
        """Whether an axis outside the block axis (vLLM flash's K/V plane) has a stride that
        depends on the number of blocks: a spec without ``num_blocks`` cannot place it."""
        return any(a not in ("one",) for a in self.axes[: self.block_axis])

    # ------------------------------------------------------------------ geometry
    def parse(self, shape: Shape, what: str = "kv cache") -> Geometry:
        """Read the geometry off one layer tensor's shape; errors say what did not fit."""
        shape = tuple(int(x) for x in shape)
        if len(shape) != self.rank:
            raise ValueError(f"{what} has shape {shape}: layout {self.name} needs a "
                             f"{self.rank}-d tensor {self.pretty_axes()}")
        size = dict(zip(self.axes, shape))
        if "kv" in size and size["kv"] != self.planes:
            raise ValueError(f"{what} has shape {shape}: {self.name} needs dim "
                             f"{self.axes.index('kv')} == {self.planes} (K, V)")
        if size.get("one", 1) != 1:
            raise ValueError(f"{what} has shape {shape}: {self.name} needs dim "
                             f"{self.axes.index('one')} == 1")
        if "kv_dim" in size:
            if size["kv_dim"] % 2:
                raise ValueError(f"{what} has shape {shape}: {self.name} needs an even last "
                                 "dim (2 * head_size)")
            head_size = size["kv_dim"] // 2
        else:
            head_size = size["dim"]
        return Geometry(num_blocks=size["slot" if self.slot_addressed else "block"],
                        block_size=size.get("token", 1),
                        num_kv_heads=size.get("head", 1),
                        head_size=head_size)

    def shape(self, g: Geometry) -> tuple[int, ...]:
        """The logical shape of one layer tensor (of each plane tensor if ``split_planes``)."""
        size = {"kv": self.planes, "block": g.num_blocks, "slot": g.num_blocks,
                "token": g.block_size, "head": g.num_kv_heads, "dim": g.head_size,
                "kv_dim": 2 * g.head_size, "one": 1}
        return tuple(size[a] for a in self.axes)

    def pretty_axes(self) -> str:
        return "[" + ", ".join(self.axes) + "]"

    # ------------------------------------------------------------------- strides
    def plane_strides(self, shapes: Sequence[Shape], strides: Sequence[Shape],
                      g: Geometry) -> tuple[PlaneStrides, ...]:
        """Per plane, element strides from the real tensor strides (one shape/stride per
        tensor of the layer: two for ``split_planes``, else one)."""
        if len(strides) != (self.planes if self.split_planes else 1):
            raise ValueError(f"layout {self.name}: {len(strides)} tensors per layer, expected "
                             f"{self.planes if self.split_planes else 1}")
        for shape, stride in zip(shapes, strides):
            check_no_overlap(self, shape, stride)
        if self.packing is not None:
            return self.packing(self, shapes[0], strides[0], g)
        out = []
        for p in range(self.planes):
            st = dict(zip(self.axes, (int(x) for x in strides[p if self.split_planes else 0])))
            if "kv_dim" in st:
                dim, base = st["kv_dim"], p * g.head_size * st["kv_dim"]
            else:
                dim, base = st["dim"], 0
            if "kv" in st:
                base = p * st["kv"]
            head = st.get("head", st.get("one", g.head_size * dim))
            out.append(PlaneStrides(base=base, block=st["slot" if self.slot_addressed
                                                        else "block"],
                                    token=st.get("token", 0), head=head, dim=dim))
        return tuple(out)

    def canonical_strides(self, g: Geometry) -> tuple[PlaneStrides, ...]:
        """Plane strides of a contiguous tensor of this layout."""
        shape = self.shape(g)
        n = self.planes if self.split_planes else 1
        return self.plane_strides([shape] * n, [contiguous_strides(shape)] * n, g)


def check_no_overlap(layout: Layout, shape: Shape, stride: Shape) -> None:
    """Refuse strides under which two logical elements share memory (a broadcast or an
    overlapping view): a scatter would then overwrite KV it has just written. Sufficient test:
    ordered by stride, each axis steps over everything the inner axes span."""
    dims = sorted((int(st), int(n)) for n, st in zip(shape, stride) if int(n) > 1)
    span = 1
    for st, n in dims:
        if st < span:
            raise ValueError(f"layout {layout.name}: strides {tuple(stride)} for shape "
                             f"{tuple(shape)} make distinct elements share memory")
        span = st * (n - 1) + span
    if any(int(st) < 0 for st in stride):
        raise ValueError(f"layout {layout.name}: negative strides {tuple(stride)}")


def span_elements(shape: Shape, stride: Shape) -> int:
    """Elements from a tensor's first element to one past its last (for flat views)."""
    if any(int(n) == 0 for n in shape):
        return 0
    return 1 + sum((int(n) - 1) * int(st) for n, st in zip(shape, stride))


DESCRIPTORS: dict[str, Layout] = {lay.name: lay for lay in (
    Layout("vllm_flash", ("kv", "block", "token", "head", "dim"), 2,
           description="vLLM < 0.32 FlashAttention: [2, blocks, block_size, heads, head_size]"),
    Layout("vllm_flashinfer", ("block", "kv", "token", "head", "dim"), 2,
           description="vLLM < 0.32 FlashInfer: [blocks, 2, block_size, heads, head_size]"),
    Layout("vllm_mla", ("block", "token", "dim"), 1,
           description="vLLM MLA: [blocks, block_size, latent] (0.32's [blocks, 1, "
                       "block_size, latent] with dim 1 dropped)"),
    Layout("vllm_cpu", ("block", "head", "token", "kv_dim"), 2, packing=_dense_cpu_slab,
           description="vLLM 0.32 CPU_ATTN: [blocks, heads, block_size, 2*head_size], each "
                       "(block, head) slab K^T [head_size, block_size] then V"),
    Layout("vllm_gpu", ("block", "head", "token", "kv_dim"), 2,
           description="vLLM 0.32 GPU attention (FLASH_ATTN, TRITON_ATTN, FLASHINFER): logical "
                       "[blocks, heads, block_size, 2*head_size], K and V interleaved per "
                       "(token, head); any physical order (NHD, HND, cross-layer)"),
    Layout("sglang_mha", ("slot", "head", "dim"), 2, split_planes=True,
           description="SGLang MHA pool: k_buffer / v_buffer [slots, heads, head_size]"),
    Layout("sglang_mla", ("slot", "one", "dim"), 1,
           description="SGLang MLA pool: [slots, 1, latent]"),
)}


def descriptor(name: str) -> Layout:
    try:
        return DESCRIPTORS[name]
    except KeyError:
        raise ValueError(f"unknown KV layout {name!r}; known: {', '.join(DESCRIPTORS)}") from None


def num_elements(shape: Shape) -> int:
    return math.prod(int(x) for x in shape)
