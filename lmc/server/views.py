"""Byte views of pool objects without a tensor round trip.

Why: ``serde.tensor_bytes(obj.tensor)`` builds a typed tensor view, a byte view, a reshape
and a numpy array per object, about 20 us; at a few GiB/s of 1 MiB values that is several
percent of a core. A pool is one buffer, so a memoryview of the whole buffer, made once per
pool, sliced at the object's offset gives the same bytes for a fraction of that.
"""

from __future__ import annotations

import weakref

from lmc.memory import MemoryObj, MemoryPool
from lmc.serde import tensor_bytes

_views: weakref.WeakKeyDictionary[MemoryPool, memoryview] = weakref.WeakKeyDictionary()


def _pool_view(pool: MemoryPool) -> memoryview | None:
    mv = _views.get(pool)
    if mv is None:
        buf = getattr(pool, "buffer", None)
        if buf is None or buf.device.type != "cpu" or not buf.is_contiguous():
            return None
        mv = _views[pool] = memoryview(buf.numpy()).cast("B")
    return mv


def byte_view(obj: MemoryObj) -> memoryview:
    """A writable, zero-copy byte view of ``obj``'s memory."""
    mv = _pool_view(obj.pool) if isinstance(obj.pool, MemoryPool) else None
    if mv is None:
        return tensor_bytes(obj.tensor)
    return mv[obj.offset: obj.offset + obj.nbytes]
