"""``/metrics`` (Prometheus text format) and ``/healthz`` over HTTP on their own port.

A minimal HTTP/1.0 responder on the daemon's loop: one bounded request line and headers,
one response, close. A separate port keeps scrapers and probes off the data protocol, and
no authentication token is needed to read figures that carry no KV data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

if TYPE_CHECKING:
    from lmc.server.daemon import Daemon

log = logging.getLogger(__name__)
MAX_LINE = 8192
MAX_HEADERS = 64
TIMEOUT = 5.0        # for the whole exchange, not per line: trickled headers cannot hold it
MAX_CLIENTS = 32     # scrapers and probes; more at once are closed unanswered


class MetricsHTTP:
    def __init__(self, daemon: Daemon, host: str, port: int,
                 sock: socket.socket | None = None) -> None:
        self.daemon = daemon
        self.host = host
        self.want_port = port
        self.sock = sock  # bound already (the daemon binds every port before its pre-fault)
        self.server: asyncio.base_events.Server | None = None
        self.active = 0

    @property
    def port(self) -> int | None:
        if self.server is None or not self.server.sockets:
            return None
        return self.server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        if self.sock is not None:
            self.server = await asyncio.start_server(self._handle, sock=self.sock,
                                                     limit=MAX_LINE)
        else:
            self.server = await asyncio.start_server(self._handle, self.host, self.want_port,
                                                     limit=MAX_LINE)
            log.info("metrics on http://%s:%s/metrics", self.host, self.port)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)

    def _route(self, path: str) -> tuple[str, str, bytes]:
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(REGISTRY)
        if path == "/healthz":
            if self.daemon.draining:
                return "503 Service Unavailable", "text/plain", b"draining\n"
            return "200 OK", "text/plain", b"ok\n"
        return "404 Not Found", "text/plain", b"not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.active >= MAX_CLIENTS:
            writer.close()
            return
        self.active += 1
        try:
            await asyncio.wait_for(self._exchange(reader, writer), TIMEOUT)
        except (asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError, OSError):
            pass
        finally:
            self.active -= 1
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                        ) -> None:
        line = await reader.readline()
        for _ in range(MAX_HEADERS):  # drain the headers, bounded
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
        parts = line.decode("latin-1").split()
        if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
            status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
        else:
            status, ctype, body = self._route(parts[1])
        head = (f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        writer.write(head if parts and parts[0] == "HEAD" else head + body)
        await writer.drain()
