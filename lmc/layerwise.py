"""Layer-wise store and retrieve: the forms a connector uses to overlap copies with compute.

Retrieve: ``start()`` queues every layer's scatter on the engine's I/O thread in layer order;
the model calls ``wait(i)`` before layer i's attention, so layer i+1 loads while layer i
computes (torch and numpy release the GIL while copying). Store: ``save(i)`` queues layer i's
gather once the layer's KV is in the cache; ``commit()`` waits for all of them and only then
makes the chunks visible. A failure in any layer fails the whole operation: nothing partial is
stored, and a failed load is reported so that the engine recomputes those tokens.

Ordering and ownership (see :mod:`lmc.transfer.completion`): each layer's copy has one completion
handle. Copies run on lmc's copy stream; a save starts after a point recorded on the caller's
stream at ``save`` time, a retrieve's loads after a point recorded when it was created, and
``wait(i, stream)`` makes the engine's stream (not the host) wait for layer i's load. The chunk
buffers stay leased until every handle is done: ``commit``, ``close`` and ``abort`` wait first.

What these objects need from the cache engine is declared by :class:`LayerwiseHost` (layer
count, the I/O thread, making stored chunks visible, transfer metrics): a ``CacheEngine``
is one, and so is anything else that owns chunks and a thread, without this module reaching
into an engine's tiers or metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

from lmc.memory.pool import LazyTensors, Lease, MemoryObj
from lmc.storage.layered_read import READY, LayerGate
from lmc.token_database import Chunk, ChunkKey
from lmc.transfer import completion
from lmc.transfer.completion import DONE, Completion, FutureCompletion, copy_stream, wait_all
from lmc.transfer.plan import KVTransfer, TransferPlan

log = logging.getLogger(__name__)


class LayerwiseHost(Protocol):
    """The engine side of a layer-wise copy (``CacheEngine`` implements it)."""

    @property
    def num_layers(self) -> int:
        """Layers each chunk holds: a store commits only after all of them were saved."""
        ...

    def executor(self) -> Executor:
        """The one ordered background thread that runs asynchronous copies."""
        ...

    def commit_chunks(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> None:
        """Make fully written chunks visible (the caller keeps its own references)."""
        ...

    def record_transfer(self, kind: str, tokens: int, nbytes: int, seconds: float) -> None:
        """Count a finished ``"store"`` or ``"retrieve"``."""
        ...


class LoadError(RuntimeError):
    """A layer failed to load: the tokens of this retrieve must be recomputed."""


class CopyLease(Lease):
    """A :class:`Lease` whose memory is under asynchronous copies (``attach`` their handles).

    ``release`` enforces the ownership rule: callers must have waited for every attached copy.
    One that did not is a bug: the lease still waits (the memory is never reused under a
    copy), then raises in strict mode (debug pools, ``lmc.transfer.completion.STRICT``) or logs it.
    """

    def __init__(self, objs: Iterable[MemoryObj | None]) -> None:
        super().__init__(objs)
        self.handles: list[Completion] = []

    def __enter__(self) -> CopyLease:  # type: ignore[override]  # callers attach handles
        return self

    def attach(self, handle: Completion) -> Completion:
        self.handles.append(handle)
        return handle

    def release(self) -> None:
        handles, self.handles = self.handles, []
        pending = [h for h in handles if not h.done()]
        if pending:
            wait_all(pending)
        strict = completion.STRICT or bool(self.objs and self.objs[0].pool.debug)
        super().release()
        if pending:
            msg = (f"pool memory released with {len(pending)} copy(ies) still in flight: a "
                   "wait is missing before the release (waited there instead)")
            if strict:
                raise AssertionError(msg)
            log.error(msg)


class _Layerwise:
    def __init__(self, host: LayerwiseHost, tr: KVTransfer, plan: TransferPlan | None,
                 chunks: list[Chunk], objs: list[MemoryObj]) -> None:
        self.host = host
        self.tr = tr
        self.plan = plan
        self.chunks = chunks
        self.lease = CopyLease(objs)
        self.bufs = LazyTensors(objs)  # made only if a torch path indexes them
        # CPU: the numpy views each layer's copy moves (no tensor made per chunk or layer)
        self.arrays = objs[0].pool.arrays(objs) if objs and tr.device.type == "cpu" else None
        self.num_layers = host.num_layers
        self.num_tokens = sum(e - s for s, e, _ in chunks)
        self.nbytes = sum(o.nbytes for o in objs)
        self.stream = copy_stream(tr.device)
        self._handles: dict[int, Completion] = {}
        self._lock = threading.Lock()
        self._done = False
        self._t0 = time.perf_counter()

    def _plan(self) -> TransferPlan:
        """The copy's plan: there is one whenever there are chunks to copy."""
        if self.plan is None:
            raise RuntimeError("a layer copy without a plan (no chunks to copy)")
        return self.plan

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if self._done:
            raise RuntimeError(f"{type(self).__name__} already finished")

    def _record(self, layer: int, handle: Completion) -> Completion:
        with self._lock:
            self._handles[layer] = self.lease.attach(handle)
        return handle

    def _wait_all(self) -> BaseException | None:
        """Block until every issued copy has completed: only then is the memory ours."""
        with self._lock:
            handles = list(self._handles.values())
        return wait_all(handles)

    def __enter__(self):
        return self


