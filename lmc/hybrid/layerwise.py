"""Layer-wise copies of a hybrid model: one :class:`~lmc.layerwise.LayerwiseStore` or
:class:`~lmc.layerwise.LayerwiseRetrieve` per KV group, driven by engine layer index.

The engine calls ``save(i)`` / ``wait(i)`` with its own layer index; each maps to the group
holding layer ``i`` and that group's own index of it. A group with nothing to copy in a
call (a sliding group whose window the engine already has, say) answers at once. Every
group's copy obeys the ownership rules of :mod:`lmc.layerwise` on its own objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from lmc.layerwise import LayerwiseHost, LayerwiseRetrieve, LayerwiseStore
from lmc.token_database import ChunkKey
from lmc.transfer.completion import Completion
from lmc.transfer.kv_groups import FULL, KVGroup


class GroupHost:
    """The engine's :class:`~lmc.layerwise.LayerwiseHost`, seen by one group: its layers."""

    def __init__(self, host: LayerwiseHost, num_layers: int) -> None:
        self.host = host
        self._layers = num_layers

    @property
    def num_layers(self) -> int:
        return self._layers

    def executor(self) -> Executor:
        return self.host.executor()

    def commit_chunks(self, keys: Sequence[ChunkKey], objs: Sequence[Any]) -> None:
        self.host.commit_chunks(keys, objs)

    def record_transfer(self, kind: str, tokens: int, nbytes: int, seconds: float) -> None:
        self.host.record_transfer(kind, tokens, nbytes, seconds)


def layer_map(groups: Sequence[KVGroup]) -> dict[int, tuple[int, int]]:
    """Engine layer -> (group index, the group's own index of it)."""
    return {layer: (gi, j) for gi, g in enumerate(groups) for j, layer in enumerate(g.layers)}


def _lead(groups: Sequence[KVGroup]) -> int:
    """The group whose chunks say how many positions a copy covers: the first full one."""
    return next((i for i, g in enumerate(groups) if g.kind == FULL), 0)


class GroupedStore:
    """``save(layer)`` for every engine layer, then ``commit()`` (see ``LayerwiseStore``)."""

    def __init__(self, tr: Any, groups: Sequence[KVGroup],
                 stores: Sequence[LayerwiseStore]) -> None:
        self.tr = tr  # the GroupedTransfer: record_event() for the engine's point
        self.stores = list(stores)
        self._map = layer_map(groups)
        lead = self.stores[_lead(groups)]
        self.num_tokens = lead.num_tokens
        self.nbytes = sum(s.nbytes for s in self.stores)
        self.chunks = lead.chunks

    def save(self, layer: int, sync: bool = False, after: Completion | None = None) -> None:
        if layer not in self._map:
            raise ValueError(f"layer {layer} is in no KV group")
        gi, j = self._map[layer]
        self.stores[gi].save(j, sync=sync, after=after)

    def commit(self) -> int:
        """Commit every group's parts (each visible once all its layers landed); returns
        the positions stored by the lead group. A group that fails aborts the rest."""
        err: BaseException | None = None
        for st in self.stores:
            if err is not None:
                st.abort()
                continue
            try:
                st.commit()
            except BaseException as e:  # noqa: BLE001 - re-raised after the others abort
                err = e
        if err is not None:
            raise err
        return self.num_tokens

    def abort(self) -> None:
        for st in self.stores:
            st.abort()

    def __enter__(self) -> GroupedStore:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.commit()


class GroupedRetrieve:
    """``start()`` or ``issue(i)``/``wait(i)`` per engine layer, then ``close()`` (see
    ``LayerwiseRetrieve``). ``num_tokens``: the positions served (from the load's first
    unmasked chunk to its end), all groups or none."""

    def __init__(self, groups: Sequence[KVGroup], retrieves: Sequence[LayerwiseRetrieve],
                 num_tokens: int) -> None:
        self.retrieves = list(retrieves)
        self._map = layer_map(groups)
        lead = self.retrieves[_lead(groups)]
        self.tiers = lead.tiers
        self.chunks = lead.chunks
        self.num_tokens = num_tokens
        self.nbytes = sum(r.nbytes for r in self.retrieves)
        self.num_layers = len(self._map)
        self._lead = lead

    def tokens_by_tier(self, start: int = 0, end: int | None = None) -> dict[str, int]:
        return self._lead.tokens_by_tier(start, end)

    def _part(self, layer: int) -> tuple[LayerwiseRetrieve, int]:
        if layer not in self._map:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        gi, j = self._map[layer]
        return self.retrieves[gi], j

    def start(self) -> GroupedRetrieve:
        for r in self.retrieves:
            r.start()
        return self

    def issue(self, layer: int) -> Completion:
        r, j = self._part(layer)
        return r.issue(j)

    def load(self, layer: int) -> None:
        r, j = self._part(layer)
        r.load(j)

    def wait(self, layer: int, stream: Any = None) -> None:
        r, j = self._part(layer)
        r.wait(j, stream)

    def close(self) -> int:
        """Release every group's chunks once their loads completed; the positions served,
        or 0 unless every group loaded every layer."""
        got = [r.close() for r in self.retrieves]
        complete = all(n == r.num_tokens for n, r in zip(got, self.retrieves))
        return self.num_tokens if complete else 0

    def __enter__(self) -> GroupedRetrieve:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
