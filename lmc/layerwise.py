"""Layer-wise store and retrieve: the forms a connector uses to overlap copies with compute.

Retrieve: ``start()`` queues every layer's scatter on the engine's I/O thread in layer order;
the model calls ``wait(i)`` before layer i's attention, so layer i+1 loads while layer i
computes (torch and numpy release the GIL while copying). Store: ``save(i)`` queues layer i's
gather once the layer's KV is in the cache; ``commit()`` waits for all of them and only then
makes the chunks visible. A failure in any layer fails the whole operation: nothing partial is
stored, and a failed load is reported so that the engine recomputes those tokens.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from lmc.memory import Lease, MemoryObj
from lmc.transfer import KVTransfer, TransferPlan

if TYPE_CHECKING:
    from lmc.cache_engine import CacheEngine, Chunk


class LoadError(RuntimeError):
    """A layer failed to load: the tokens of this retrieve must be recomputed."""


class _Layerwise:
    def __init__(self, engine: CacheEngine, tr: KVTransfer, plan: TransferPlan | None,
                 chunks: list[Chunk], objs: list[MemoryObj]) -> None:
        self.engine = engine
        self.tr = tr
        self.plan = plan
        self.chunks = chunks
        self.lease = Lease(objs)
        self.bufs = [o.tensor for o in objs]
        self.num_layers = engine.spec.num_layers
        self.num_tokens = sum(e - s for s, e, _ in chunks)
        self.nbytes = sum(o.nbytes for o in objs)
        self._futures: dict[int, Future] = {}
        self._done = False
        self._t0 = time.perf_counter()

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if self._done:
            raise RuntimeError(f"{type(self).__name__} already finished")

    def _drain(self) -> BaseException | None:
        err = None
        for f in self._futures.values():
            e = f.exception()
            err = err or e
        return err

    def __enter__(self):
        return self


class LayerwiseStore(_Layerwise):
    """``save(layer)`` for each layer (any order, each once), then ``commit()``."""

    def save(self, layer: int, sync: bool = False) -> None:
        """Gather ``layer``'s new chunks; asynchronous unless ``sync``."""
        self._check_layer(layer)
        if layer in self._futures:
            raise ValueError(f"layer {layer} saved twice")
        if not self.chunks:
            self._futures[layer] = _done_future()
            return
        if sync:
            self.tr.gather(self.plan, self.bufs, [layer])
            self._futures[layer] = _done_future()
        else:
            self._futures[layer] = self.engine.executor().submit(
                self.tr.gather, self.plan, self.bufs, [layer])

    def commit(self) -> int:
        """Make the chunks visible once every layer is in; returns tokens stored."""
        if self._done:
            raise RuntimeError("LayerwiseStore already finished")
        missing = [i for i in range(self.num_layers) if i not in self._futures]
        if missing and self.chunks:
            self.abort()
            raise ValueError(f"commit() before layers {missing[:8]} were saved: nothing stored")
        err = self._drain()
        if err is not None:
            self.abort()
            raise err
        self._done = True
        try:
            if self.chunks:
                self.tr.synchronize()
                self.engine.storage.put([k for _, _, k in self.chunks], self.lease.objs)
        finally:
            self.lease.release()
        self.engine.metrics.transfer("store", self.num_tokens, self.nbytes,
                                     time.perf_counter() - self._t0)
        return self.num_tokens

    def abort(self) -> None:
        """Drop everything gathered so far; nothing becomes visible."""
        if self._done:
            return
        self._done = True
        self._drain()
        self.lease.release()

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.commit()


class LayerwiseRetrieve(_Layerwise):
    """``start()`` then ``wait(layer)`` per layer (or ``load(layer)``), then ``close()``."""

    def start(self) -> LayerwiseRetrieve:
        """Queue every layer's load in order on the I/O thread."""
        if self.chunks and not self._futures:
            ex = self.engine.executor()
            for layer in range(self.num_layers):
                self._futures[layer] = ex.submit(self.tr.scatter, self.plan, self.bufs, [layer])
        return self

    def load(self, layer: int) -> None:
        """Load ``layer`` synchronously on the calling thread."""
        self._check_layer(layer)
        if self.chunks and layer not in self._futures:
            try:
                self.tr.scatter(self.plan, self.bufs, [layer])
            except Exception as e:
                raise LoadError(f"loading layer {layer} failed: {e}") from e
            self._futures[layer] = _done_future()

    def wait(self, layer: int) -> None:
        """Block until ``layer`` is in the engine's cache; ``LoadError`` if it failed."""
        self._check_layer(layer)
        if not self.chunks:
            return
        fut = self._futures.get(layer)
        if fut is None:
            self.load(layer)
            return
        err = fut.exception()
        if err is not None:
            raise LoadError(f"loading layer {layer} failed: {err}") from err
        self.tr.synchronize()

    def close(self) -> int:
        """Release the chunks (after all queued loads end); returns tokens loaded."""
        if self._done:
            return self.num_tokens
        self._done = True
        err = self._drain()
        self.lease.release()
        complete = len(self._futures) == self.num_layers and err is None
        if complete and self.chunks:
            self.engine._unpin_keys([k for _, _, k in self.chunks])
            self.engine.metrics.transfer("retrieve", self.num_tokens, self.nbytes,
                                         time.perf_counter() - self._t0)
        return self.num_tokens if complete else 0

    def __exit__(self, *exc: object) -> None:
        self.close()


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f
