"""Chunks a lower tier reads layer by layer, so the engine's layer i waits only for layer i.

A stored chunk is layer-major (``[layers, planes, tokens, width]``, :mod:`lmc.storage.serde`): layer
i's bytes are one contiguous range of the value. A tier offering :meth:`StorageBackend.
get_layers` opens every hit (header read and checked, pool object allocated) and returns a
:class:`LayeredRead` at once; its I/O then fills the objects in layer order (layer 0 of every
chunk, then layer 1...), announcing each layer with :meth:`LayeredRead.landed`.

Integrity. A value's checksum (and its keyed tag, with ``integrity_secret``) covers the whole
value, so no layer is known good until the whole chunk has landed. Layers are nevertheless
handed to the engine as they land; what waits for verification is the *hit*: a layer-wise
retrieve loads its last layer only after :meth:`LayeredRead.wait_verified` passed, and a
chunk that fails makes that layer's load fail (``LoadError``), so the connector reports the
request's blocks as load errors and the engine recomputes them, discarding the step's output
for that request (vLLM's and the reference engine's recompute policy). Bad KV may sit in the
engine's blocks during that step; it is never reported as loaded, never sampled from, and
overwritten by the recompute. Corrupt values are deleted by the tier as on a whole read.
Verified chunks are promoted into L1 only then (``add_done_callback``), never before.

Ownership. The read holds its own reference on every object until its I/O has ended (the
caller's references, one per hit as for ``get``, may be released any time), so a caller that
gives up early never frees memory a read is still writing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from lmc.memory.pool import MemoryObj
from lmc.storage.serde import CorruptValue


class LayerReadError(RuntimeError):
    """The read failed (I/O error, deadline, tier closed): its layers will not land."""


DoneCallback = Callable[["LayeredRead"], None]


class LayeredRead:
    """One tier call's chunks arriving layer by layer (see the module docstring).

    ``objs[i]`` is key i's object (one reference for the caller) or ``None`` for a miss.
    Producer side (the tier's I/O): :meth:`landed`, then :meth:`finish` or :meth:`fail`,
    exactly one of them, always (or waiters would block). Consumer side: :meth:`wait_layer`,
    :meth:`wait_verified`, :meth:`add_done_callback`."""

    def __init__(self, objs: Sequence[MemoryObj | None], num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.objs: list[MemoryObj | None] = list(objs)
        self.num_layers = num_layers
        self._own = [o.acquire() for o in self.objs if o is not None]  # the I/O's references
        self._cond = threading.Condition()
        self._landed = -1  # layers [0, _landed] of every chunk are in place
        self._ok: list[bool] | None = None  # per key, after finish(): the value verified
        self._error: BaseException | None = None
        self._callbacks: list[DoneCallback] = []

    # ----------------------------------------------------------------- producer
    def landed(self, layer: int) -> None:
        """Layers ``[0, layer]`` of every hit are in their objects."""
        with self._cond:
            if layer > self._landed:
                self._landed = layer
                self._cond.notify_all()

    def finish(self, ok: Sequence[bool]) -> None:
        """Every layer landed and each value was checked (``ok[i]``: key i verified; a miss
        counts as not ok). Runs the done callbacks, then drops the I/O's references."""
        if len(ok) != len(self.objs):
            raise ValueError(f"finish: {len(ok)} results for {len(self.objs)} keys")
        self._end([bool(x) and o is not None for x, o in zip(ok, self.objs)], None)

    def fail(self, error: BaseException) -> None:
        """The read stopped: layers not yet landed never will; nothing verifies."""
        self._end([False] * len(self.objs), error)

    def _end(self, ok: list[bool], error: BaseException | None) -> None:
        with self._cond:
            if self.done:
                return
            self._ok, self._error = ok, error
            if error is None:
                self._landed = self.num_layers - 1
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        try:
            for cb in callbacks:  # while the I/O still holds its references
                cb(self)
        finally:
            own, self._own = self._own, []
            for o in own:
                o.release()

    # ----------------------------------------------------------------- consumer
    @property
    def done(self) -> bool:
        return self._ok is not None

    @property
    def error(self) -> BaseException | None:
        """Why the read failed (``None`` while running or when it finished)."""
        return self._error

    @property
    def ok(self) -> list[bool] | None:
        """Per key, whether its value verified; ``None`` until the read ended."""
        return self._ok

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` of every hit is in place. :class:`LayerReadError` if the
        read failed first (or ``timeout`` seconds passed)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._landed >= layer or self._error is not None,
                                       timeout):
                raise LayerReadError(f"layer {layer} did not land within {timeout} s")
            if self._landed < layer:
                raise LayerReadError(f"reading layer {layer} failed: {self._error}")

    def wait_verified(self, idxs: Sequence[int] | None = None, timeout: float | None = None
                      ) -> None:
        """Block until the read ended; raise unless every key in ``idxs`` (default: every
        hit) verified: :class:`~lmc.storage.serde.CorruptValue` for a bad value,
        :class:`LayerReadError` for a failed read."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ok is not None, timeout):
                raise LayerReadError(f"values not verified within {timeout} s")
            ok, error = self._ok, self._error
        assert ok is not None
        if error is not None:
            raise LayerReadError(f"read failed: {error}")
        want = range(len(ok)) if idxs is None else idxs
        bad = [i for i in want if not ok[i] and (idxs is not None or self.objs[i] is not None)]
        if bad:
            raise CorruptValue(f"{len(bad)} chunk(s) failed verification after landing")

    def add_done_callback(self, cb: DoneCallback) -> None:
        """Call ``cb(read)`` once the read ended, before its own references go (at once if
        it already ended; the caller's references then keep the objects alive)."""
        with self._cond:
            if not self.done:
                self._callbacks.append(cb)
                return
        cb(self)


class LayerGate:
    """What a layer-wise retrieve waits on: per chunk it loads, the read (if any) still
    filling it. Chunks from L1 or a whole-chunk tier are ready from the start."""

    def __init__(self, parts: Sequence[tuple[LayeredRead, int] | None] = ()) -> None:
        self.parts = list(parts)
        self._reads: dict[int, tuple[LayeredRead, list[int]]] = {}
        for p in parts:
            if p is not None:
                read, i = p
                self._reads.setdefault(id(read), (read, []))[1].append(i)

    def prefix(self, n: int) -> LayerGate:
        """The gate of the first ``n`` chunks only."""
        return self if n >= len(self.parts) else LayerGate(self.parts[:n])

    @property
    def pending(self) -> bool:
        """Some chunk is still arriving (else every wait returns at once)."""
        return any(not r.done for r, _ in self._reads.values())

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        for read, _ in self._reads.values():
            read.wait_layer(layer, timeout)

    def wait_verified(self, timeout: float | None = None) -> None:
        for read, idxs in self._reads.values():
            read.wait_verified(idxs, timeout)


READY = LayerGate()


class Coordinators:
    """The threads a tier's layered reads run on (one per ``get_layers`` call), so that the
    tier's ``close()`` can wait for every one: a read still running would write into pool
    objects, or use connections and files, after the tier is gone."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def start(self, target: Callable[[], None]) -> bool:
        """Run ``target`` on a new thread; ``False`` (nothing started) once closed."""

        def run() -> None:
            try:
                target()
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        t = threading.Thread(target=run, name=self.name, daemon=True)
        with self._lock:
            if self._closed:
                return False
            self._threads.add(t)
            t.start()
        return True

    def close(self) -> None:
        """Refuse new reads, then wait for the running ones (each ends within its deadline,
        or failed once the tier's I/O stopped)."""
        with self._lock:
            self._closed = True
            running = list(self._threads)
        for t in running:
            t.join()
