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
from http.server import ThreadingHTTPServer
from typing import Any

from lmc.http_json import JsonHandler

log = logging.getLogger(__name__)
TIMEOUT = 600.0


class Upstream:
    """One instance: ``http://host:port``."""

    def __init__(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"{url!r}: expected http://host:port")
        self.url, self.host, self.port = url.rstrip("/"), u.hostname, u.port

    def post(self, path: str, body: dict[str, Any]) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)
        data = json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json",
                                          "Content-Length": str(len(data))})
        return conn.getresponse()

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The producer's request: one token, no stream, asked to prefill for a consumer."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], host: str = "127.0.0.1",
                 port: int = 0) -> None:
        if not prefill or not decode:
            raise ValueError("pd-proxy needs at least one --prefill and one --decode URL")
        self.prefill = [Upstream(u) for u in prefill]
        self.decode = [Upstream(u) for u in decode]
        self._next_p = itertools.cycle(self.prefill)
        self._next_d = itertools.cycle(self.decode)
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "prefill_failures": 0, "decode_failures": 0}
        handler = type("Handler", (_Handler,), {"proxy": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
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
            try:
                status, data = self.proxy.decode[0].get(self.path)
            except OSError as e:
                self._error(502, f"decode instance: {e}")
                return
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._error(404, f"no such path {self.path}")

    def do_POST(self) -> None:
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, f"no such path {self.path}")
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            self._error(400, f"bad request body: {e}")
            return
        prefill, decode = self.proxy.pick()
        try:
            r = prefill.post(self.path, prefill_body(body))
            answer = r.read()
        except OSError as e:
            self.proxy.count("prefill_failures")
            self._error(502, f"prefill instance {prefill.url}: {e}")
            return
        if r.status != 200:  # the client sees the producer's refusal (a bad prompt, ...)
            self.proxy.count("prefill_failures")
            self._relay_bytes(r.status, r.getheader("Content-Type"), answer)
            return
        try:
            params = json.loads(answer).get("kv_transfer_params")
        except ValueError:
            params = None
        if not params:
            log.warning("prefill instance %s answered no kv_transfer_params (not a "
                        "kv_producer?): the decode instance prefills itself", prefill.url)
        d_body = dict(body)
        d_body["kv_transfer_params"] = params
        try:
            r = decode.post(self.path, d_body)
        except OSError as e:
            self.proxy.count("decode_failures")
            self._error(502, f"decode instance {decode.url}: {e}")
            return
        self.send_response(r.status)
        for h in ("Content-Type", "Cache-Control"):
            if r.getheader(h):
                self.send_header(h, r.getheader(h))
        if r.getheader("Content-Length"):
            self.send_header("Content-Length", r.getheader("Content-Length"))
        self.end_headers()
        try:
            while chunk := r.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            log.info("client went away mid-response")
        finally:
            r.close()

    def _relay_bytes(self, status: int, ctype: str | None, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype or "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def register_cli(sub: Any) -> None:
    from lmc.cli import add_command
    p = add_command(sub, "pd-proxy", "prefill on a kv_producer, decode on a kv_consumer, "
                    "behind one /v1/completions", __doc__)
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a kv_producer instance (http://host:port); repeat for several")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a kv_consumer instance (http://host:port); repeat for several")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0: pick a free port")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        proxy = Proxy(args.prefill, args.decode, args.host, args.port)
    except (ValueError, OSError) as e:
        print(f"lmc pd-proxy: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=proxy.serve_forever, name="http", daemon=True).start()
    print(f"pd-proxy at {proxy.url}: prefill {', '.join(u.url for u in proxy.prefill)}; "
          f"decode {', '.join(u.url for u in proxy.decode)}", flush=True)
    stop.wait()
    proxy.close()
    return 0
