"""``lmc pd-proxy``: prefill on one instance, decode on another, behind one OpenAI-style
``/v1/completions`` endpoint (standard library only).

For each request: the prefill instance (a ``kv_producer``) gets the same body with
``max_tokens: 1``, no streaming and ``kv_transfer_params: {"do_remote_decode": true}``; it
computes the prompt's KV (lmc saves and exports it) and answers ``kv_transfer_params`` for
the decode side. The decode instance (a ``kv_consumer``) then gets the client's original
body plus those parameters; it pulls the prompt's KV from the producer over NIXL and
generates. Its answer (streamed or not) goes back to the client as it comes.

Instances are vLLM (``--kv-transfer-config`` with ``LMCConnector`` and a ``kv_role``) or
the reference engine's server (``python -m lmc.reference.serve --kv-role ...``), the same
API either way. Several ``--prefill``/``--decode`` URLs are used in turn (round robin).
This is the flow, enough to run and test disaggregated serving; not a router (no load
awareness, retries or health checks).

Client connections, request time and size are bounded as in :mod:`lmc.http.json_api`
(``--max-connections``, ``--read-timeout``, ``--max-body``); an instance's answer is read
within ``--upstream-timeout`` per read and at most ``--max-body`` bytes (the producer's;
the consumer's is streamed through). A producer that answers garbage (not JSON, not an
object, ``kv_transfer_params`` not an object) or nothing is a 502 naming it. Threat model:
docs/threats/http.md.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import signal
import sys
import threading
import urllib.parse
from typing import Any

from lmc.http.json_api import (
    BoundedHTTPServer,
    HttpError,
    HttpLimits,
    JsonHandler,
    RateLimitedWarnings,
    add_limit_args,
    limits_from_args,
    listen_error,
)

log = logging.getLogger(__name__)
_warn = RateLimitedWarnings(limit=10, window=10.0, logger=log)
TIMEOUT = 600.0  # default --upstream-timeout: seconds an instance may take per read
UPSTREAM_ERRORS = (OSError, http.client.HTTPException)  # refused, reset, timed out, garbled


class Upstream:
    """One instance: ``http://host:port``."""

    def __init__(self, url: str, timeout: float = TIMEOUT) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"{url!r}: expected http://host:port")
        self.url, self.host, self.port = url.rstrip("/"), u.hostname, u.port
        self.timeout = timeout

    def post(self, path: str, data: bytes) -> tuple[http.client.HTTPConnection,
                                                    http.client.HTTPResponse]:
        """Send a JSON body; the caller closes the connection."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", path, data, {"Content-Type": "application/json",
                                              "Content-Length": str(len(data))})
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def get(self, path: str, limit: int) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, read_bounded(r, limit, self.url)
        finally:
            conn.close()


def read_bounded(r: http.client.HTTPResponse, limit: int, url: str) -> bytes:
    """An upstream answer's body, refused (502) past ``limit`` bytes."""
    data = r.read(limit + 1)
    if len(data) > limit:
        raise HttpError(502, f"{url} answered more than {limit} bytes")
    if r.length:  # its Content-Length promised more than came before it hung up
        raise HttpError(502, f"{url} answer cut short: {len(data)} bytes, {r.length} missing")
    return data


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The producer's request: one token, no stream, asked to prefill for a consumer."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