class LayerwiseStore(_Layerwise):
    """``save(layer)`` for each layer (any order, each once), then ``commit()``.

    A host with a ``note_saving()`` method (a ``CacheEngine``) hears of each layer saved:
    its lower-tier writes can hold off while the engine saves (``write_quiet_ms``)."""

    def __init__(self, host: LayerwiseHost, tr: KVTransfer, plan: TransferPlan | None,
                 chunks: list[Chunk], objs: list[MemoryObj]) -> None:
        super().__init__(host, tr, plan, chunks, objs)
        self._saving: Callable[[], None] | None = getattr(host, "note_saving", None)

    def save(self, layer: int, sync: bool = False, after: Completion | None = None) -> None:
        """Gather ``layer``'s new chunks once the engine's stream reaches ``after`` (default:
        the point the caller's current stream has reached now, i.e. after the forward wrote
        this layer). Asynchronous unless ``sync`` (then the layer is gathered on return)."""
        self._check_layer(layer)
        if layer in self._handles:
            raise ValueError(f"layer {layer} saved twice")
        if not self.chunks:
            self._record(layer, DONE)
            return
        after = self.tr.record_event() if after is None else after
        if self._saving is not None:
            self._saving()
        if sync:
            h = self.tr.gather(self._plan(), self.bufs, [layer], after=after, stream=self.stream,
                               arrays=self.arrays)
            self._record(layer, h).wait()
        else:
            fut = self.host.executor().submit(self.tr.gather, self._plan(), self.bufs, [layer],
                                                after=after, stream=self.stream,
                                                arrays=self.arrays)
            self._record(layer, FutureCompletion(fut))

    def commit(self) -> int:
        """Make the chunks visible once every layer's copy has completed; returns tokens
        stored."""
        if self._done:
            raise RuntimeError("LayerwiseStore already finished")
        missing = [i for i in range(self.num_layers) if i not in self._handles]
        if missing and self.chunks:
            self.abort()
            raise ValueError(f"commit() before layers {missing[:8]} were saved: nothing stored")
        err = self._wait_all()
        if err is not None:
            self.abort()
            raise err
        self._done = True
        try:
            if self.chunks:
                self.host.commit_chunks([k for _, _, k in self.chunks], self.lease.objs)
        finally:
            self.lease.release()
        self.host.record_transfer("store", self.num_tokens, self.nbytes,
                                  time.perf_counter() - self._t0)
        return self.num_tokens

    def abort(self) -> None:
        """Drop everything gathered so far (after the copies in flight end); nothing becomes
        visible."""
        if self._done:
            return
        self._done = True
        self._wait_all()
        self.lease.release()

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.commit()


