"""What the daemon shows of its objects: byte views of pool objects (socket I/O) and each
tier's declaration (STATS).

Byte views. One implementation: :meth:`lmc.memory.pool.MemoryObj.byte_view` (a slice of one
cached memoryview of the pool's buffer, checked against a freed object). Why not
``serde.tensor_bytes``: it builds a typed tensor view, a byte view, a reshape and a numpy
array per object, about 20 us; at a few GiB/s of 1 MiB values that is several percent of a
core. That path remains only for an object whose pool is not a CPU :class:`MemoryPool`.

Tier media. STATS says, per tier, what the tier declares (:mod:`lmc.storage.tier`): its
medium and its capabilities, so ``lmc stats`` shows where each tier's hits come from
without guessing from its name.

Nothing here imports torch at load time: ``lmc stats`` reads this module's answers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmc.memory.pool import MemoryObj


@functools.cache
def _cpu_pool_class() -> type:
    from lmc.memory.pool import MemoryPool

    return MemoryPool


def byte_view(obj: MemoryObj) -> memoryview:
    """A writable, zero-copy byte view of ``obj``'s memory."""
    pool = obj.pool
    if isinstance(pool, _cpu_pool_class()) and pool.buffer.device.type == "cpu":
        return obj.byte_view()
    from lmc.storage.serde import tensor_bytes

    return tensor_bytes(obj.tensor)


def tier_media(tiers: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per tier (by name, in chain order): ``{"medium": "local_storage", "layered_reads":
    True, ...}`` -- the medium's value and every capability flag the tier declares."""
    out: dict[str, dict[str, Any]] = {}
    for tier in tiers:
        medium = getattr(tier, "medium", None)
        caps = getattr(tier, "capabilities", None)
        flags = (dataclasses.asdict(caps) if dataclasses.is_dataclass(caps)
                 and not isinstance(caps, type) else {})
        out[str(tier.name)] = {"medium": str(getattr(medium, "value", medium or "remote")),
                               **{k: bool(v) for k, v in flags.items()}}
    return out
