"""The JSON side of lmc's two small HTTP servers (``lmc.reference.serve`` and ``lmc pd-proxy``),
and the bounds that keep one client from taking them down (threat model: docs/threats/http.md).

Both speak HTTP/1.0 so that a streamed response ends when the connection closes (no chunked
encoding to write), log one INFO line per request once it is answered (an access log, as
``vllm serve``'s: client, request line, status, duration; ``--no-access-log`` turns it off),
and answer errors in the OpenAI shape clients already parse.

Bounds (:class:`HttpLimits`, each a command-line flag of both servers):

* ``max_connections`` (256): open client connections, lowered to what ``RLIMIT_NOFILE``
  allows after the descriptors already open and a reserve of :data:`FD_RESERVE` (model
  files, upstream sockets, NIXL). At the cap, a newcomer displaces the oldest connection
  that has not finished sending its request (a slow or half-open client), else it is
  answered 503 at once and closed: a flood of silent sockets cannot lock everyone out.
* ``read_timeout`` (30 s): for the request line, headers and body together, not per read
  (a byte trickled every few seconds cannot hold a connection), and for each write after.
* ``max_body`` (8 MiB): a larger ``Content-Length`` is answered 413 before any of the body
  is read; a missing one is 411, a negative or non-numeric one 400.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import resource
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lmc import units
from lmc.ratelog import RateLimitedWarnings  # also imported from here by both servers

log = logging.getLogger("lmc.http")
access_log = logging.getLogger("lmc.http.access")
QUIET_PATHS = frozenset({"/health", "/healthz", "/metrics"})
"""Paths whose GETs are logged at DEBUG (probes and scrapes), not INFO."""
FD_RESERVE = 64  # descriptors kept free of client connections for files and upstreams
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\n\r\n"
         b'{"error": {"message": "too many connections; try again", '
         b'"type": "server_error", "code": 503}}')


_warn = RateLimitedWarnings(limit=10, window=10.0, logger=log)


class HttpError(Exception):
    """An answer the handler gives instead of going on: status and message."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.status = status


@dataclass(frozen=True)
class HttpLimits:
    """What one client may hold: see the module docstring."""

    max_connections: int = 256
    read_timeout: float = 30.0
    max_body: int = 8 << 20

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if not 0 < self.read_timeout <= 86400:
            raise ValueError(f"read_timeout must be in (0, 86400] seconds, got "
                             f"{self.read_timeout}")
        if self.max_body < 1:
            raise ValueError(f"max_body must be >= 1, got {self.max_body}")


def add_limit_args(p: Any) -> None:
    """The :class:`HttpLimits` flags, shared by both servers' command lines."""
    from lmc.cli_args import float_in, int_in
    d = HttpLimits()
    p.add_argument("--max-connections", type=int_in(1, 1 << 20), default=d.max_connections, metavar="N",
                   help="open client connections (lowered to fit RLIMIT_NOFILE); at the cap "
                   "the oldest still sending its request is dropped, else 503")
    p.add_argument("--read-timeout", type=float_in(0, 86400, low_open=True), default=d.read_timeout, metavar="SECONDS",
                   help="to receive a whole request (line, headers, body), and per write")
    p.add_argument("--max-body", type=int_in(1, 1 << 40), default=d.max_body, metavar="BYTES",
                   help="largest request body (413 beyond)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no INFO line per request")


def listen_error(e: OSError, host: str, port: int, flag: str = "--port") -> str:
    """A failed bind, for a person: the address, why, and what to change."""
    why = {errno.EADDRINUSE: "the address is already in use (another server listens there)",
           errno.EADDRNOTAVAIL: "the address is not one of this host's",
           errno.EACCES: "permission denied (ports below 1024 need privileges)"}.get(
        e.errno or 0, e.strerror or str(e))
    hint = (f"; pick another {flag} (0: a free one)"
            if e.errno in (errno.EADDRINUSE, errno.EACCES) else "")
    return f"cannot listen on {host}:{port}: {why}{hint}"


def printable(text: str, limit: int = 200) -> str:
    """A client's request line in a log line: control characters escaped, cut short."""
    text = text[:limit]
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def limits_from_args(args: Any) -> HttpLimits:
    return HttpLimits(args.max_connections, args.read_timeout, args.max_body)


def open_fds() -> int:
    """Descriptors open in this process now (0 where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_cap(wanted: int, fds_per_connection: int = 1) -> int:
    """``wanted``, lowered so connections (and what each opens upstream) leave
    :data:`FD_RESERVE` descriptors free under the soft ``RLIMIT_NOFILE``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = (soft - open_fds() - FD_RESERVE) // fds_per_connection
    return max(1, min(wanted, room))


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, all due by one deadline: each ``recv`` waits only for what is left."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received within read_timeout")
        self.sock.settimeout(left)
        return self.sock.recv_into(b)


