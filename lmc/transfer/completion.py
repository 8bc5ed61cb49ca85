"""Completion handles: when an asynchronous copy has really finished, and who may then touch
its memory.

Every ``gather``/``scatter`` returns a :class:`Completion`. The ownership rule it carries:
memory under a copy (the pool buffers it reads or writes, the engine KV slots it writes)
belongs to that copy until the handle is done. Pool memory is released only after that
(:class:`lmc.layerwise.CopyLease`), the engine reads a loaded layer only after its stream
waited for the load's handle, and a copy that reads engine KV starts only after the engine's stream reached
the point where that KV was written (the ``after`` handle of a call).

``wait()`` blocks the host; ``wait(stream)`` makes a CUDA stream wait without blocking the
host. On the CPU there are no streams: the host is the engine's stream, so both block.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import torch

# Release of pool memory under a copy that has not completed raises instead of logging.
# Debug pools (``debug_leaks``) are always strict; LMC_STRICT_COPIES=1 makes every pool strict.
STRICT = os.environ.get("LMC_STRICT_COPIES", "") == "1"


class Completion(abc.ABC):
    """One asynchronous copy (or a point on a stream): ``done()`` and ``wait()``."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the copy has completed (successfully or not); never blocks."""

    @abc.abstractmethod
    def wait(self, stream: Any = None) -> None:
        """``stream=None``: block the host until complete, raising the copy's error. A CUDA
        stream: order the stream's later work after the copy, without blocking the host."""


class Done(Completion):
    """Already complete: synchronous CPU copies, and points on the CPU's (host) 'stream'."""

    def done(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        return None

    def __repr__(self) -> str:
        return "DONE"


DONE = Done()


class EventCompletion(Completion):
    """A CUDA event recorded after the copy on the stream that ran it (``None``: nothing was
    issued, e.g. a host emulation of the kernels).

    ``bad_slots``: a device flag set when the copy skipped slots past the cache (slot mappings
    planned on the device are not read back before the copy); a host ``wait`` raises then.
    """

    def __init__(self, event: Any, bad_slots: torch.Tensor | None = None) -> None:
        self.event = event
        self.bad_slots = bad_slots

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self, stream: Any = None) -> None:
        if stream is not None:
            if self.event is not None:
                stream.wait_event(self.event)
            return
        if self.event is not None:
            self.event.synchronize()
        if self.bad_slots is not None and bool(self.bad_slots):
            raise ValueError("slot_mapping holds a slot past the end of the KV cache: those "
                             "tokens were not copied")


class FutureCompletion(Completion):
    """A copy issued from a background thread: the future yields the copy's own handle.

    Done once the future has finished and the copy it issued has completed; a future that
    raised issued nothing, so it is done too (``wait`` raises its error).
    """

    def __init__(self, future: Future) -> None:
        self.future = future

    def done(self) -> bool:
        f = self.future
        if not f.done():
            return False
        if f.exception() is not None:
            return True
        inner = f.result()
        return inner is None or inner.done()

    def wait(self, stream: Any = None) -> None:
        inner = self.future.result()
        if inner is not None:
            inner.wait(stream)


def record(device: torch.device, stream: Any = None) -> Completion:
    """A point on ``stream`` (default: the caller's current stream) after everything issued to
    it so far. On the CPU the host is the stream: already reached."""
    if device.type != "cuda":
        return DONE
    stream = torch.cuda.current_stream(device) if stream is None else stream
    ev = torch.cuda.Event()
    ev.record(stream)
    return EventCompletion(ev)


def current_stream(device: torch.device) -> Any:
    """The engine's stream to order against (``None`` on the CPU, where the host is it)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


_COPY_STREAMS: dict[int, Any] = {}


def copy_stream(device: torch.device) -> Any:
    """lmc's side stream for layer-wise copies on ``device`` (``None`` on the CPU), one per
    device and process, so copies overlap the engine's compute stream."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    s = _COPY_STREAMS.get(index)
    if s is None:
        s = _COPY_STREAMS[index] = torch.cuda.Stream(device=index)
    return s


def wait_all(handles: Iterable[Completion | None]) -> BaseException | None:
    """Block until every handle completes; the first error, if any (never raises)."""
    err = None
    for h in handles:
        if h is None:
            continue
        try:
            h.wait()
        except BaseException as e:  # noqa: BLE001 - reported to the caller, who decides
            err = err or e
    return err
