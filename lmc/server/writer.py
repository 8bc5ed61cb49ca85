"""Sending a response from several buffers (header, metadata, values in pool memory) with
``sendmsg`` scatter/gather: the values are never copied into one big bytes object, and the
caller knows exactly when the kernel has taken the last byte, so it can release them."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence

IOV_MAX = 512  # well under Linux's 1024


def _advance(bufs: list[memoryview], sent: int) -> list[memoryview]:
    """Drop ``sent`` bytes off the front of ``bufs``."""
    i = 0
    while i < len(bufs) and sent >= len(bufs[i]):
        sent -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if sent and rest:
        rest[0] = rest[0][sent:]
    return rest


async def _writable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    fut = loop.create_future()
    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_writer(fd, ready)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


async def send_buffers(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                       bufs: Sequence[bytes | memoryview],
                       on_progress: Callable[[], None] | None = None) -> int:
    """Send every byte of ``bufs`` in order on a non-blocking socket; returns bytes sent.
    ``on_progress`` is called whenever the kernel takes bytes (a stall watchdog's clock)."""
    views = [v for v in (memoryview(b).cast("B") for b in bufs) if v.nbytes]
    total = sum(len(v) for v in views)
    while views:
        try:
            n = sock.sendmsg(views[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock.fileno())
            continue
        views = _advance(views, n)
        if on_progress is not None:
            on_progress()
    return total
