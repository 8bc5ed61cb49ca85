"""A minimal OpenAI-compatible HTTP server for the reference engine (standard library only):
``python -m lmc.reference.serve --model DIR [--lmc-config FILE] [--kv-role ROLE]``.

Enough for ``lmc pd-proxy`` and ``lmc replay --target`` to drive the reference engine the
way they drive vLLM, not a production server:

* ``POST /v1/completions``: ``prompt`` is text (needs the checkpoint's ``tokenizer.json``)
  or a list of token ids; ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
  ``ignore_eos``, ``stream`` (server-sent events; ``stream_options.include_usage`` adds a
  final usage chunk), ``return_token_ids`` and ``kv_transfer_params`` (vLLM's field: passed
  to the KV connector; a producer's answer comes back in the response's
  ``kv_transfer_params``). ``usage.prompt_tokens_details.cached_tokens`` is the prompt
  tokens the connector supplied.
* ``GET /v1/models``, ``GET /health``, ``GET /lmc/stats`` (the connector's counters).

One thread owns the engine and steps it while requests are pending; HTTP threads hand it
requests and wait for tokens. A process whose lmc config has a P2P tier holds a NIXL
agent: it is closed on SIGTERM/SIGINT and the process ends with ``os._exit`` (NIXL's
exit-time crash, see :mod:`lmc.p2p.agent`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from lmc.http_json import JsonHandler

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with a message naming the field."""


@dataclass
class _Job:
    prompt: Any
    params: Any  # SamplingParams
    kv_transfer_params: dict | None
    on_token: Callable[[int], None] | None
    done: threading.Event = field(default_factory=threading.Event)
    output: Any = None  # RequestOutput
    error: str | None = None
    rid: str = ""
    sent: int = 0


class EngineLoop:
    """The engine's one thread: adds submitted requests, steps while any is pending,
    streams new tokens to their callbacks and completes finished jobs."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._inbox: queue.Queue[_Job | None] = queue.Queue()
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lmc-ref-engine", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> _Job:
        self._inbox.put(job)
        return job

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` between steps (stats read off the engine's thread)."""
        with self._lock:
            return fn()

    def _admit(self, job: _Job) -> None:
        try:
            job.rid = self.llm.add_request(job.prompt, job.params,
                                           kv_transfer_params=job.kv_transfer_params)
            self._jobs[job.rid] = job
        except ValueError as e:
            job.error = str(e)
            job.done.set()

    def _run(self) -> None:
        while True:
            try:
                job = self._inbox.get_nowait() if self._jobs else self._inbox.get()
            except queue.Empty:
                job = None
            else:
                if job is None:
                    return
                self._admit(job)
                continue  # take everything queued before stepping
            with self._lock:
                try:
                    finished = self.llm.step()
                except Exception as e:  # fail the pending jobs, keep serving
                    log.exception("engine step failed")
                    for j in self._jobs.values():
                        j.error = f"engine step failed: {type(e).__name__}: {e}"
                        j.done.set()
                    self._jobs.clear()
                    continue
                for rid, j in self._jobs.items():
                    req = self.llm.scheduler.requests.get(rid)
                    if req is not None and j.on_token is not None:
                        for t in req.output_token_ids[j.sent:]:
                            j.on_token(t)
                        j.sent = len(req.output_token_ids)
            for out in finished:
                j = self._jobs.pop(out.request_id, None)
                if j is None:
                    continue
                if j.on_token is not None:
                    for t in out.token_ids[j.sent:]:
                        j.on_token(t)
                j.output = out
                j.done.set()

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(30)


