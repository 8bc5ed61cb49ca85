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

import bisect
import math
import threading
import time
from collections.abc import Callable, Sequence

from lmc.memory.pool import MemoryObj
from lmc.storage.serde import CorruptValue


class LayerReadError(RuntimeError):
    """The read failed (I/O error, deadline, tier closed): its layers will not land."""


DoneCallback = Callable[["LayeredRead"], None]
MAX_SAMPLES = 256  # landings a read keeps for a watch's rate (thinned as more land)


class LayeredRead:
    """One tier call's chunks arriving layer by layer (see the module docstring).

    ``objs[i]`` is key i's object (one reference for the caller) or ``None`` for a miss.
    Producer side (the tier's I/O): :meth:`landed`, then :meth:`finish` or :meth:`fail`,
    exactly one of them, always (or waiters would block); :meth:`settle` first when the
    kept keys verified while I/O of cut keys still runs; :meth:`note` and
    :meth:`moving` for a watch (:mod:`lmc.storage.layered_watch`), :meth:`on_cut` to
    hear of cuts. Consumer side: :meth:`wait_layer`, :meth:`wait_verified`,
    :meth:`add_done_callback`, :meth:`cut`."""

    def __init__(self, objs: Sequence[MemoryObj | None], num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.objs: list[MemoryObj | None] = list(objs)
        self.num_layers = num_layers
        self._own = [o.acquire() for o in self.objs if o is not None]  # the I/O's references
        self._cond = threading.Condition()
        self._landed = -1  # layers [0, _landed] of every kept chunk are in place
        self._ok: list[bool] | None = None  # per key, once settled: the value verified
        self._ended = False  # the I/O is over (callbacks ran or are running)
        self._released = False  # ... and the I/O's references are gone
        self._error: BaseException | None = None
        self._callbacks: list[DoneCallback] = []
        self._cut_hooks: list[Callable[[int], None]] = []
        self.kept = len(self.objs)
        """Keys ``[0, kept)`` are read; the rest were cut (:meth:`cut`) and never verify."""
        self.stops_on_cut = True
        """Whether the producer stops reading the keys cut (the disk tier's does): if not (a
        Redis read keeps its connections' order, layer 0 of every key first), the kept keys'
        last layers land only after everyone's, so a watch cuts to none or not at all."""
        self.t0 = time.monotonic()
        self.landed_bytes = [0] * len(self.objs)  # per key, bytes of whole reads in place
        self.landed_total = 0
        self.last_at = self.t0  # when a read last landed
        self.in_flight = 0  # bytes whose reads are running now
        self._samples: list[tuple[float, int]] = []  # (time, landed_total) at landings

    # ----------------------------------------------------------------- producer
    def landed(self, layer: int) -> None:
        """Layers ``[0, layer]`` of every kept hit are in their objects."""
        with self._cond:
            if layer > self._landed:
                self._landed = layer
                self._cond.notify_all()

    def note(self, i: int, nbytes: int) -> None:
        """A read of ``nbytes`` of key ``i``'s value landed (progress, for a watch)."""
        with self._cond:
            self.landed_bytes[i] += nbytes
            self.landed_total += nbytes
            self.last_at = now = time.monotonic()
            samples = self._samples
            if len(samples) >= MAX_SAMPLES:  # every other one kept: spread over the read
                del samples[1::2]
            samples.append((now, self.landed_total))

    def progress(self, n: int, since: float
                 ) -> tuple[list[int], int, float, tuple[float, int]]:
        """For a watch, at one instant: bytes in place per key of the first ``n``, bytes
        moved at most (landed, and in flight), when a read last landed, and the last
        landing at or before ``since`` (time, bytes landed by then; the read's start if
        none)."""
        with self._cond:
            k = bisect.bisect_right(self._samples, (since, math.inf))
            ref = self._samples[k - 1] if k else (self.t0, 0)
            return (self.landed_bytes[:n], self.landed_total + self.in_flight, self.last_at,
                    ref)

    def moving(self, nbytes: int) -> None:
        """``nbytes`` more (negative: fewer) are being read right now."""
        with self._cond:
            self.in_flight += nbytes

    def on_cut(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(kept)`` after every cut (at once if one happened already), on the
        cutting thread: the producer stops reading the keys cut."""
        with self._cond:
            self._cut_hooks.append(hook)
            kept = self.kept
        if kept < len(self.objs):
            hook(kept)

    def settle(self, ok: Sequence[bool]) -> None:
        """Every layer of every kept key landed and each was checked (``ok[i]``; keys cut
        or missing count as not ok): waiters on verification go on, while the I/O of cut
        keys may still run (:meth:`finish` or :meth:`fail` follow when it has ended)."""
        if len(ok) != len(self.objs):
            raise ValueError(f"settle: {len(ok)} results for {len(self.objs)} keys")
        with self._cond:
            if self._ok is not None:
                return
            self._ok = [bool(x) and o is not None and i < self.kept
                        for i, (x, o) in enumerate(zip(ok, self.objs))]
            self._landed = self.num_layers - 1
            self._cond.notify_all()

    def finish(self, ok: Sequence[bool]) -> None:
        """Every layer landed and each value was checked (``ok[i]``: key i verified; a miss
        counts as not ok). Runs the done callbacks, then drops the I/O's references."""
        if len(ok) != len(self.objs):
            raise ValueError(f"finish: {len(ok)} results for {len(self.objs)} keys")
        self.settle(ok)
        self._end(None)

    def fail(self, error: BaseException) -> None:
        """The read stopped: layers not yet landed never will; nothing verifies (unless
        the kept keys already settled: then only the cut keys' I/O failed)."""
        self._end(error)

    def _end(self, error: BaseException | None) -> None:
        with self._cond:
            if self._ended:
                return
            self._ended = True
            if self._ok is None:
                self._ok, self._error = [False] * len(self.objs), error
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        try:
            for cb in callbacks:  # while the I/O still holds its references
                cb(self)
        finally:
            own, self._own = self._own, []
            for o in own:
                o.release()
            with self._cond:
                self._released = True
                self._cond.notify_all()

    # ----------------------------------------------------------------- consumer
    @property
    def done(self) -> bool:
        """The read's I/O is over."""
        return self._ended

    @property
    def settled(self) -> bool:
        """Whether the kept keys' verification is known."""
        return self._ok is not None

    @property
    def error(self) -> BaseException | None:
        """Why the read failed (``None`` while running or when it finished)."""
        return self._error

    @property
    def ok(self) -> list[bool] | None:
        """Per key, whether its value verified; ``None`` until the read settled."""
        return self._ok

    def cut(self, kept: int) -> bool:
        """Read keys ``[0, kept)`` only from now on (a watch found the rest dearer than
        recomputing): their layers keep landing and they alone verify; the others never
        count. ``False`` (nothing changes) when no fewer keys would be read, or every layer
        of the kept keys has landed already."""
        with self._cond:
            if kept >= self.kept or self._landed >= self.num_layers - 1 or self._ended:
                return False
            self.kept = max(0, kept)
            hooks = list(self._cut_hooks)
            self._cond.notify_all()
        for hook in hooks:
            hook(self.kept)
        return True

    def wait_change(self, timeout: float) -> None:
        """Block until a layer lands, the read settles, ends or is cut, or ``timeout``."""
        with self._cond:
            self._cond.wait(max(0.0, timeout))

    def _none_kept(self, idxs: Sequence[int] | None) -> bool:
        """Whether a cut left none of ``idxs`` (``None``: of the keys; an empty list waits
        for the read to settle all the same) to wait for."""
        if idxs is None:
            return self.kept == 0
        return bool(idxs) and all(i >= self.kept for i in idxs)

    def wait_layer(self, layer: int, timeout: float | None = None,
                   idxs: Sequence[int] | None = None) -> None:
        """Block until ``layer`` of every kept hit is in place, or a cut keeps none of
        ``idxs`` (default: of the keys; a waiter already blocked when a watch cuts the read
        goes on at once instead of waiting for bytes no one will use).
        :class:`LayerReadError` if the read failed first (or ``timeout`` seconds passed)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._landed >= layer or self._error is not None
                                       or self._none_kept(idxs), timeout):
                raise LayerReadError(f"layer {layer} did not land within {timeout} s")
            if self._landed < layer and not self._none_kept(idxs):
                raise LayerReadError(f"reading layer {layer} failed: {self._error}")

    def wait_verified(self, idxs: Sequence[int] | None = None, timeout: float | None = None
                      ) -> None:
        """Block until the read settled; raise unless every key in ``idxs`` (default: every
        hit) that was not cut verified: :class:`~lmc.storage.serde.CorruptValue` for a bad
        value, :class:`LayerReadError` for a failed read."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ok is not None or
                                       self._none_kept(idxs), timeout):
                raise LayerReadError(f"values not verified within {timeout} s")
            ok, error, kept = self._ok, self._error, self.kept
            if ok is None:  # cut to none of ``idxs`` before it settled: nothing to verify
                return
        if error is not None:
            raise LayerReadError(f"read failed: {error}")
        want = range(kept) if idxs is None else [i for i in idxs if i < kept]
        bad = [i for i in want if not ok[i] and (idxs is not None or self.objs[i] is not None)]
        if bad:
            raise CorruptValue(f"{len(bad)} chunk(s) failed verification after landing")

    def wait_ended(self, timeout: float | None = None) -> None:
        """Block until the read's I/O ended and its own references are gone (then each hit
        holds the caller's reference only); :class:`LayerReadError` after ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._released, timeout):
                raise LayerReadError(f"the read did not end within {timeout} s")

    def add_done_callback(self, cb: DoneCallback) -> None:
        """Call ``cb(read)`` once the read's I/O ended, before its own references go (at
        once if it already ended; the caller's references then keep the objects alive)."""
        with self._cond:
            if not self._ended:
                self._callbacks.append(cb)
                return
        cb(self)


class LayerGate:
    """What a layer-wise retrieve waits on: per chunk it loads, the read (if any) still
    filling it. Chunks from L1 or a whole-chunk tier are ready from the start. A read may
    be cut while it runs (:meth:`LayeredRead.cut`): then only the chunks before the first
    cut one are loaded (:meth:`kept`)."""

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

    def kept(self) -> int:
        """The leading chunks no cut has dropped (all of them unless a read was cut)."""
        if not any(r.kept < len(r.objs) for r, _ in self._reads.values()):
            return len(self.parts)
        for c, p in enumerate(self.parts):
            if p is not None and p[1] >= p[0].kept:
                return c
        return len(self.parts)

    @property
    def pending(self) -> bool:
        """Some chunk is still arriving (else every wait returns at once)."""
        return any(not r.settled for r, _ in self._reads.values())

    def _live(self) -> list[tuple[LayeredRead, list[int]]]:
        """The reads filling a chunk of the kept prefix, each with its keys there."""
        n = self.kept()
        if n == len(self.parts):
            return list(self._reads.values())
        out: dict[int, tuple[LayeredRead, list[int]]] = {}
        for p in self.parts[:n]:
            if p is not None:
                out.setdefault(id(p[0]), (p[0], []))[1].append(p[1])
        return list(out.values())

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Until ``layer`` of every chunk of the kept prefix is in place (read
        :meth:`kept` after: a cut meanwhile only shortens the prefix)."""
        for read, idxs in self._live():
            read.wait_layer(layer, timeout, idxs)

    def wait_verified(self, timeout: float | None = None) -> None:
        """Until every chunk of the kept prefix verified (raises as
        :meth:`LayeredRead.wait_verified`); the prefix is final once this returns."""
        for read, idxs in self._live():
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
