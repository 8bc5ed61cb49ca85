"""KV groups: which of an engine's layers hold what, for hybrid models.

A plain model's every layer holds K/V for every token: one group. A hybrid model mixes
kinds of layers, and each kind needs something else to continue a sequence at position N:

* ``full``    -- full attention: the K/V of all N positions;
* ``sliding`` -- sliding-window attention over ``window`` tokens (the query itself
  included, as vLLM and Hugging Face count it): only positions ``[N - window + 1, N)``;
* ``state``   -- linear-attention / state-space layers: the recurrent state after
  position N - 1, one row of ``state_width`` elements per layer (no tokens).

A :class:`KVGroup` names its kind and the engine layers (indices into the layers the engine
registers, in order) it covers; each group has its own block table in the engine (vLLM's
KV cache groups). ``KVSpec.groups`` holds them; a spec without groups (or with one full
group over every layer) is the plain case, whose stored chunks and key namespace are
unchanged. The group geometry is part of the key namespace (``KVSpec.namespace_fields``),
so a hybrid model's chunks never load into a plain layout, nor the reverse.

What is stored per group and when a hit can be served is :mod:`lmc.hybrid.rules`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

FULL = "full"
SLIDING = "sliding"
STATE = "state"
KINDS = (FULL, SLIDING, STATE)

__all__ = ["FULL", "KINDS", "SLIDING", "STATE", "KVGroup", "check_groups", "is_plain"]


@dataclasses.dataclass(frozen=True)
class KVGroup:
    """One group of layers of one kind (see the module doc).

    ``layers``: engine layer indices, ascending. ``window``: a sliding group's window in
    tokens. ``state_width`` / ``state_dtype``: a state group's elements per layer and their
    dtype (``None``: the spec's dtype)."""

    kind: str
    layers: tuple[int, ...]
    window: int = 0
    state_width: int = 0
    state_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if self.kind not in KINDS:
            raise ValueError(f"KV group kind {self.kind!r} is not one lmc knows "
                             f"({', '.join(KINDS)})")
        if not self.layers:
            raise ValueError(f"a {self.kind} KV group with no layers")
        if list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise ValueError(f"{self.kind} KV group layers {list(self.layers)} must be distinct "
                             "engine layer indices, ascending")
        if (self.kind == SLIDING) != (self.window > 0):
            raise ValueError(f"a {self.kind} KV group with window {self.window} (a window > 0 "
                             "is what makes a group sliding)")
        if (self.kind == STATE) != (self.state_width > 0):
            raise ValueError(f"a {self.kind} KV group with state_width {self.state_width} "
                             "(state groups, and only they, hold a state row per layer)")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def describe(self) -> str:
        """One phrase for logs: ``sliding(512) x 12``."""
        what = {SLIDING: f"sliding({self.window})", STATE: f"state({self.state_width})"}
        return f"{what.get(self.kind, self.kind)} x {self.num_layers}"

    def namespace(self) -> dict[str, Any]:
        """What the key namespace records of this group: every field that changes what a
        stored part holds or which positions it needs."""
        out: dict[str, Any] = {"kind": self.kind, "layers": list(self.layers)}
        if self.kind == SLIDING:
            out["window"] = self.window
        if self.kind == STATE:
            out["width"] = self.state_width
            out["dtype"] = None if self.state_dtype is None else \
                str(self.state_dtype).removeprefix("torch.")
        return out


def is_plain(groups: Sequence[KVGroup], num_layers: int) -> bool:
    """No groups, or one full group over every layer in order: the plain case."""
    return not groups or (len(groups) == 1 and groups[0].kind == FULL
                          and groups[0].layers == tuple(range(num_layers)))


def check_groups(groups: Sequence[KVGroup], num_layers: int) -> None:
    """Every engine layer in exactly one group, and at least one attention group (the
    engine's cache layout addresses chunks through it)."""
    seen: dict[int, int] = {}
    for gi, g in enumerate(groups):
        if not isinstance(g, KVGroup):
            raise TypeError(f"KV group {gi} is {type(g).__name__}, not a KVGroup")
        for i in g.layers:
            if i >= num_layers:
                raise ValueError(f"KV group {gi} ({g.describe()}) names layer {i}, the engine "
                                 f"has {num_layers}")
            if i in seen:
                raise ValueError(f"layer {i} is in KV groups {seen[i]} and {gi}")
            seen[i] = gi
    if groups and len(seen) != num_layers:
        missing = sorted(set(range(num_layers)) - set(seen))
        raise ValueError(f"layers {missing[:8]} are in no KV group: every layer needs one")
    if groups and all(g.kind == STATE for g in groups):
        raise ValueError("KV groups of state layers only: lmc needs at least one attention "
                         "group to key and address chunks by")