def _number(body: dict, key: str, default: Any, kind: type, lo: float | None = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
        raise BadRequest(f"{key} must be {'an integer' if kind is int else 'a number'}, "
                         f"got {v!r}")
    if lo is not None and v < lo:
        raise BadRequest(f"{key} must be >= {lo}, got {v!r}")
    return kind(v)


def parse_completion(body: Any) -> tuple[Any, dict[str, Any], dict | None]:
    """``(prompt, sampling keywords, kv_transfer_params)`` from a completions body."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool)
                                 for t in prompt):
            raise BadRequest("prompt must be a string or a non-empty list of token ids "
                             "(one prompt per request)")
    elif not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a string or a non-empty list of token ids")
    kw = {"max_tokens": _number(body, "max_tokens", 16, int, 1),
          "temperature": _number(body, "temperature", 0.0, float, 0),
          "top_p": _number(body, "top_p", 1.0, float),
          "seed": body.get("seed") if body.get("seed") is None
          else _number(body, "seed", 0, int),
          "ignore_eos": bool(body.get("ignore_eos", False))}
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise BadRequest(f"kv_transfer_params must be an object, got {kv!r}")
    return prompt, kw, kv


class Server:
    """The engine, its loop and the HTTP server (``port`` 0 picks a free one)."""

    def __init__(self, llm: Any, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "") -> None:
        self.llm = llm
        self.model_name = model_name or llm.model_dir.name
        self.loop = EngineLoop(llm)
        handler = type("Handler", (_Handler,), {"app": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def stats(self) -> dict[str, Any]:
        conn = self.llm.kv_connector
        if conn is None or not hasattr(conn, "stats"):
            return {}
        return self.loop.call(conn.stats)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.loop.close()
        self.llm.close()


class _Handler(JsonHandler):
    app: Server

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": self.app.model_name, "object": "model", "owned_by": "lmc"}]})
        elif self.path == "/lmc/stats":
            self._json(200, self.app.stats())
        else:
            self._error(404, f"no such path {self.path}")

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._error(404, f"no such path {self.path} (POST /v1/completions only)")
            return
        try:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"null")
            prompt, kw, kv = parse_completion(body)
            from lmc.reference.request import SamplingParams
            params = SamplingParams(**kw)
        except (BadRequest, ValueError) as e:
            self._error(400, str(e))
            return
        if body.get("stream"):
            self._stream(body, prompt, params, kv)
        else:
            self._complete(body, prompt, params, kv)

    def _text(self, tokens: list[int]) -> str:
        tok = self.app.llm.tokenizer
        return tok.decode(tokens) if tok is not None else ""

    def _usage(self, out: Any) -> dict[str, Any]:
        p, c = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def _head(self, body: dict) -> dict[str, Any]:
        return {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": body.get("model") or self.app.model_name}

    def _complete(self, body: dict, prompt: Any, params: Any, kv: dict | None) -> None:
        job = self.app.loop.submit(_Job(prompt, params, kv, None))
        job.done.wait()
        if job.error is not None:
            self._error(400 if job.output is None and "step" not in job.error else 500,
                        job.error)
            return
        out = job.output
        choice: dict[str, Any] = {"index": 0, "text": self._text(out.token_ids),
                                  "logprobs": None, "finish_reason": out.finish_reason}
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = out.token_ids
        self._json(200, {**self._head(body), "object": "text_completion", "choices": [choice],
                         "usage": self._usage(out),
                         "kv_transfer_params": out.kv_transfer_params})

    def _stream(self, body: dict, prompt: Any, params: Any, kv: dict | None) -> None:
        tokens: queue.Queue[int | None] = queue.Queue()
        job = self.app.loop.submit(_Job(prompt, params, kv, tokens.put))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        head = {**self._head(body), "object": "text_completion"}
        with_ids = bool(body.get("return_token_ids"))

        def send(obj: Any) -> None:
            self.wfile.write(b"data: " + (obj if isinstance(obj, bytes)
                                          else json.dumps(obj).encode()) + b"\n\n")
            self.wfile.flush()
        try:
            while not (job.done.is_set() and tokens.empty()):
                try:
                    t = tokens.get(timeout=0.05)
                except queue.Empty:
                    continue
                choice = {"index": 0, "text": self._text([t]), "logprobs": None,
                          "finish_reason": None}
                if with_ids:
                    choice["token_ids"] = [t]
                send({**head, "choices": [choice]})
            if job.error is not None:
                send({"error": {"message": job.error, "code": 500}})
            else:
                out = job.output
                send({**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                           "finish_reason": out.finish_reason}],
                      "kv_transfer_params": out.kv_transfer_params})
                if (body.get("stream_options") or {}).get("include_usage"):
                    send({**head, "choices": [], "usage": self._usage(out)})
            send(b"[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            log.info("client went away mid-stream; request %s runs to its end", job.rid)


def build_llm(args: argparse.Namespace) -> Any:
    from lmc.reference import LLM
    connector = None
    if args.lmc_config or args.kv_role != "kv_both":
        from lmc.connectors.reference import LMCReferenceConnector
        connector = LMCReferenceConnector(args.lmc_config, model_dir=args.model,
                                          kv_role=args.kv_role,
                                          remote_prefill_wait=args.remote_prefill_wait,
                                          engine_id=args.engine_id)
    return LLM(args.model, dtype=args.dtype, num_blocks=args.num_blocks,
               max_num_batched_tokens=args.max_num_batched_tokens, kv_connector=connector)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmc.reference.serve",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: pick a free port")
    p.add_argument("--lmc-config", metavar="FILE", help="lmc YAML config (no lmc without it, "
                   "unless --kv-role is given: then LMC_* variables and defaults)")
    p.add_argument("--kv-role", default="kv_both",
                   choices=("kv_both", "kv_producer", "kv_consumer"))
    p.add_argument("--remote-prefill-wait", type=float, default=30.0, metavar="SECONDS",
                   help="kv_consumer: how long a request waits for a producer's chunks")
    p.add_argument("--engine-id", default="", help="this instance's name in a producer's "
                   "kv_transfer_params")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--ready-file", metavar="FILE", help="write {url, port, pid} here once "
                   "serving")
    args = p.parse_args(argv)
    if not Path(args.model).is_dir():
        print(f"lmc.reference.serve: --model {args.model}: not a directory", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = Server(build_llm(args), args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    info = {"url": server.url, "port": server.port, "pid": os.getpid()}
    if args.ready_file:
        tmp = Path(args.ready_file + ".tmp")
        tmp.write_text(json.dumps(info))
        tmp.rename(args.ready_file)
    print(f"serving {server.model_name} at {server.url}", flush=True)
    stop.wait()
    server.close()  # closes the engine (and a NIXL agent) before the hard exit
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
