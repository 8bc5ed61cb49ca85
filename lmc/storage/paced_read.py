"""A layered read relayed at a link's pace: the ``rate_limit`` wrapper with ``layered``.

The wrapped tier reads layer by layer at its own speed (:mod:`lmc.storage.layered_read`);
the relay hands each chunk's layer on only once its bytes have passed the wrapper's link,
in the order a layered read moves them (layer 0 of every chunk, then layer 1...), so the
consumer sees what a tier behind that link would show: layers landing at the link's rate,
progress a load watch can judge (:mod:`lmc.storage.layered_watch`), and a cut that stops
the link's bytes for the chunks cut (told to the wrapped read too). The relay's result is
the wrapped read's: a chunk verifies here only if it verified there, and the relay ends
only after the wrapped read's I/O has (each holds its own references until then).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lmc.storage.layered_read import Coordinators, LayeredRead, LayerReadError

Pace = Callable[[int, float], None]
"""Hold the caller until ``nbytes`` have passed the link (counted from ``t0``)."""


def paced(inner: LayeredRead, pace: Pace, closed: Callable[[], bool],
          threads: Coordinators, timeout: float) -> LayeredRead:
    """A read of ``inner``'s objects that lands each layer once ``pace`` let its bytes
    through; ``timeout`` bounds each wait for ``inner``."""
    outer = LayeredRead(inner.objs, inner.num_layers)

    def cut(kept: int) -> None:  # the wrapped tier stops reading the keys cut, if it can
        inner.cut(kept)

    outer.on_cut(cut)

    def relay() -> None:
        try:
            for layer in range(outer.num_layers):
                inner.wait_layer(layer, timeout)
                for i, o in enumerate(outer.objs):
                    if o is None or i >= outer.kept:
                        continue
                    n = o.nbytes // outer.num_layers
                    outer.moving(n)
                    pace(n, time.monotonic())
                    outer.moving(-n)
                    if closed():
                        raise LayerReadError("the rate-limited tier closed")
                    outer.note(i, n)
                outer.landed(layer)
            inner.wait_verified([], timeout)  # settled: inner.ok says which verified
            ok = list(inner.ok or [False] * len(outer.objs))
            outer.settle(ok)
            inner.wait_ended(timeout)
            outer.finish(ok)
        except BaseException as e:  # noqa: BLE001 - reported through the read
            outer.fail(e)

    if not threads.start(relay):
        outer.fail(LayerReadError("the rate-limited tier closed"))
    return outer
