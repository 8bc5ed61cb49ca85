"""The disk tier's layer-by-layer read (``DiskBackend.get_layers``, :mod:`lmc.storage.layered_read`).

A value's payload is layer-major, so layer l is the byte range ``[l*LB, (l+1)*LB)`` of the
payload (``LB`` = payload / layers), at file offset ``4096 + l*LB``. With O_DIRECT every
read must start and end on 4 KiB units, which a layer's range need not do; so the payload's
units are dealt out once, in order: read l covers the units from where read l-1 stopped up to
the unit holding layer l's last byte. No unit is read twice (no pool byte is written while
the engine may already be copying it out), and layer l is in place once reads ``0..l`` are.
The value's last partial unit goes through the tier's aligned buffer, as in a whole read
(``MemoryObj.io_spans``), so no pool byte past the object is touched.

Every (chunk, layer) read is queued on the tier's I/O threads up front, layer-major, so its
threads keep several requests in flight across layer boundaries; one coordinator thread per
call waits for them in order, announces each layer, and feeds each chunk's xxh3 with the
layer's bytes as they land (a streamed xxh3 equals the one-shot digest the header holds), so
only the last layer's hashing is left when the last read completes. A value that fails is
deleted, counted and reported not ok; the read never hands out verified status for it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, wait
from typing import TYPE_CHECKING

import xxhash

from lmc.storage.layered_read import LayeredRead, LayerReadError
from lmc.storage.serde import CorruptValue

from .backend import io_all
from .index import BLOCK

if TYPE_CHECKING:
    from .backend import DiskReads, Entry, OpenValue


def layer_windows(nbytes: int, layers: int, align: int) -> list[tuple[int, int]]:
    """Per layer, the payload byte range its read covers: consecutive, non-overlapping,
    each ending on an ``align`` boundary (or the payload's padded end) past the layer's last
    byte; empty where a previous read already covered the layer. ``align`` 1: exact ranges."""
    if layers < 1 or nbytes % layers:
        raise ValueError(f"a payload of {nbytes} bytes does not split into {layers} layers")
    lb = nbytes // layers
    out = []
    start = 0
    for layer in range(layers):
        end = -(-(layer + 1) * lb // align) * align
        out.append((start, max(start, end)))
        start = max(start, end)
    return out


class DiskLayeredRead:
    """One ``get_layers`` call: opened values, their reads and their verification."""

    def __init__(self, tier: DiskReads, jobs: Sequence[tuple[int, bytes, Entry]],
                 nkeys: int) -> None:
        self.tier = tier
        self.values: list[tuple[int, OpenValue]] = []
        objs: list = [None] * nkeys
        futures: list[tuple[int, bytes, Entry, Future | None]] = []
        for i, k, e in jobs:
            try:
                futures.append((i, k, e, tier.submit(tier.open_value, k, e)))
            except RuntimeError:  # the tier closed meanwhile: the rest are misses
                futures.append((i, k, e, None))
        layers = None
        for i, k, e, f in futures:  # every open is waited for: each holds a file and memory
            try:
                if f is None:
                    raise CancelledError()
                v = f.result()
            except (Exception, CancelledError) as exc:
                if not isinstance(exc, CancelledError):
                    tier.read_failed(k, e, exc)
                tier.reader_done(e)
                continue
            if layers is None:
                layers = v.hdr.shape[0]
            if v.hdr.shape[0] != layers:  # another model's shape: not this call's, a miss
                tier.metrics.error("get", "layers_mismatch")
                v.close()
                tier.reader_done(e)
                continue
            objs[i] = v.obj
            self.values.append((i, v))
        self.read = LayeredRead(objs, layers or 1)
        for _, v in self.values:
            v.obj = None  # the caller's reference now; the read holds its own

    def start(self) -> None:
        if not self.values:
            self.read.finish([False] * len(self.read.objs))
            return
        if not self.tier.coordinators.start(self._run):  # close() joins every one it started
            self.read.fail(LayerReadError("disk tier closed"))
            for _, v in self.values:
                v.close()
                self.tier.reader_done(v.entry)

    # ---------------------------------------------------------------- the reads
    def _window(self, i: int, v: OpenValue, obj, lo: int, hi: int) -> None:
        """Read payload bytes ``[lo, hi)`` of ``v`` (key ``i``) into its object (pool
        thread), counted for a watch as in flight, then landed."""
        read = self.read
        read.moving(hi - lo)
        try:
            self._read_window(v, obj, lo, hi)
        finally:
            read.moving(lo - hi)
        read.note(i, hi - lo)

    def _read_window(self, v: OpenValue, obj, lo: int, hi: int) -> None:
        view = obj.byte_view()
        if v.spans is None:  # buffered: exact ranges
            bufs = [view[lo:hi]]
        else:
            head, tail = v.spans
            cut = head.nbytes
            bufs = [head[lo:min(hi, cut)]] if lo < cut else []
            if hi > cut:  # the last, partial unit: through our aligned buffer
                tbuf = self.tier.buffer("_rtail")
                bufs.append(tbuf)
        want = sum(b.nbytes for b in bufs)
        if io_all(os.preadv, v.fd, bufs, BLOCK + lo) < want:
            raise CorruptValue("file truncated")
        if v.spans is not None and hi > v.spans[0].nbytes:
            tail = v.spans[1]
            tail[:] = tbuf[: tail.nbytes]

    def _run(self) -> None:
        tier, read = self.tier, self.read
        layers = read.num_layers
        plans = []
        for i, v in self.values:
            align = BLOCK if v.spans is not None else 1
            n = v.hdr.payload_len
            plans.append((i, v, layer_windows(n, layers, align), n // layers))
        futures: list[list[tuple[int, Future]]] = []
        hashers = [xxhash.xxh3_64() for _ in plans]
        failed: BaseException | None = None
        bad: dict[int, BaseException] = {}
        try:
            for layer in range(layers):
                row = []
                for j, (i, v, wins, _) in enumerate(plans):
                    lo, hi = wins[layer]
                    if hi > lo:
                        row.append((j, tier.submit(self._window, i, v, read.objs[i], lo, hi)))
                futures.append(row)

            def cut(kept: int) -> None:  # a load watch: the queued reads of keys cut go
                for row in futures:
                    for j, f in row:
                        if plans[j][0] >= kept:
                            f.cancel()

            read.on_cut(cut)
            for layer in range(layers):
                for j, f in futures[layer]:
                    if j in bad or plans[j][0] >= read.kept:
                        continue
                    try:
                        f.result()
                    except CorruptValue as e:  # this value is bad; the others go on
                        bad[j] = e
                    except CancelledError:
                        if plans[j][0] < read.kept:
                            raise
                if bad:  # a layer the engine would read is missing: the call failed
                    raise LayerReadError(next(iter(bad.values())))
                read.landed(layer)  # after the last one, no cut: ``read.kept`` is final
                for j, (i, _, _, lb) in enumerate(plans):
                    obj = read.objs[i]
                    assert obj is not None  # a planned read's object is held until it ends
                    if i < read.kept:
                        hashers[j].update(obj.byte_view()[layer * lb:(layer + 1) * lb])
        except BaseException as e:  # noqa: BLE001 - reported through the read, never lost
            failed = e
            for row in futures:
                for _, f in row:
                    f.cancel()
        ok = [False] * len(read.objs)
        try:
            if failed is None:
                ok = self._verify(plans, hashers, bad)
            elif not isinstance(failed, LayerReadError):
                tier.metrics.error("get", type(failed).__name__)
            for j, err in bad.items():  # deleted before anyone hears of the outcome
                tier.read_failed(plans[j][1].key, plans[j][1].entry, err)
            if failed is None:
                read.settle(ok)  # the kept keys' waiters go on; cut keys' reads may run
            # nothing may still write into an object after this; a future cancelled here,
            # by a cut or by close()'s shutdown never runs, and wait() would never count it
            wait([f for row in futures for _, f in row if not f.cancelled()])
        finally:
            for _, v in self.values:
                v.close()
                tier.reader_done(v.entry)
            if failed is not None:
                read.fail(failed)
            else:
                read.finish(ok)

    def _verify(self, plans: list, hashers: list, bad: dict[int, BaseException]) -> list[bool]:
        """Per key, whether its value verified (keys cut never do); a value failing its
        check goes into ``bad``."""
        read = self.read
        ok = [False] * len(read.objs)
        for j, (i, v, _, _) in enumerate(plans):
            if i >= read.kept or j in bad:
                continue
            obj = read.objs[i]
            assert obj is not None
            try:  # the payload hashed as it landed: the framing checks the digest
                self.tier.framing.verify(v.key, v.head, v.hdr, obj.byte_view(),
                                         digest=hashers[j].intdigest())
                ok[i] = True
            except CorruptValue as e:
                bad[j] = e
        return ok
