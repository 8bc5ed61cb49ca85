"""``lmc router``: one OpenAI-compatible endpoint in front of N engine instances, each request
sent where the most of its prompt is already cached (``--policy prefix``) or in turn
(``--policy round_robin``, the baseline).

    lmc router --instance http://10.0.0.1:8000,events=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558 \\
               --instance http://10.0.0.2:8000,events=tcp://10.0.0.2:5557,replay=tcp://10.0.0.2:5558

Instances are anything serving ``/v1/completions`` and ``/v1/chat/completions`` (lmc's
reference server, ``vllm serve``), streamed or not. Each one's KV events (vLLM's format: lmc's
tiers with ``kv_events`` on, vLLM's own with ``--kv-events-config``) are subscribed to; the
prompt's cached prefix per medium is weighed against requests in flight (see
:mod:`lmc.router.policy` for the formula and ``--weight-*``/``--load-weight``). A prompt given
as token ids is scored as is; text needs ``--tokenizer`` (the engines' ``tokenizer.json``);
chat requests are balanced by load.

Health: ``GET /health`` of each instance every ``--health-interval`` seconds; an instance
that fails it, or refuses a connection, gets nothing until it answers again. A request whose
instance fails before answering is sent to the next best one (at most once per instance). An
instance whose events are stale (not synced, or silent for ``--stale-after`` seconds; lmc's
publisher sends a heartbeat every 2 s) is scored as if it cached nothing.

``GET /metrics`` (Prometheus): requests per instance and reason (``prefix``, ``load``,
``stale``, ``no_tokens``, ``round_robin``), predicted cached tokens (the index's prefix) next
to reported ones (the answer's ``usage.prompt_tokens_details.cached_tokens``), in flight,
health and event freshness per instance. ``GET /lmc/router``: the same as JSON.

Client connections, request time and size are bounded as in :mod:`lmc.http.json_api`; an
instance's answer is streamed through as it comes. Threat model: docs/threats/router.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from lmc.http.json_api import (
    BoundedHTTPServer,
    HttpError,
    HttpLimits,
    JsonHandler,
    RateLimitedWarnings,
    add_limit_args,
    limits_from_args,
)
from lmc.http.pd_proxy import TIMEOUT, UPSTREAM_ERRORS, Upstream, encode, read_bounded
from lmc.router.feed import EventFeed, Source
from lmc.router.index import Match
from lmc.router.policy import POLICIES, Candidate, PromptKeys, Weights, choose

log = logging.getLogger(__name__)
_warn = RateLimitedWarnings(limit=10, window=10.0, logger=log)
MAX_PROMPT_TOKENS = 1 << 20
TAIL_BYTES = 64 << 10  # of an answer, kept to read its usage
HEALTH_TIMEOUT = 5.0


@dataclass(frozen=True)
class InstanceSpec:
    url: str
    events: str | None = None
    replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> InstanceSpec:
        """``URL[,events=ENDPOINT][,replay=ENDPOINT]``."""
        url, *opts = text.split(",")
        kw: dict[str, str] = {}
        for o in opts:
            k, eq, v = o.partition("=")
            if not eq or k not in ("events", "replay") or k in kw:
                raise ValueError(f"--instance {text[:200]!r}: expected URL[,events=tcp://host:"
                                 f"port][,replay=tcp://host:port], got {o[:60]!r}")
            if not v.startswith(("tcp://", "ipc://")):
                raise ValueError(f"--instance: {k}={v[:80]!r} is not a tcp:// or ipc:// "
                                 f"endpoint")
            kw[k] = v
        if "replay" in kw and "events" not in kw:
            raise ValueError(f"--instance {text[:200]!r}: replay= needs events=")
        return cls(url, kw.get("events"), kw.get("replay"))


class Instance:
    def __init__(self, spec: InstanceSpec, timeout: float, max_blocks: int) -> None:
        self.upstream = Upstream(spec.url, timeout)
        self.url = self.upstream.url
        self.source = (Source(self.url, spec.events, spec.replay, max_blocks)
                       if spec.events else None)
        self.healthy = True
        self.in_flight = 0
        self.probe_failures = 0


class _Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lmc_router_requests", "Requests routed, by instance and why "
                                "(prefix, load, stale, no_tokens, round_robin)",
                                ["instance", "reason"], registry=r)
        self.prompt = Counter("lmc_router_prompt_tokens", "Prompt tokens routed",
                              ["instance"], registry=r)
        self.predicted = Counter("lmc_router_predicted_cached_tokens", "Prompt tokens the "
                                 "events said the instance had cached", ["instance"],
                                 registry=r)
        self.reported = Counter("lmc_router_reported_cached_tokens", "Prompt tokens the "
                                "instance reported cached (usage.prompt_tokens_details)",
                                ["instance"], registry=r)
        self.failures = Counter("lmc_router_upstream_failures", "Requests an instance failed "
                                "before answering", ["instance"], registry=r)
        self.in_flight = Gauge("lmc_router_in_flight", "Requests in flight", ["instance"],
                               registry=r)
        self.healthy = Gauge("lmc_router_instance_healthy", "1 if the instance answers its "
                             "health check", ["instance"], registry=r)
        self.fresh = Gauge("lmc_router_events_fresh", "1 if the instance's events are synced "
                           "and recent", ["instance"], registry=r)
        self.blocks = Gauge("lmc_router_indexed_blocks", "Blocks the router knows the "
                            "instance caches", ["instance"], registry=r)
        self.gaps = Gauge("lmc_router_event_gaps", "Sequence gaps seen in the instance's "
                          "events", ["instance"], registry=r)


class Router:
    def __init__(self, instances: Sequence[InstanceSpec], *, policy: str = "prefix",
                 weights: Weights | None = None, host: str = "127.0.0.1", port: int = 0,
                 limits: HttpLimits | None = None, upstream_timeout: float = TIMEOUT,
                 health_interval: float = 2.0, stale_after: float = 10.0,
                 tokenizer: Any = None, max_blocks: int = 1 << 21) -> None:
        if not instances:
            raise ValueError("lmc router needs at least one --instance")
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if not 0 < upstream_timeout <= 86400:
            raise ValueError(f"upstream timeout must be in (0, 86400] s, got {upstream_timeout}")
        self.policy = policy
        self.weights = weights or Weights()
        self.instances = [Instance(s, upstream_timeout, max_blocks) for s in instances]
        if len({i.url for i in self.instances}) < len(self.instances):
            raise ValueError("an --instance URL is given twice")
        self.health_interval = health_interval
        self.stale_after = stale_after
        self.tokenizer = tokenizer
        self.metrics = _Metrics()
        self._lock = threading.Lock()
        self._turn = 0
        self._stop = threading.Event()
        sources = [i.source for i in self.instances if i.source is not None]
        self.feed = EventFeed(sources, stale_after) if sources else None
        handler = type("Handler", (_Handler,), {"router": self})
        self.httpd = BoundedHTTPServer((host, port), handler, limits or HttpLimits(),
                                       fds_per_connection=2)
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        if self.feed is not None:
            self.feed.start()
        for inst in self.instances:
            threading.Thread(target=self._check_health, args=(inst,),
                             name="lmc-router-health", daemon=True).start()

    # ------------------------------------------------------------------ choosing
    def pick(self, tokens: list[int] | None, salt: str | None, exclude: set[str]
             ) -> tuple[Instance, str, int]:
        """The instance for a prompt, why, and the cached tokens predicted there; counts
        it in flight (the caller calls :meth:`done`)."""
        keys = PromptKeys(tokens, None, salt) if tokens is not None else None
        now = time.monotonic()
        with self._lock:
            live = [i for i in self.instances if i.healthy and i.url not in exclude]
            if not live:
                raise HttpError(503, "no healthy instance to send the request to"
                                + (" (the others failed it)" if exclude else ""))
            cands = []
            for inst in live:
                s = inst.source
                m = None
                if keys is not None and s is not None and s.fresh(self.stale_after, now):
                    bs = s.index.block_size
                    m = s.index.match(keys.at(bs)) if bs else Match()
                cands.append(Candidate(inst.in_flight, m))
            c = choose(cands, None if tokens is None else len(tokens), self.weights,
                       self._turn, self.policy)
            self._turn += 1
            inst = live[c.index]
            inst.in_flight += 1
        self.metrics.in_flight.labels(inst.url).set(inst.in_flight)
        return inst, c.reason, min(c.match.tokens(), len(tokens or ()))

    def done(self, inst: Instance) -> None:
        with self._lock:
            inst.in_flight -= 1
        self.metrics.in_flight.labels(inst.url).set(inst.in_flight)

    def mark(self, inst: Instance, healthy: bool, why: str = "") -> None:
        if inst.healthy != healthy:
            log.info("instance %s is %s%s", inst.url, "healthy again" if healthy else
                     "unhealthy", f": {why}" if why else "")
        inst.healthy = healthy
        self.metrics.healthy.labels(inst.url).set(1 if healthy else 0)

    def _check_health(self, inst: Instance) -> None:
        """``GET /health`` every ``health_interval`` (one thread per instance, so a hung one
        delays only itself), each within ``HEALTH_TIMEOUT``."""
        while not self._stop.is_set():
            conn = http.client.HTTPConnection(inst.upstream.host, inst.upstream.port,
                                              timeout=HEALTH_TIMEOUT)
            try:
                conn.request("GET", "/health")
                resp = conn.getresponse()
                resp.read(4096)
                self.mark(inst, resp.status == 200, f"/health answered {resp.status}")
                inst.probe_failures = 0
            except UPSTREAM_ERRORS as e:
                # refused: down now; a timeout may be a busy moment: down at the second
                inst.probe_failures += 1
                if isinstance(e, ConnectionRefusedError) or inst.probe_failures >= 2:
                    self.mark(inst, False, f"{type(e).__name__}: {str(e)[:100]}")
            finally:
                conn.close()
            self._stop.wait(self.health_interval)

    # ------------------------------------------------------------------ reporting
    def state(self) -> dict[str, Any]:
        now = time.monotonic()
        out = []
        for i in self.instances:
            s = i.source
            out.append({"url": i.url, "healthy": i.healthy, "in_flight": i.in_flight,
                        "events": None if s is None else {
                            "endpoint": s.endpoint, "synced": s.synced,
                            "fresh": s.fresh(self.stale_after, now),
                            "blocks": s.index.blocks, **s.counts, **s.index.counts}})
        return {"policy": self.policy, "instances": out}

    def prometheus(self) -> bytes:
        now = time.monotonic()
        m = self.metrics
        for i in self.instances:
            m.healthy.labels(i.url).set(1 if i.healthy else 0)
            m.in_flight.labels(i.url).set(i.in_flight)
            if i.source is not None:
                m.fresh.labels(i.url).set(1 if i.source.fresh(self.stale_after, now) else 0)
                m.blocks.labels(i.url).set(i.source.index.blocks)
                m.gaps.labels(i.url).set(i.source.counts["gaps"])
        return generate_latest(m.registry)

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.close_all()
        self.httpd.server_close()
        if self.feed is not None:
            self.feed.close()


def prompt_tokens(body: dict[str, Any], tokenizer: Any) -> list[int] | None:
    """The prompt's token ids if the router can know them (see the module docstring); a
    malformed prompt is left for the instance to refuse in its own words."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPT_TOKENS and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32
            for t in prompt):
        return prompt
    if isinstance(prompt, str) and tokenizer is not None and len(prompt) <= 8 * MAX_PROMPT_TOKENS:
        try:
            return list(tokenizer.encode(prompt))
        except Exception as e:  # a prompt the tokenizer cannot take: the instance says why
            log.debug("tokenizer: %s", e)
    return None


