"""Relaying an OpenAI-compatible request to an engine instance and its answer back: the part
``lmc pd-proxy`` and ``lmc router`` share (standard library only).

One job: talk to an upstream instance and hand what it says to the client, bounded.

* :class:`Upstream` posts a JSON body to ``http://host:port`` (``--upstream-timeout`` per
  read) and GETs small answers (``/v1/models``) within 30 s.
* :func:`read_bounded` reads an answer the proxy keeps (a producer's parameters, a refusal)
  at most ``--max-body`` bytes; more, or less than its ``Content-Length`` promised, is a 502
  naming the instance.
* :class:`RelayHandler` reads the client's request (only ``/v1/completions`` and
  ``/v1/chat/completions``, a JSON object), relays a GET, and relays an answer: a refusal
  (not 200) bounded and whole, a 200 streamed through as it comes (``read1``, so each
  server-sent event reaches the client when the instance sends it), with only
  ``Content-Type``, ``Cache-Control`` and ``Content-Length`` copied and only if printable.
  An answer whose status is no HTTP status is a 502 naming the instance; one cut short
  mid-stream reaches the client as cut (nothing else can be said once headers went).

Which instance gets a request is not decided here (:mod:`lmc.router.dispatch`). Threat
models: docs/threats/http.md, docs/threats/router.md.
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.parse
from typing import Any

from lmc.bounded_io import read_at_most
from lmc.http.json_api import HttpError, JsonHandler

log = logging.getLogger(__name__)
TIMEOUT = 600.0  # default --upstream-timeout: seconds an instance may take per read
GET_TIMEOUT = 30.0
UPSTREAM_ERRORS = (OSError, http.client.HTTPException)  # refused, reset, timed out, garbled
POST_PATHS = ("/v1/completions", "/v1/chat/completions")
RELAYED_HEADERS = ("Content-Type", "Cache-Control", "Content-Length")


class Upstream:
    """One instance: ``http://host:port``."""

    def __init__(self, url: str, timeout: float = TIMEOUT) -> None:
        u = urllib.parse.urlsplit(url)
        try:
            port = u.port
        except ValueError:  # a port that is no number, or out of range
            port = None
        if u.scheme != "http" or not u.hostname or not port:
            raise ValueError(f"{url!r}: expected http://host:port")
        self.url, self.host, self.port = url.rstrip("/"), u.hostname, port
        self.timeout = timeout

    def post(self, path: str, data: bytes, headers: dict[str, str] | None = None,
             timeout: float | None = None
             ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a JSON body; the caller closes the connection."""
        conn = http.client.HTTPConnection(self.host, self.port,
                                          timeout=self.timeout if timeout is None else timeout)
        try:
            conn.request("POST", path, data, {"Content-Type": "application/json",
                                              "Content-Length": str(len(data)),
                                              **(headers or {})})
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def get(self, path: str, limit: int) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=GET_TIMEOUT)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, read_bounded(r, limit, self.url)
        finally:
            conn.close()


def read_bounded(r: http.client.HTTPResponse, limit: int, url: str) -> bytes:
    """An upstream answer's body, refused (502) past ``limit`` bytes; read in pieces, so an
    answer holds what arrived, never the limit reserved up front."""
    data = read_at_most(r, limit)
    if len(data) > limit:
        raise HttpError(502, f"{url} answered more than {limit} bytes")
    if r.length:  # its Content-Length promised more than came before it hung up
        raise HttpError(502, f"{url} answer cut short: {len(data)} bytes, {r.length} missing")
    return data


def encode(body: dict[str, Any]) -> bytes:
    try:
        return json.dumps(body).encode()
    except RecursionError:
        raise HttpError(400, "request body nested too deeply") from None


def what(e: BaseException) -> str:
    """An upstream failure in a few words (its type names refused, reset, timed out...)."""
    return f"{type(e).__name__}: {str(e)[:200]}"


class RelayHandler(JsonHandler):
    """A :class:`JsonHandler` that forwards to instances (see the module docstring)."""

    def request_body(self) -> dict[str, Any] | None:
        """The client's completion request, or None once its mistake was answered (404 for
        another path, 4xx for a body that is no JSON object)."""
        if self.path not in POST_PATHS:
            self.answer_error(404, f"no such path {self.path[:200]}")
            return None
        try:
            body = self.read_json()
            if not isinstance(body, dict):
                raise HttpError(400, "bad request body: the body must be a JSON object")
        except HttpError as e:
            self.answer_error(e.status, str(e))
            return None
        return body

    def relay_get(self, up: Upstream, who: str) -> None:
        """``GET self.path`` of ``up`` (named ``who``: "decode instance", "instance"), its
        answer relayed whole, bounded by ``--max-body``."""
        try:
            status, data = up.get(self.path, self.server.limits.max_body)
        except HttpError as e:
            self.answer_error(e.status, f"{who} {up.url}: {e}")
            return
        except UPSTREAM_ERRORS as e:
            self.answer_error(502, f"{who} {up.url}: {what(e)}")
            return
        self.relay_bytes(status if 100 <= status < 600 else 502, data)

    def relay_answer(self, resp: http.client.HTTPResponse, who: str,
                     tail_bytes: int = 0) -> bytes | None:
        """Relay ``resp`` (from ``who``, e.g. "instance http://...") to the client: see the
        module docstring. Returns the answer's last ``tail_bytes`` bytes (to read its
        usage), or None if the instance's status was no HTTP status (a 502 went instead).
        Never raises for the instance's or the client's failures."""
        try:
            if not 100 <= resp.status < 600:
                self.answer_error(502, f"{who} answered status {resp.status}")
                return None
            if resp.status != 200:  # a refusal: bounded, relayed as is
                answer = read_bounded(resp, self.server.limits.max_body, who)
                self.relay_bytes(resp.status, answer, resp.getheader("Content-Type"))
                return b""
            self.send_response(resp.status)
            for h in RELAYED_HEADERS:
                v = resp.getheader(h)
                if v and v.isprintable():
                    self.send_header(h, v)
            self.end_headers()
            tail = bytearray()
            while chunk := resp.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
                if tail_bytes:
                    tail += chunk
                    if len(tail) > tail_bytes:
                        del tail[:-tail_bytes]
            return bytes(tail)
        except HttpError as e:
            self.answer_error(e.status, str(e))
        except UPSTREAM_ERRORS as e:  # either side went away mid-answer: nothing to add
            log.debug("answer from %s cut short: %s", who, what(e))
        return b""

    def relay_bytes(self, status: int, data: bytes, ctype: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype if ctype and ctype.isprintable()
                         else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
