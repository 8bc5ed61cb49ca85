"""The JSON side of lmc's two small HTTP servers (``lmc.reference.serve`` and ``lmc pd-proxy``).

Both speak HTTP/1.0 so that a streamed response ends when the connection closes (no chunked
encoding to write), log requests at DEBUG only (an operator sees one line per event that
matters, not one per request), and answer errors in the OpenAI shape clients already parse.
"""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler
from typing import Any

log = logging.getLogger("lmc.http")


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler with JSON answers and OpenAI-style errors."""

    protocol_version = "HTTP/1.0"  # a stream ends when the connection closes

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, msg: str) -> None:
        kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
        self._json(status, {"error": {"message": msg, "type": kind, "code": status}})
