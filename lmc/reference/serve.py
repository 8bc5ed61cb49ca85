"""A minimal OpenAI-compatible HTTP server for the reference engine (standard library only):
``python -m lmc.reference.serve --model DIR [--lmc-config FILE] [--kv-role ROLE]``.

Enough for ``lmc pd-proxy`` and ``lmc replay --target`` to drive the reference engine the
way they drive vLLM, not a production server:

* ``POST /v1/chat/completions``: ``messages`` (system, user and assistant turns), rendered
  by the checkpoint's chat template (``tokenizer_config.json``; ``LLM.encode_chat``); the
  answer ends with the assistant's turn (the checkpoint's EOS, e.g. ``<|im_end|>``). The
  same sampling fields, streaming (``chat.completion.chunk`` deltas) and usage as below;
  ``max_completion_tokens`` or ``max_tokens``.
* ``POST /v1/completions``: ``prompt`` is text (needs the checkpoint's ``tokenizer.json``)
  or a list of token ids; ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
  ``ignore_eos``, ``stream`` (server-sent events; ``stream_options.include_usage`` adds a
  final usage chunk), ``return_token_ids`` and ``kv_transfer_params`` (vLLM's field: passed
  to the KV connector; a producer's answer comes back in the response's
  ``kv_transfer_params``), ``cache_hints`` (``{"session", "priority", "ttl"}``: the lmc
  connector keeps the session's chain in L1 for ``ttl`` s and gives it ``priority``;
  :mod:`lmc.connectors.core.hints`). ``usage.prompt_tokens_details.cached_tokens`` is the prompt
  tokens the connector supplied.
* ``POST /admin/cache/{pin,unpin,priority,delete,clear,prefetch}``: cache control on the
  engine's lmc cache (:mod:`lmc.reference.admin`), loopback clients only unless
  ``--admin-token`` (:mod:`lmc.http.admin`).
* ``GET /v1/models``, ``GET /lmc/stats`` (the connector's counters), ``GET /metrics``
  (this process's Prometheus registry: lmc's engine and tier series, text format).
* ``GET /health``: 200 once serving at full speed; 503 with what it waits for before that
  (loading the model, then the memory pool's pre-fault: ``MemoryPool.wait_ready``).

Start-up checks what it can before the slow work: the lmc config (keys, tier options, the
disk tier's directory, the pool against the host's memory), then binds the port, and only
then loads the model; each mistake is one line naming it and exit status 2. One INFO line
per request answered (``--no-access-log``: none).

One thread owns the engine and steps it while requests are pending; HTTP threads hand it
requests and wait for tokens. Every field the server reads is checked first (a 400 naming
it); a request that still fails in the engine fails alone (its own 4xx/5xx) and the loop
goes on serving the rest. Connections, the time to send a request and its size are
bounded (``--max-connections``, ``--read-timeout``, ``--max-body``: see
:mod:`lmc.http.json_api`; threat model: docs/threats/http.md). A process whose lmc config has a P2P tier holds a NIXL
agent: it is closed on SIGTERM/SIGINT with the engine, and the exit is clean (see
:mod:`lmc.storage.backends.p2p.agent`).
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
from pathlib import Path
from typing import Any

import prometheus_client

from lmc import units
from lmc.http import admin as admin_api
from lmc.http.admin import AdminAuth
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
from lmc.reference.admin import EngineAdmin
from lmc.reference.connector_api import connector_module
from lmc.reference.engine import LLM
from lmc.reference.openai_api import (
    BadRequest,
    Completion,
    TextStream,
    parse_chat,
    parse_completion,
)
from lmc.reference.request import SamplingParams
from lmc.storage.control import ControlError

__all__ = ["BadRequest", "Completion", "EngineLoop", "Server", "main", "parse_chat",
           "parse_completion"]
ROUTES = {"/v1/completions": parse_completion, "/v1/chat/completions": parse_chat}

log = logging.getLogger(__name__)
_warn = RateLimitedWarnings(limit=10, window=10.0, logger=log)


@dataclass
class _Job:
    prompt: Any
    params: Any  # SamplingParams
    kv_transfer_params: dict | None
    on_token: Callable[[int], None] | None
    admitted: threading.Event = field(default_factory=threading.Event)  # or refused
    done: threading.Event = field(default_factory=threading.Event)
    output: Any = None  # RequestOutput
    error: str | None = None
    status: int = 500  # of the error
    rid: str = ""
    sent: int = 0

    def fail(self, status: int, error: str) -> None:
        self.status, self.error = status, error
        self.admitted.set()
        self.done.set()


class EngineLoop:
    """The engine's one thread: adds submitted requests, steps while any is pending,
    streams new tokens to their callbacks and completes finished jobs.

    Nothing one request does can stop it: a request refused at admission gets its own
    error (400 for a ValueError, else 500); one that fails in a step is finished by the
    engine with its error (500); and if a step fails in a way the engine could not pin on
    requests, every request still in the engine is aborted and answered 500 so that the
    next request starts from a clean engine."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._inbox: queue.Queue[tuple[str, _Job] | None] = queue.Queue()
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self.failures = 0  # engine-wide resets (see class docstring)
        self._thread = threading.Thread(target=self._run, name="lmc-ref-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: _Job) -> _Job:
        self._inbox.put(("add", job))
        return job

    def abort(self, job: _Job) -> None:
        """The client went away: stop generating for it."""
        self._inbox.put(("abort", job))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` between steps (stats read off the engine's thread)."""
        with self._lock:
            return fn()

    def _admit(self, job: _Job) -> None:
        try:
            with self._lock:
                job.rid = self.llm.add_request(job.prompt, job.params,
                                               kv_transfer_params=job.kv_transfer_params)
        except ValueError as e:  # the request's own mistake: too long, ids out of range
            job.fail(400, str(e))
            return
        except Exception as e:
            job.fail(500, f"request refused by the engine: {_what(e)}")
            return
        self._jobs[job.rid] = job
        job.admitted.set()

    def _abort(self, job: _Job) -> None:
        if self._jobs.pop(job.rid, None) is not None:
            with self._lock:
                self.llm.abort_request(job.rid)
            job.fail(499, "client went away")

    def _run(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as e:  # never die: a dead loop hangs every later request
                self._reset(e)

    def _iterate(self) -> bool:
        """Take what is queued, else step once. False when closed."""
        try:
            item = self._inbox.get_nowait() if self._jobs else self._inbox.get()
        except queue.Empty:
            item = None
        else:
            if item is None:
                return False
            kind, job = item
            if kind == "add":
                self._admit(job)
            else:
                self._abort(job)
            return True  # take everything queued before stepping
        with self._lock:
            finished = self.llm.step()
            self._stream_new_tokens()
        for out in finished:
            self._finish(out)
        return True

    def _stream_new_tokens(self) -> None:
        for rid, j in self._jobs.items():
            req = self.llm.scheduler.requests.get(rid)
            if req is not None and j.on_token is not None:
                for t in req.output_token_ids[j.sent:]:
                    j.on_token(t)
                j.sent = len(req.output_token_ids)

    def _finish(self, out: Any) -> None:
        j = self._jobs.pop(out.request_id, None)
        error = self.llm.pop_error(out.request_id)
        if j is None:
            return
        if error is not None:
            _warn("request %s failed: %s", out.request_id, error)
            j.fail(500, error)
            return
        if j.on_token is not None:
            for t in out.token_ids[j.sent:]:
                j.on_token(t)
        j.output = out
        j.done.set()

    def _reset(self, e: Exception) -> None:
        """A failure not pinned on a request: abort everything in the engine, answer 500."""
        self.failures += 1
        _warn("engine step failed (%s); aborting %d requests", _what(e), len(self._jobs))
        with self._lock:
            self.llm.scheduler.abort_all()
            for j in self._jobs.values():
                j.fail(500, f"engine step failed: {_what(e)}")
            self._jobs.clear()

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(30)


def _what(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


class Server:
    """The engine, its loop and the HTTP server (``port`` 0 picks a free one); ``limits``
    bound what clients may hold (:class:`lmc.http.json_api.HttpLimits`). The port is bound
    here; ``llm`` may come later (:meth:`attach`): until then, and until its memory pool is
    pre-faulted, ``/health`` answers 503 saying what it waits for."""

    def __init__(self, llm: Any = None, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "", limits: HttpLimits | None = None,
                 admin_auth: AdminAuth | None = None) -> None:
        self.llm: Any = None
        self.admin_auth = admin_auth or AdminAuth()  # loopback only, unless tokens
        self.admin = EngineAdmin(self)
        self.loop: EngineLoop | None = None
        self.model_name = model_name
        handler = type("Handler", (_Handler,), {"app": self})
        self.httpd = BoundedHTTPServer((host, port), handler, limits or HttpLimits())
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._ready = False
        if llm is not None:
            self.attach(llm)

    def attach(self, llm: Any) -> None:
        """The engine is loaded: start its loop (requests are served from now)."""
        self.model_name = self.model_name or llm.model_dir.name
        self.loop = EngineLoop(llm)
        self.llm = llm

    def pool(self) -> Any:
        """The lmc memory pool of the engine's connector, or None (no lmc)."""
        engine = getattr(getattr(self.llm, "kv_connector", None), "engine", None)
        return getattr(engine, "pool", None)

    def readiness(self) -> tuple[bool, str]:
        """Whether stores run at full speed now, else what the server still waits for."""
        if self._ready:
            return True, "ok"
        if self.llm is None:
            return False, "loading the model"
        pool = self.pool()
        if pool is not None and not pool.wait_ready(0):
            done, _ = pool.prefault_progress()
            return False, (f"pre-faulting the lmc memory pool: {units.size(done)} of "
                           f"{units.size(pool.size)}")
        self._ready = True
        return True, "ok"

    def wait_ready(self, stop: threading.Event) -> bool:
        """Block until :meth:`readiness` says ready, helping the pool's pre-fault meanwhile
        (``MemoryPool.wait_ready``); False if ``stop`` came first."""
        while not stop.is_set():
            pool = self.pool() if self.llm is not None else None
            if pool is not None:
                pool.wait_ready(0.5)
            if self.readiness()[0]:
                return True
            if pool is None:
                stop.wait(0.1)
        return False

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def stats(self) -> dict[str, Any]:
        conn = self.llm.kv_connector if self.llm is not None else None
        if conn is None or not hasattr(conn, "stats") or self.loop is None:
            return {}
        return self.loop.call(conn.stats)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.close_all()
        self.httpd.server_close()
        if self.loop is not None:
            self.loop.close()
        if self.llm is not None:
            self.llm.close()


class _Handler(JsonHandler):
    app: Server

    def do_GET(self) -> None:
        if self.path == "/health":
            ready, detail = self.app.readiness()
            self.answer_json(200 if ready else 503, {"status": "ok"} if ready else
                       {"status": "starting", "detail": detail})
        elif self.path == "/metrics":
            data = prometheus_client.generate_latest(prometheus_client.REGISTRY)
            self.send_response(200)
            self.send_header("Content-Type", prometheus_client.CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.app.loop is None:
            self.answer_error(503, "the model is still loading")
        elif self.path == "/v1/models":
            self.answer_json(200, {"object": "list", "data": [
                {"id": self.app.model_name, "object": "model", "owned_by": "lmc"}]})
        elif self.path == "/lmc/stats":
            self.answer_json(200, self.app.stats())
        else:
            self.answer_error(404, f"no such path {self.path[:200]}")

    def do_POST(self) -> None:
        if self.path.startswith(admin_api.PATH):
            self._admin()
            return
        parse = ROUTES.get(self.path)
        if parse is None:
            self.answer_error(404, f"no such path {self.path[:200]} (POST {' or '.join(ROUTES)})")
            return
        if self.app.loop is None:
            self.answer_error(503, "the model is still loading")
            return
        try:
            req = parse(self.read_json())
            params = SamplingParams(**req.sampling)
            if req.messages is not None:  # the checkpoint's chat template, on this thread
                req.prompt = self.app.llm.encode_chat(req.messages)
        except HttpError as e:
            self.answer_error(e.status, str(e))
            return
        except ValueError as e:  # BadRequest, SamplingParams' own checks, the template's
            self.answer_error(400, str(e))
            return
        limit = self.app.llm.max_model_len
        if isinstance(req.prompt, list) and len(req.prompt) > limit:  # before any copy of it
            self.answer_error(400, f"prompt of {len(req.prompt)} tokens exceeds max_model_len="
                        f"{limit}")
            return
        job = _Job(req.prompt, params, req.kv_transfer_params, None)
        if req.stream:
            self._stream(req, job)
        else:
            self._complete(req, job)

    def _admin(self) -> None:
        """``POST /admin/cache/<op>``: the caller checked before its body is read
        (:mod:`lmc.http.admin`), the op run by :mod:`lmc.reference.admin`."""
        try:
            op = admin_api.op_of(self.path)
            grant = self.app.admin_auth.check(self.client_address[0],
                                              self.headers.get("Authorization"))
            req = admin_api.parse_admin(op, self.read_json())
            if self.app.loop is None:
                raise HttpError(503, "the model is still loading")
            out = self.app.admin.run(req, grant, self.server.limits.read_timeout)
        except HttpError as e:
            self.answer_error(e.status, str(e))
            return
        except ControlError as e:
            self.answer_json(*admin_api.refusal(e))
            return
        self.answer_json(200, out)

    def _wait(self, event: threading.Event) -> bool:
        """Wait for the engine; False (and a 503 sent) if its thread is gone."""
        loop = self.app.loop
        assert loop is not None  # requests reach here only once the engine is attached
        while not event.wait(1.0):
            if not loop.alive:
                self.answer_error(503, "the engine is not running")
                return False
        return True

    def _text(self, tokens: list[int]) -> str:
        tok = self.app.llm.tokenizer
        return tok.decode(tokens) if tok is not None else ""

    def _usage(self, out: Any) -> dict[str, Any]:
        p, c = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def _head(self, req: Completion, chunk: bool = False) -> dict[str, Any]:
        kind = ("chat.completion" if req.chat else "text_completion") + (
            ".chunk" if chunk and req.chat else "")
        return {"id": f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": kind, "created": int(time.time()),
                "model": req.model or self.app.model_name}

    @staticmethod
    def _choice(req: Completion, text: str | None, finish: str | None, *,
                first: bool = False, whole: bool = False) -> dict[str, Any]:
        """One choice of an answer (``whole``: ``text`` is all of it) or of a stream's chunk
        (``text`` the new piece, None in the last): a chat's carries a message or a delta,
        the first of them the assistant's role."""
        if not req.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body: dict[str, Any] = {} if text is None else {"content": text}
        if first or whole:
            body = {"role": "assistant", **body}
        return {"index": 0, "message" if whole else "delta": body, "logprobs": None,
                "finish_reason": finish}

    @property
    def _loop(self) -> EngineLoop:
        assert self.app.loop is not None  # do_POST answers 503 before the engine is there
        return self.app.loop

    def _complete(self, req: Completion, job: _Job) -> None:
        self._loop.submit(job)
        if not self._wait(job.done):
            return
        if job.error is not None:
            self.answer_error(job.status, job.error)
            return
        out = job.output
        choice = self._choice(req, self._text(out.token_ids), out.finish_reason, whole=True)
        if req.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = out.token_ids
        self.answer_json(200, {**self._head(req), "choices": [choice], "usage": self._usage(out),
                         "kv_transfer_params": out.kv_transfer_params})

    def _stream(self, req: Completion, job: _Job) -> None:
        tokens: queue.Queue[int] = queue.Queue()
        job.on_token = tokens.put
        self._loop.submit(job)
        if not self._wait(job.admitted):
            return
        if job.error is not None:  # refused at admission: a status, not a stream
            self.answer_error(job.status, job.error)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        head = self._head(req, chunk=True)
        text = TextStream(self._text)

        def send(obj: Any) -> None:
            self.wfile.write(b"data: " + (obj if isinstance(obj, bytes)
                                          else json.dumps(obj).encode()) + b"\n\n")
            self.wfile.flush()
        try:
            first = True
            while not (job.done.is_set() and tokens.empty()):
                try:
                    t = tokens.get(timeout=0.05)
                except queue.Empty:
                    continue
                choice = self._choice(req, text.push(t), None, first=first)
                first = False
                if req.return_token_ids:
                    choice["token_ids"] = [t]
                send({**head, "choices": [choice]})
            if job.error is not None:
                send({"error": {"message": job.error, "type": "server_error",
                                "code": job.status}})
            else:
                out = job.output
                rest = text.flush()
                if rest:
                    send({**head, "choices": [self._choice(req, rest, None, first=first)]})
                send({**head, "choices": [self._choice(req, None, out.finish_reason)],
                      "kv_transfer_params": out.kv_transfer_params})
                if req.include_usage:
                    send({**head, "choices": [], "usage": self._usage(out)})
            send(b"[DONE]")
        except OSError as e:  # went away, or stopped reading past read_timeout
            log.debug("client went away mid-stream (%s); aborting request %s", e, job.rid)
            self._loop.abort(job)


def wants_lmc(args: argparse.Namespace) -> bool:
    return bool(args.lmc_config) or args.kv_role != "kv_both"


def check_lmc_config(args: argparse.Namespace) -> Any:
    """The lmc config, checked as far as it can be before the slow work (the lmc
    connector's ``check_config``); None without lmc. Raises ``ValueError``/``OSError``
    naming the mistake."""
    if not wants_lmc(args):
        return None
    return connector_module("lmc").check_config(args.lmc_config)


def build_llm(args: argparse.Namespace, cache_config: Any = None) -> LLM:
    connector = None
    if wants_lmc(args):
        connector = connector_module("lmc").build_connector(
            cache_config or args.lmc_config, model_dir=args.model, kv_role=args.kv_role,
            remote_prefill_wait=args.remote_prefill_wait, engine_id=args.engine_id)
    return LLM(args.model, dtype=args.dtype, num_blocks=args.num_blocks,
               max_num_batched_tokens=args.max_num_batched_tokens, kv_connector=connector)


def _fail(msg: object) -> int:
    print(f"lmc.reference.serve: {msg}", file=sys.stderr, flush=True)
    return 2


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
    add_limit_args(p)
    p.add_argument("--admin-token", action="append", metavar="FILE[:NS,NS|:admin]",
                   help="a secret file opening POST /admin/cache/* to clients sending "
                   "Authorization: Bearer <it>, for the namespaces named (all: none or "
                   "admin); repeat. Without it the admin endpoints answer loopback only")
    p.add_argument("--ready-file", metavar="FILE", help="write {url, port, pid} here once "
                   "serving at full speed")
    args = p.parse_args(argv)
    if not Path(args.model).is_dir():
        return _fail(f"--model {args.model}: not a directory")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        limits = limits_from_args(args)
        admin_auth = AdminAuth.from_specs(args.admin_token)
        cache_config = check_lmc_config(args)
    except (ValueError, OSError) as e:
        return _fail(e)
    try:  # before the model loads: a taken port fails in a second
        server = Server(None, args.host, args.port, limits=limits, admin_auth=admin_auth)
    except OSError as e:
        return _fail(listen_error(e, args.host, args.port))
    server.httpd.access_log = args.access_log
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("listening at %s (/health: 503 until ready); loading %s", server.url, args.model)
    try:
        server.attach(build_llm(args, cache_config))
    except (ValueError, OSError, RuntimeError) as e:  # a pool that does not fit, pinning
        server.close()
        return _fail(e)
    if server.wait_ready(stop):
        info = {"url": server.url, "port": server.port, "pid": os.getpid()}
        if args.ready_file:
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(json.dumps(info))
            tmp.rename(args.ready_file)
        log.info("ready: serving %s at full speed", server.model_name)
        print(f"serving {server.model_name} at {server.url}", flush=True)
        stop.wait()
    server.close()  # closes the engine (and a NIXL agent) before the exit
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
