"""vLLM's KV cache groups as lmc's (:mod:`lmc.transfer.kv_groups`).

With its hybrid memory allocator on, vLLM 0.32 keeps one KV cache group per kind of layer
(``KVCacheConfig.kv_cache_groups``: the layers' names and one ``KVCacheSpec``), each with
its own block table; a connector declaring ``SupportsHMA`` is handed every group's block
ids. A sliding-window group (``SlidingWindowSpec``) holds only the blocks of its window:
the blocks before it are vLLM's null block (id 0), which lmc reads as "not held". A group
of another kind lmc cannot serve is refused at start-up by name: state-space / linear
attention layers (``MambaSpec``: vLLM's default mamba cache mode keeps their state in one
block per request, updated in place, so no state at a chunk's end outlives its step; lmc's
state groups need one), chunked local attention, and groups that take no part in KV
transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmc.connectors.vllm.layout import UnsupportedLayout
from lmc.transfer.kv_groups import FULL, SLIDING, KVGroup

NULL_BLOCK = 0  # vLLM's block pool hands out block 0 as its null block, never as a real one


def group_kinds(kv_cache_config: Any) -> list[tuple[str, int, int]]:
    """Per vLLM KV cache group, in its order: (lmc kind, window, block size). Raises
    :class:`UnsupportedLayout` naming a kind lmc cannot serve."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        iter_layer_specs,
    )

    out = []
    for i, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        specs = list(iter_layer_specs(g.kv_cache_spec))
        kind = type(g.kv_cache_spec).__name__
        if not getattr(g, "enable_kv_transfer", True):
            raise UnsupportedLayout(f"KV cache group {i} ({kind}) takes no part in KV "
                                    "transfer; lmc stores every group or none")
        if specs and all(isinstance(s, MambaSpec) for s in specs):
            raise UnsupportedLayout(
                f"KV cache group {i} holds state-space/linear-attention layers ({kind}: "
                f"{', '.join(g.layer_names[:3])}...): a hybrid SSM model; lmc stores "
                "attention KV of vLLM models only (vLLM's default mamba cache mode keeps a "
                "layer's state in one block per request, updated in place: no state at a "
                "chunk's end outlives its step)")
        if specs and all(isinstance(s, SlidingWindowSpec) for s in specs):
            windows = {s.sliding_window for s in specs}
            if len(windows) != 1:
                raise UnsupportedLayout(f"KV cache group {i} mixes sliding windows "
                                        f"{sorted(windows)}")
            out.append((SLIDING, windows.pop(), g.kv_cache_spec.block_size))
        elif specs and all(isinstance(s, FullAttentionSpec) for s in specs):
            out.append((FULL, 0, g.kv_cache_spec.block_size))
        else:
            raise UnsupportedLayout(f"KV cache group {i} is {kind} (layers "
                                    f"{', '.join(g.layer_names[:3])}...): a kind of attention "
                                    "lmc cannot serve (full attention and sliding windows)")
    if len({bs for _, _, bs in out}) > 1:
        raise UnsupportedLayout(f"KV cache groups of block sizes {sorted({b for *_, b in out})}"
                                ": lmc needs one")
    return out


def lmc_groups(kv_cache_config: Any, layer_names: Sequence[str]) -> tuple[KVGroup, ...]:
    """lmc's groups over the worker's layers (``layer_names``, in the order lmc indexes
    them), one per vLLM group and in vLLM's order (so group ``i``'s block ids are vLLM's
    ``i``-th list). Empty for one group (the plain case)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) <= 1:
        return ()
    index = {name: i for i, name in enumerate(layer_names)}
    out = []
    for (kind, window, _), g in zip(group_kinds(kv_cache_config), groups):
        missing = [n for n in g.layer_names if n not in index]
        if missing:
            raise UnsupportedLayout(f"KV cache group layers {missing[:3]} registered no KV "
                                    "cache tensor")
        out.append(KVGroup(kind, tuple(sorted(index[n] for n in g.layer_names)),
                           window=window))
    return tuple(out)


def group_tables(block_ids: Sequence[Sequence[int]] | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's block ids per group as lmc reads them: the null block is -1 (not held)."""
    return tuple(tuple(-1 if b == NULL_BLOCK else int(b) for b in g) for g in block_ids or ())
