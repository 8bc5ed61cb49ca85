"""The engine's bound KV caches: a transfer per cache, never keeping a dropped cache alive.

Building a transfer validates every layer and precomputes tables (milliseconds for a 32-layer
model), so the engine reuses the one bound to the caches a call passes. But a transfer holds
the cache tensors, and a cache the caller has dropped (vLLM reallocating its KV cache after
profiling, sleep mode, a test's scratch cache) must not stay allocated -- on a GPU that is
gigabytes. So each transfer is built on *detached aliases* of the caller's tensors (same
memory, distinct Python objects), and the entry watches the caller's own tensor objects
through weak references: once any of them is collected the entry is dropped, and with it the
aliases and the memory. A view is watched through its base tensor (which the view keeps
alive), so a caller passing fresh views of one cache on every call still hits the entry
instead of paying a rebuild per call. At most ``capacity`` caches are bound at once (least recently used
dropped first).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch

from lmc.transfer.kv_spec import KVCaches
from lmc.transfer.plan import KVTransfer


def leaf_tensors(kv_caches: KVCaches) -> list[torch.Tensor]:
    """The caller's tensor objects in a cache container (list, tuple, mapping, or tensor)."""
    if isinstance(kv_caches, torch.Tensor):
        return [kv_caches]
    if isinstance(kv_caches, Mapping):
        kv_caches = list(kv_caches.values())
    if isinstance(kv_caches, (list, tuple)):
        return [t for x in kv_caches for t in leaf_tensors(x)]
    return []


def detached(kv_caches: KVCaches) -> KVCaches:
    """The same container with every tensor replaced by an alias of its memory: holding the
    alias keeps the memory, not the caller's tensor object."""
    if isinstance(kv_caches, torch.Tensor):
        return kv_caches.detach()
    if isinstance(kv_caches, Mapping):
        return {k: detached(v) for k, v in kv_caches.items()}
    if isinstance(kv_caches, list):
        return [detached(x) for x in kv_caches]
    if type(kv_caches) is tuple:
        return tuple(detached(x) for x in kv_caches)
    return kv_caches  # anything else: the transfer's validation names what is wrong


def _roots(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The objects to watch: each tensor's base if it is a view (alive as long as any view
    of it is), else itself; each once."""
    out: dict[int, torch.Tensor] = {}
    for t in tensors:
        r = t._base if t._base is not None else t
        out.setdefault(id(r), r)
    return list(out.values())


def _signature(tensors: list[torch.Tensor]) -> tuple | None:
    """Address, shape, strides, dtype and device: what identifies a bound cache."""
    if not tensors:
        return None
    return (*((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors),
            tensors[0].device)


class _Entry:
    __slots__ = ("transfer", "serial", "watch")

    def __init__(self, transfer: KVTransfer, serial: int) -> None:
        self.transfer = transfer
        self.serial = serial  # which binding a callback is about (never a reference to it:
        self.watch: list[weakref.ref] = []  # a cycle would keep the memory until a GC pass)


class TransferCache:
    """``get(kv_caches)`` -> the transfer bound to those caches (built by ``make`` if new)."""

    def __init__(self, make: Callable[[KVCaches], KVTransfer], capacity: int = 4) -> None:
        self.make = make
        self.capacity = capacity
        self._lock = threading.Lock()
        self._map: OrderedDict[tuple, _Entry] = OrderedDict()
        self._serial = 0
        self._dead: list[tuple[tuple, int]] = []  # collected while the lock was held

    def get(self, kv_caches: KVCaches) -> KVTransfer:
        owners = leaf_tensors(kv_caches)
        sig = _signature(owners)
        if sig is not None:
            with self._lock:
                self._sweep_locked()
                e = self._map.get(sig)
                if e is not None:
                    self._map.move_to_end(sig)
                    return e.transfer
        tr = self.make(detached(kv_caches))
        if sig is None:
            return tr
        me = weakref.ref(self)
        with self._lock:
            self._serial += 1
            entry = _Entry(tr, self._serial)
            on_drop = functools.partial(_dropped, me, sig, entry.serial)
            entry.watch = [weakref.ref(t, on_drop) for t in _roots(owners)]
            self._map[sig] = entry
            while len(self._map) > self.capacity:
                self._map.popitem(last=False)
        return tr

    def _drop(self, sig: tuple, serial: int) -> None:
        """From a weakref callback, which may run inside this class's own locked code (a GC
        pass there) or while another thread holds the lock: then the sweep of the next
        ``get`` does it."""
        if not self._lock.acquire(blocking=False):
            self._dead.append((sig, serial))
            return
        try:
            self._unbind_locked(sig, serial)
        finally:
            self._lock.release()

    def _unbind_locked(self, sig: tuple, serial: int) -> None:
        e = self._map.get(sig)
        if e is not None and e.serial == serial:  # not a newer cache bound at that address
            del self._map[sig]

    def _sweep_locked(self) -> None:
        while self._dead:
            self._unbind_locked(*self._dead.pop())

    def transfers(self) -> list[KVTransfer]:
        """The transfers bound now, least recently used first (for stats)."""
        with self._lock:
            return [e.transfer for e in self._map.values()]

    def clear(self) -> None:
        with self._lock:
            self._map.clear()

    def __len__(self) -> int:
        return len(self._map)


def _dropped(cache_ref: weakref.ref, sig: tuple, serial: int, _dead: weakref.ref) -> None:
    """A caller's tensor was collected (``_dead``: its weak reference, whose callback this
    is): unbind its cache (weakly: the cache may be gone)."""
    cache = cache_ref()
    if cache is not None:
        cache._drop(sig, serial)