@dataclass
class _Conn:
    accepted_at: float
    reading: bool = True   # still receiving its request
    dropped: bool = False  # displaced by a newcomer; closing


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``cap`` of them (see the module docstring)."""

    daemon_threads = True
    access_log = True  # one INFO line per request answered (lmc.http.access; probes DEBUG)
    block_on_close = False  # a stuck client must not hold close()
    request_queue_size = 128  # a burst waits in the backlog, not in SYN retries

    def __init__(self, addr: tuple[str, int], handler: type, limits: HttpLimits,
                 fds_per_connection: int = 1) -> None:
        super().__init__(addr, handler)
        self.limits = limits
        self.cap = connection_cap(limits.max_connections, fds_per_connection)
        if self.cap < limits.max_connections:
            log.info("max_connections %d lowered to %d (RLIMIT_NOFILE)",
                     limits.max_connections, self.cap)
        self.conns: dict[socket.socket, _Conn] = {}
        self._cond = threading.Condition()
        self.refused = 0
        self.displaced = 0

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Admit a newcomer if a slot is free or can be freed from a slow sender."""
        with self._cond:
            if len(self.conns) >= self.cap and self._displace_oldest_reader():
                self._cond.wait_for(lambda: len(self.conns) < self.cap, timeout=0.2)
            if len(self.conns) < self.cap:
                self.conns[request] = _Conn(time.monotonic())
                return True
            self.refused += 1
        _warn("http: %d connections open (the cap); refusing %s", self.cap, client_address[0])
        try:
            request.setblocking(False)
            request.send(_BUSY)
        except OSError:
            pass
        return False

    def _displace_oldest_reader(self) -> bool:
        readers = [(c.accepted_at, s) for s, c in self.conns.items()
                   if c.reading and not c.dropped]
        if not readers:
            return False
        _, sock = min(readers, key=lambda r: r[0])
        self.conns[sock].dropped = True
        self.displaced += 1
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes its thread's read
        return True

    def request_read(self, sock: socket.socket) -> None:
        """The connection's request is in: it may no longer be displaced."""
        with self._cond:
            c = self.conns.get(sock)
            if c is not None:
                c.reading = False

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._cond:
                self.conns.pop(request, None)
                self._cond.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One bounded line, not the standard library's traceback on stderr."""
        e = sys.exc_info()[1]
        _warn("http: request from %s failed: %s: %s", client_address[0],
              type(e).__name__, str(e)[:200])

    def close_all(self) -> None:
        """Wake every connection's thread (used on close)."""
        with self._cond:
            for s in list(self.conns):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler with JSON answers, OpenAI-style errors and bounded request reads."""

    protocol_version = "HTTP/1.0"  # a stream ends when the connection closes
    server: BoundedHTTPServer

    def setup(self) -> None:
        super().setup()
        limits = self.server.limits
        deadline = time.monotonic() + limits.read_timeout
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline), 65536)

    def handle_one_request(self) -> None:
        """The standard one, with a last answer for whatever a handler did not expect (so
        the client gets a 500 naming it, not a closed connection), then the access line."""
        t0 = time.monotonic()
        self._status: int | None = None
        try:
            self._handle_one()
        finally:
            if self._status is not None and getattr(self.server, "access_log", True):
                # a health check or a scrape is routine: the fronts probe every instance's
                # /health every 2 s, which at INFO buried the requests (a change of health
                # is the server's own line, and the front's)
                routine = (getattr(self, "command", "") == "GET"
                           and getattr(self, "path", "") in QUIET_PATHS)
                access_log.log(logging.DEBUG if routine else logging.INFO,
                               '%s - "%s" %d %s', self.address_string(),
                               printable(getattr(self, "requestline", "") or "-"),
                               self._status, units.seconds(time.monotonic() - t0))

    def address_string(self) -> str:
        host, port = self.client_address[:2]
        return f"{host}:{port}"

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Called by ``send_response``: the status goes in the access line at the end."""
        with contextlib.suppress(TypeError, ValueError):
            self._status = int(getattr(code, "value", code))

    def _handle_one(self) -> None:
        try:
            super().handle_one_request()
        except OSError as e:  # the client went away, or timed out
            self.close_connection = True
            log.debug("%s: %s: %s", self.address_string(), type(e).__name__, e)
        except Exception as e:
            self.close_connection = True
            _warn("http: %s %s failed: %s: %s", getattr(self, "command", "?"),
                  getattr(self, "path", "?")[:100], type(e).__name__, str(e)[:200])
            if not getattr(self, "_answered", False):
                with contextlib.suppress(OSError):
                    self.answer_error(500, f"internal error: {type(e).__name__}")

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def read_json(self) -> Any:
        """The request body, parsed: bounded by ``max_body``, the read deadline and
        the parser's recursion limit (a deeply nested body is a 400). Raises :class:`HttpError` naming what was wrong."""
        raw = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "Transfer-Encoding is not supported; send Content-Length")
        if raw is None:
            raise HttpError(411, "Content-Length required")
        raw = raw.strip()
        if not raw.isascii() or not raw.isdigit():
            raise HttpError(400, f"Content-Length must be a non-negative integer, got "
                            f"{raw[:40]!r}")
        n = int(raw) if len(raw) <= 18 else 1 << 62
        if n > self.server.limits.max_body:
            raise HttpError(413, f"Content-Length {raw[:40]} is over the limit of "
                            f"{self.server.limits.max_body} bytes (--max-body)")
        try:
            data = self.rfile.read(n)
        except TimeoutError:
            raise HttpError(408, "request body not received within read_timeout") from None
        if len(data) < n:
            raise HttpError(400, f"request body ended after {len(data)} of {n} bytes")
        self._request_in()
        try:
            return json.loads(data or b"null")
        except RecursionError:
            raise HttpError(400, "request body nested too deeply") from None
        except ValueError as e:
            raise HttpError(400, f"request body is not JSON: {e}") from None

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok and self.command != "POST":
            self._request_in()  # no body to wait for
        return ok

    def _request_in(self) -> None:
        """The request is received: no longer displaceable; writes time out per call."""
        self.server.request_read(self.connection)
        self.connection.settimeout(self.server.limits.read_timeout)

    def end_headers(self) -> None:
        self._answered = True
        super().end_headers()

    def answer_json(self, status: int, obj: Any) -> None:
        """Answer ``obj`` as JSON with ``status`` (public: the fronts' parts answer through it,
        e.g. the router's admin)."""
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def answer_error(self, status: int, msg: str) -> None:
        """Answer an OpenAI-style error body naming ``msg``."""
        kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
        self.answer_json(status, {"error": {"message": msg, "type": kind, "code": status}})