def producer_params(status: int, data: bytes, url: str) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` in a prefill instance's 200 answer (None: it is no
    producer). Anything else than a JSON object whose ``kv_transfer_params`` is an object
    or null is the instance's fault: a 502 naming it."""
    try:
        answer = json.loads(data)
    except (ValueError, RecursionError):
        raise HttpError(502, f"prefill instance {url} answered {status} with a body that is "
                        f"not JSON ({len(data)} bytes)") from None
    if not isinstance(answer, dict):
        raise HttpError(502, f"prefill instance {url} answered {status} with a JSON "
                        f"{type(answer).__name__}, not an object")
    params = answer.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise HttpError(502, f"prefill instance {url} answered kv_transfer_params of type "
                        f"{type(params).__name__}, not an object")
    return params


def encode(body: dict[str, Any]) -> bytes:
    try:
        return json.dumps(body).encode()
    except RecursionError:
        raise HttpError(400, "request body nested too deeply") from None


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], host: str = "127.0.0.1",
                 port: int = 0, limits: HttpLimits | None = None,
                 upstream_timeout: float = TIMEOUT) -> None:
        if not prefill or not decode:
            raise ValueError("pd-proxy needs at least one --prefill and one --decode URL")
        if not 0 < upstream_timeout <= 86400:
            raise ValueError(f"upstream timeout must be in (0, 86400] seconds, got "
                             f"{upstream_timeout}")
        self.prefill = [Upstream(u, upstream_timeout) for u in prefill]
        self.decode = [Upstream(u, upstream_timeout) for u in decode]
        self._next_p = itertools.cycle(self.prefill)
        self._next_d = itertools.cycle(self.decode)
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "prefill_failures": 0, "decode_failures": 0}
        handler = type("Handler", (_Handler,), {"proxy": self})
        # each client connection opens one upstream connection at a time
        self.httpd = BoundedHTTPServer((host, port), handler, limits or HttpLimits(),
                                       fds_per_connection=2)
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"

    def pick(self) -> tuple[Upstream, Upstream]:
        with self._lock:
            self.counts["requests"] += 1
            return next(self._next_p), next(self._next_d)

    def count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.close_all()
        self.httpd.server_close()


class _Handler(JsonHandler):
    proxy: Proxy

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/lmc/pd-proxy":
            self._json(200, {**self.proxy.counts,
                             "prefill": [u.url for u in self.proxy.prefill],
                             "decode": [u.url for u in self.proxy.decode]})
        elif self.path == "/v1/models":
            up = self.proxy.decode[0]
            try:
                status, data = up.get(self.path, self.server.limits.max_body)
            except HttpError as e:
                self._error(e.status, f"decode instance: {e}")
                return
            except UPSTREAM_ERRORS as e:
                self._error(502, f"decode instance {up.url}: {_what(e)}")
                return
            self._relay_bytes(status if 100 <= status < 600 else 502, None, data)
        else:
            self._error(404, f"no such path {self.path[:200]}")

    def do_POST(self) -> None:
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, f"no such path {self.path[:200]}")
            return
        try:
            body = self.read_json()
            if not isinstance(body, dict):
                raise HttpError(400, "bad request body: the body must be a JSON object")
            p_data = encode(prefill_body(body))
        except HttpError as e:
            self._error(e.status, str(e))
            return
        prefill, decode = self.proxy.pick()
        try:
            params = self._prefill(prefill, p_data)
        except HttpError as e:
            self.proxy.count("prefill_failures")
            self._error(e.status, str(e))
            return
        if params is _RELAYED:
            return
        if not params:
            _warn("prefill instance %s answered no kv_transfer_params (not a kv_producer?): "
                  "the decode instance prefills itself", prefill.url)
        self._decode(decode, encode({**body, "kv_transfer_params": params}))

    def _prefill(self, up: Upstream, data: bytes) -> Any:
        """The producer's parameters, or ``_RELAYED`` once its refusal went to the client."""
        limit = self.server.limits.max_body
        try:
            conn, r = up.post(self.path, data)
        except UPSTREAM_ERRORS as e:
            raise HttpError(502, f"prefill instance {up.url}: {_what(e)}") from None
        try:
            answer = read_bounded(r, limit, f"prefill instance {up.url}")
            if r.status != 200:  # the client sees the producer's refusal (a bad prompt, ...)
                if not 400 <= r.status < 600:
                    raise HttpError(502, f"prefill instance {up.url} answered status "
                                    f"{r.status}")
                self.proxy.count("prefill_failures")
                self._relay_bytes(r.status, r.getheader("Content-Type"), answer)
                return _RELAYED
            return producer_params(r.status, answer, up.url)
        except UPSTREAM_ERRORS as e:
            raise HttpError(502, f"prefill instance {up.url}: {_what(e)}") from None
        finally:
            conn.close()

    def _decode(self, up: Upstream, data: bytes) -> None:
        """Relay the consumer's answer as it comes (streamed or not)."""
        try:
            conn, r = up.post(self.path, data)
        except UPSTREAM_ERRORS as e:
            self.proxy.count("decode_failures")
            self._error(502, f"decode instance {up.url}: {_what(e)}")
            return
        try:
            if not 100 <= r.status < 600:
                self.proxy.count("decode_failures")
                self._error(502, f"decode instance {up.url} answered status {r.status}")
                return
            self.send_response(r.status)
            for h in ("Content-Type", "Cache-Control", "Content-Length"):
                v = r.getheader(h)
                if v and v.isprintable():
                    self.send_header(h, v)
            self.end_headers()
            while chunk := r.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
        except UPSTREAM_ERRORS as e:  # either side went away mid-answer: nothing to add
            log.debug("decode answer from %s cut short: %s", up.url, _what(e))
        finally:
            conn.close()

    def _relay_bytes(self, status: int, ctype: str | None, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype if ctype and ctype.isprintable()
                         else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


_RELAYED = object()


def _what(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"


def register_cli(sub: Any) -> None:
    from lmc.cli import add_command, float_in, int_in
    p = add_command(sub, "pd-proxy", "prefill on a kv_producer, decode on a kv_consumer, "
                    "behind one /v1/completions", __doc__)
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a kv_producer instance (http://host:port); repeat for several")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a kv_consumer instance (http://host:port); repeat for several")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_in(0, 65535), default=8100, help="0: pick a free port")
    p.add_argument("--upstream-timeout", type=float_in(0, 86400, low_open=True), default=TIMEOUT, metavar="SECONDS",
                   help="how long an instance may take to answer (per read)")
    add_limit_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:  # the access log and warnings, one line each
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        proxy = Proxy(args.prefill, args.decode, args.host, args.port,
                      limits_from_args(args), args.upstream_timeout)
    except OSError as e:
        print(f"lmc pd-proxy: {listen_error(e, args.host, args.port)}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"lmc pd-proxy: {e}", file=sys.stderr)
        return 2
    proxy.httpd.access_log = getattr(args, "access_log", True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=proxy.serve_forever, name="http", daemon=True).start()
    print(f"pd-proxy at {proxy.url}: prefill {', '.join(u.url for u in proxy.prefill)}; "
          f"decode {', '.join(u.url for u in proxy.decode)}", flush=True)
    stop.wait()
    proxy.close()
    return 0