class LayerwiseRetrieve(_Layerwise):
    """``start()`` then ``wait(layer)`` per layer (or ``load(layer)``), then ``close()``.

    Every load starts after the point the caller's stream had reached when this object was
    made, so no load overwrites blocks that earlier work on that stream still reads.
    ``tiers``: per chunk, the name of the tier it was fetched from (empty when unknown), so
    a connector can count loaded tokens by tier without asking the tiers again.

    ``gate``: chunks a lower tier is still reading layer by layer (:mod:`lmc.storage.layered_read`).
    Layer i's load first waits for layer i to land; the last layer's load also waits until
    every such chunk verified, and fails (``LoadError``: the engine recomputes) if one did
    not, so no load completes, and ``close`` reports no tokens, on unverified KV. A read a
    load watch cut (:mod:`lmc.storage.layered_watch`) drops the chunks from its first cut
    one: later layers copy only those before it (``replan``), and ``close`` reports those
    alone (``num_tokens`` and ``chunks`` shrink); a dropped chunk's blocks may hold some
    layers, and the caller reports them as not loaded.
    """

    def __init__(self, host: LayerwiseHost, tr: KVTransfer, plan: TransferPlan | None,
                 chunks: list[Chunk], objs: list[MemoryObj], tiers: Sequence[str] = (),
                 gate: LayerGate = READY,
                 replan: Callable[[int], TransferPlan] | None = None) -> None:
        if tiers and len(tiers) != len(chunks):
            raise ValueError(f"{len(tiers)} tier names for {len(chunks)} chunks")
        super().__init__(host, tr, plan, chunks, objs)
        self.tiers = tuple(tiers)
        self.gate = gate
        self.replan = replan
        self.after = tr.record_event() if chunks else DONE
        self._kept = len(chunks)  # the chunks the plan copies (a cut read drops the rest)

    def tokens_by_tier(self, start: int = 0, end: int | None = None) -> dict[str, int]:
        """Positions in ``[start, end)`` this retrieve loads, by source tier."""
        out: dict[str, int] = {}
        for (s, e, _), tier in zip(self.chunks, self.tiers):
            n = min(e, end if end is not None else e) - max(s, start)
            if n > 0:
                out[tier] = out.get(tier, 0) + n
        return out

    def start(self) -> LayerwiseRetrieve:
        """Queue every layer's load in order on the I/O thread."""
        if self.chunks and not self._handles:
            ex = self.host.executor()
            for layer in range(self.num_layers):
                self._record(layer, FutureCompletion(ex.submit(self._copy, layer)))
        return self

    def _copy(self, layer: int) -> Completion:
        plan = self._plan()
        if self.gate is not READY:  # chunks still arriving: this layer's bytes first
            self.gate.wait_layer(layer)
            if layer == self.num_layers - 1:
                self.gate.wait_verified()
            cut = self._cut_plan(self.gate.kept())
            if cut is None:
                return DONE
            plan = cut
        return self.tr.scatter(plan, self.bufs, [layer], arrays=self.arrays,
                               after=self.after, stream=self.stream)

    def _cut_plan(self, kept: int) -> TransferPlan | None:
        """The plan of the first ``kept`` chunks (a load watch cut a read: the chunks after
        it are recomputed, never copied from here on); ``None`` when none are left."""
        with self._lock:
            if kept < self._kept:
                if self.replan is None:
                    raise RuntimeError("a read was cut, and this retrieve cannot re-plan")
                if kept:
                    self.plan = self.replan(kept)
                    objs = self.lease.objs[:kept]
                    self.bufs = LazyTensors(objs)
                    if self.arrays is not None:
                        self.arrays = objs[0].pool.arrays(objs)
                self._kept = kept
            return self.plan if self._kept else None

    def issue(self, layer: int) -> Completion:
        """Launch ``layer``'s load from the calling thread (a connector's I/O thread) without
        waiting for it; ``wait(layer)`` orders the engine after it. ``LoadError`` if the
        launch fails."""
        self._check_layer(layer)
        if not self.chunks:
            return DONE
        with self._lock:
            h = self._handles.get(layer)
        if h is not None:
            return h
        try:
            h = self._copy(layer)
        except Exception as e:
            raise LoadError(f"loading layer {layer} failed: {e}") from e
        return self._record(layer, h)

    def load(self, layer: int) -> None:
        """Load ``layer`` from the calling thread: it is in the cache when this returns."""
        self.issue(layer)
        self.wait(layer)

    def wait(self, layer: int, stream: Any = None) -> None:
        """``stream=None``: block until ``layer`` is in the engine's cache. A CUDA stream: make
        it wait for the layer's load instead of the host. ``LoadError`` if the load failed."""
        self._check_layer(layer)
        if not self.chunks:
            return
        with self._lock:
            h = self._handles.get(layer)
        if h is None:
            h = self.issue(layer)
        try:
            h.wait(stream)
        except Exception as e:
            raise LoadError(f"loading layer {layer} failed: {e}") from e

    def close(self) -> int:
        """Release the chunks once every issued load has completed; returns tokens loaded
        (0 unless every layer loaded)."""
        if self._done:
            return self.num_tokens
        self._done = True
        err = self._wait_all()
        kept = self._kept if self.gate is READY else min(self._kept, self.gate.kept())
        if kept < len(self.chunks):  # a read cut: only the chunks before it loaded
            self.chunks, self.tiers = self.chunks[:kept], self.tiers[:kept]
            self.num_tokens = sum(e - s for s, e, _ in self.chunks)
            self.nbytes = sum(o.nbytes for o in self.lease.objs[:kept])
        self.lease.release()
        complete = len(self._handles) == self.num_layers and err is None
        if complete and self.chunks:  # the lookup's pins were released when the chunks were fetched
            self.host.record_transfer("retrieve", self.num_tokens, self.nbytes,
                                      time.perf_counter() - self._t0)
        return self.num_tokens if complete else 0

    def __exit__(self, *exc: object) -> None:
        self.close()