def cached_tokens(tail: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from the end of an answer (a JSON body,
    or the last server-sent event carrying usage)."""
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data:"):
            line = line[5:].strip()
        if b"cached_tokens" not in line or not line.startswith(b"{"):
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            continue
        usage = obj.get("usage") if isinstance(obj, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        n = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 40:
            return n
    return None


class _Handler(JsonHandler):
    router: Router

    def do_GET(self) -> None:
        r = self.router
        if self.path == "/health":
            ok = any(i.healthy for i in r.instances)
            self._json(200 if ok else 503, {"status": "ok" if ok else "no healthy instance"})
        elif self.path == "/metrics":
            data = r.prometheus()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/lmc/router":
            self._json(200, r.state())
        elif self.path == "/v1/models":
            live = [i for i in r.instances if i.healthy] or r.instances
            up = live[0].upstream
            try:
                status, data = up.get(self.path, self.server.limits.max_body)
            except HttpError as e:
                self._error(e.status, f"instance {up.url}: {e}")
                return
            except UPSTREAM_ERRORS as e:
                self._error(502, f"instance {up.url}: {type(e).__name__}: {str(e)[:200]}")
                return
            self._relay_bytes(status if 100 <= status < 600 else 502, data)
        else:
            self._error(404, f"no such path {self.path[:200]}")

    def do_POST(self) -> None:
        r = self.router
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, f"no such path {self.path[:200]}")
            return
        try:
            body = self.read_json()
            if not isinstance(body, dict):
                raise HttpError(400, "bad request body: the body must be a JSON object")
            data = encode(body)
        except HttpError as e:
            self._error(e.status, str(e))
            return
        tokens = prompt_tokens(body, r.tokenizer) if self.path == "/v1/completions" else None
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and len(salt) <= 1024 else None
        tried: set[str] = set()
        while True:
            try:
                inst, reason, predicted = r.pick(tokens, salt, tried)
            except HttpError as e:
                self._error(e.status, str(e))
                return
            try:
                answered = self._forward(inst, data, reason, predicted, len(tokens or ()))
            finally:
                r.done(inst)
            if answered:
                return
            tried.add(inst.url)

    def _forward(self, inst: Instance, data: bytes, reason: str, predicted: int,
                 n_tokens: int) -> bool:
        """Relay ``inst``'s answer as it comes; False if it failed before answering (the
        caller tries another)."""
        r = self.router
        m = r.metrics
        try:
            conn, resp = inst.upstream.post(self.path, data)
        except UPSTREAM_ERRORS as e:
            m.failures.labels(inst.url).inc()
            r.mark(inst, False, f"{type(e).__name__}: {str(e)[:100]}")
            return False
        m.requests.labels(inst.url, reason).inc()
        m.prompt.labels(inst.url).inc(n_tokens)
        m.predicted.labels(inst.url).inc(predicted)
        try:
            if not 100 <= resp.status < 600:
                self._error(502, f"instance {inst.url} answered status {resp.status}")
                return True
            if resp.status != 200:  # a refusal: bounded, relayed as is
                answer = read_bounded(resp, self.server.limits.max_body, f"instance {inst.url}")
                self._relay_bytes(resp.status, answer, resp.getheader("Content-Type"))
                return True
            self.send_response(resp.status)
            for h in ("Content-Type", "Cache-Control", "Content-Length"):
                v = resp.getheader(h)
                if v and v.isprintable():
                    self.send_header(h, v)
            self.end_headers()
            tail = bytearray()
            while chunk := resp.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
                tail += chunk
                if len(tail) > TAIL_BYTES:
                    del tail[:-TAIL_BYTES]
            n = cached_tokens(bytes(tail))
            if n is not None:
                m.reported.labels(inst.url).inc(n)
        except HttpError as e:
            self._error(e.status, str(e))
        except (*UPSTREAM_ERRORS, http.client.HTTPException) as e:
            log.debug("answer from %s cut short: %s", inst.url, e)
        finally:
            conn.close()
        return True

    def _relay_bytes(self, status: int, data: bytes, ctype: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype if ctype and ctype.isprintable()
                         else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def register_cli(sub: Any) -> None:
    from lmc.cli import add_command, float_in, int_in
    p = add_command(sub, "router", "route requests to the instance with the longest cached "
                    "prefix (KV events), balanced against load", __doc__)
    p.add_argument("--instance", action="append", required=True, metavar="SPEC",
                   help="URL[,events=tcp://host:port][,replay=tcp://host:port]; repeat")
    p.add_argument("--policy", choices=POLICIES, default="prefix")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_in(0, 65535), default=8200, help="0: pick a free port")
    d = Weights()
    p.add_argument("--weight-gpu", type=float_in(0, 1), default=d.gpu,
                   help="credit of a prefix block in the engine's own cache")
    p.add_argument("--weight-cpu", type=float_in(0, 1), default=d.cpu,
                   help="credit of a block in lmc's memory tier")
    p.add_argument("--weight-storage", type=float_in(0, 1), default=d.storage,
                   help="credit of a block on disk or a shared store")
    p.add_argument("--load-weight", type=float_in(0, 1 << 24), default=d.load,
                   metavar="TOKENS", help="prefill tokens one request in flight is worth")
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json of the engines, to "
                   "score text prompts")
    p.add_argument("--health-interval", type=float_in(0.1, 3600), default=2.0,
                   metavar="SECONDS")
    p.add_argument("--stale-after", type=float_in(0.5, 86400), default=10.0, metavar="SECONDS",
                   help="events silent this long are not trusted")
    p.add_argument("--max-blocks", type=int_in(1, 1 << 28), default=1 << 21,
                   help="blocks remembered per instance")
    p.add_argument("--upstream-timeout", type=float_in(0, 86400, low_open=True),
                   default=TIMEOUT, metavar="SECONDS",
                   help="how long an instance may take to answer (per read)")
    add_limit_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        specs = [InstanceSpec.parse(t) for t in args.instance]
        tokenizer = None
        if args.tokenizer:
            from lmc.reference.tokenizer import Tokenizer
            tokenizer = Tokenizer(args.tokenizer)
        router = Router(specs, policy=args.policy,
                        weights=Weights(args.weight_gpu, args.weight_cpu, args.weight_storage,
                                        args.load_weight),
                        host=args.host, port=args.port, limits=limits_from_args(args),
                        upstream_timeout=args.upstream_timeout,
                        health_interval=args.health_interval, stale_after=args.stale_after,
                        tokenizer=tokenizer, max_blocks=args.max_blocks)
    except (ValueError, OSError, ImportError) as e:
        print(f"lmc router: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=router.serve_forever, name="http", daemon=True).start()
    print(f"router at {router.url} ({router.policy}): "
          f"{', '.join(i.url for i in router.instances)}", flush=True)
    stop.wait()
    router.close()
    return 0
