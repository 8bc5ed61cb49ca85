"""Byte views of pool objects for the daemon's and the client's socket I/O.

One implementation: :meth:`lmc.memory.pool.MemoryObj.byte_view` (a slice of one cached memoryview
of the pool's buffer, checked against a freed object). Why not ``serde.tensor_bytes``: it
builds a typed tensor view, a byte view, a reshape and a numpy array per object, about 20 us;
at a few GiB/s of 1 MiB values that is several percent of a core. That path remains only for
an object whose pool is not a CPU :class:`MemoryPool`.
"""

from __future__ import annotations

from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.storage.serde import tensor_bytes


def byte_view(obj: MemoryObj) -> memoryview:
    """A writable, zero-copy byte view of ``obj``'s memory."""
    pool = obj.pool
    if isinstance(pool, MemoryPool) and pool.buffer.device.type == "cpu":
        return obj.byte_view()
    return tensor_bytes(obj.tensor)
