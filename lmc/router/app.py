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

Health: ``GET /health`` of each instance every ``--health-interval`` seconds
(:mod:`lmc.router.health`, shared with ``lmc pd-proxy``); an instance that fails it, or
refuses a connection, gets nothing until it answers again. A request whose
instance fails before answering is sent to the next best one (at most once per instance). An
instance whose events are stale (not synced, or silent for ``--stale-after`` seconds; lmc's
publisher sends a heartbeat every 2 s) is scored as if it cached nothing.

``GET /metrics`` (Prometheus, :mod:`lmc.router.metrics`, ``lmc_router_*``): requests per instance and reason (``prefix``, ``load``,
``stale``, ``no_tokens``, ``round_robin``), predicted cached tokens (the index's prefix) next
to reported ones (the answer's ``usage.prompt_tokens_details.cached_tokens``), in flight,
health and event freshness per instance. ``GET /lmc/router``: the same as JSON.

Client connections, request time and size are bounded as in :mod:`lmc.http.json_api`; an
instance's answer is streamed through as it comes (:mod:`lmc.router.relay`, shared with
``lmc pd-proxy``, as is the choosing: :mod:`lmc.router.dispatch`). Threat model:
docs/threats/router.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from lmc.http.admin import PATH as ADMIN_PATH
from lmc.http.admin import AdminAuth
from lmc.http.json_api import (
    HttpError,
    HttpLimits,
    RateLimitedWarnings,
    add_limit_args,
    limits_from_args,
    listen_error,
)
from lmc.router.admin import RouterAdmin
from lmc.router.dispatch import (
    Fleet,
    Front,
    Instance,
    InstanceSpec,
    Pick,
    add_choice_args,
    cache_salt,
    choice_from_args,
    prompt_tokens,
)
from lmc.router.feed import SharedSpec
from lmc.router.health import DEFAULT_INTERVAL
from lmc.router.metrics import CONTENT_TYPE, RoutingMetrics, cached_tokens
from lmc.router.policy import Weights
from lmc.router.relay import TIMEOUT, UPSTREAM_ERRORS, RelayHandler, encode, what

__all__ = ["InstanceSpec", "Router", "cached_tokens", "prompt_tokens", "register_cli", "run"]
log = logging.getLogger(__name__)
_warn = RateLimitedWarnings(limit=10, window=10.0, logger=log)
TAIL_BYTES = 64 << 10  # of an answer, kept to read its usage


class Router(Front):
    def __init__(self, instances: Sequence[InstanceSpec], *, policy: str = "prefix",
                 weights: Weights | None = None, host: str = "127.0.0.1", port: int = 0,
                 limits: HttpLimits | None = None, upstream_timeout: float = TIMEOUT,
                 health_interval: float | None = DEFAULT_INTERVAL, stale_after: float = 10.0,
                 tokenizer: Any = None, max_blocks: int = 1 << 21,
                 shared: Sequence[SharedSpec] = (), admin: RouterAdmin | None = None,
                 prefetch: bool = True) -> None:
        if not instances:
            raise ValueError("lmc router needs at least one --instance")
        self.fleet = Fleet(instances, policy=policy, weights=weights,
                           upstream_timeout=upstream_timeout, stale_after=stale_after,
                           max_blocks=max_blocks, shared=shared)
        self.policy = policy
        self.weights = self.fleet.weights
        self.instances = self.fleet.instances
        self.health_interval = health_interval
        self.stale_after = stale_after
        self.tokenizer = tokenizer
        self.metrics = RoutingMetrics("lmc_router")
        self.admin = admin or RouterAdmin()  # /admin/cache/* and prefetches (lmc.router.admin)
        self.prefetch = prefetch
        self.listen(type("Handler", (_Handler,), {"router": self}), host, port, limits,
                    self.fleet.sources, stale_after)
        self.check_health([self.fleet], health_interval, "lmc-router-health")

    # ------------------------------------------------------------------ choosing
    def pick(self, tokens: list[int] | None, salt: str | None, exclude: set[str]
             ) -> Pick:
        """The instance for a prompt, why, the cached tokens predicted there and the
        events' match; counts it in flight (the caller calls :meth:`done`)."""
        p = self.fleet.pick(tokens, salt, exclude)
        self.metrics.in_flight.labels(p.instance.url).set(p.instance.in_flight)
        return p

    def done(self, inst: Instance) -> None:
        self.fleet.done(inst)
        self.metrics.in_flight.labels(inst.url).set(inst.in_flight)

    def mark(self, inst: Instance, healthy: bool, why: str = "") -> None:
        self.fleet.mark(inst, healthy, why)

    # ------------------------------------------------------------------ reporting
    def state(self) -> dict[str, Any]:
        return {"policy": self.policy, "instances": self.fleet.state()}

    def prometheus(self) -> bytes:
        return self.metrics.scrape([((i.url,), i) for i in self.instances], self.stale_after)


class _Handler(RelayHandler):
    router: Router

    def do_GET(self) -> None:
        r = self.router
        if self.path == "/health":
            ok = any(i.healthy for i in r.instances)
            self.answer_json(200 if ok else 503,
                             {"status": "ok" if ok else "no healthy instance"})
        elif self.path == "/metrics":
            self.relay_bytes(200, r.prometheus(), CONTENT_TYPE)
        elif self.path == "/lmc/router":
            self.answer_json(200, r.state())
        elif self.path == "/v1/models":
            live = [i for i in r.instances if i.healthy] or r.instances
            self.relay_get(live[0].upstream, "instance")
        else:
            self.answer_error(404, f"no such path {self.path[:200]}")

    def do_POST(self) -> None:
        r = self.router
        if self.path.startswith(ADMIN_PATH):
            r.admin.handle(self, r)
            return
        body = self.request_body()
        if body is None:
            return
        try:
            data = encode(body)
        except HttpError as e:
            self.answer_error(e.status, str(e))
            return
        tokens = prompt_tokens(body, r.tokenizer) if self.path == "/v1/completions" else None
        salt = cache_salt(body)
        tried: set[str] = set()
        while True:
            try:
                p = r.pick(tokens, salt, tried)
            except HttpError as e:
                self.answer_error(e.status, str(e))
                return
            inst = p.instance
            try:
                if r.prefetch and tokens is not None:  # the load overlaps the queueing
                    r.admin.prefetch_if_lower(inst, p.match, {**body, "prompt": tokens})
                answered = self._forward(inst, data, p.reason, p.predicted, len(tokens or ()))
            finally:
                r.done(inst)
            if answered:
                return
            tried.add(inst.url)
            r.metrics.retries.inc()

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
            r.mark(inst, False, what(e)[:160])
            return False
        m.sent((inst.url,), reason, n_tokens, predicted)
        try:
            tail = self.relay_answer(resp, f"instance {inst.url}", TAIL_BYTES)
        finally:
            conn.close()
        m.answered((inst.url,), tail if resp.status == 200 else None)
        return True


def register_cli(sub: Any) -> None:
    from lmc.cli_args import add_command, float_in, int_in
    p = add_command(sub, "router", "route requests to the instance with the longest cached "
                    "prefix (KV events), balanced against load", __doc__)
    p.add_argument("--instance", action="append", required=True, metavar="SPEC",
                   help="URL[,events=tcp://host:port][,replay=tcp://host:port]; repeat")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_in(0, 65535), default=8200, help="0: pick a free port")
    add_choice_args(p, "prefix", "the longest cached prefix (events=) against load, or in "
                    "turn")
    p.add_argument("--shared-events", action="append", default=[], metavar="SPEC",
                   help="ENDPOINT[,replay=ENDPOINT][,namespace=NS][,instances=URL|URL]: "
                   "a shared lmc server's KV events (its kv_events); a prefix it holds "
                   "counts as cached for every instance using it (namespace: their lmc:// "
                   "tier's ?ns=, default lmc); repeat")
    p.add_argument("--upstream-timeout", type=float_in(0, 86400, low_open=True),
                   default=TIMEOUT, metavar="SECONDS",
                   help="how long an instance may take to answer (per read)")
    p.add_argument("--admin-token", action="append", metavar="FILE[:NS,NS|:admin]",
                   help="a secret file opening POST /admin/cache/* to clients sending "
                   "Authorization: Bearer <it> (namespaces as named; all: none or admin); "
                   "repeat. Without it the admin endpoints answer loopback only")
    p.add_argument("--upstream-admin-token", metavar="FILE",
                   help="the secret the router sends instances' admin endpoints (admin ops "
                   "it forwards, prefetches)")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="never ask an instance to prefetch a prompt it holds below memory")
    add_limit_args(p)
    p.set_defaults(func=run)


def _secret(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return open(path, encoding="utf-8").read().strip()
    except OSError as e:
        raise ValueError(f"--upstream-admin-token {path}: cannot read it ({e.strerror})") \
            from None


def run(args: argparse.Namespace) -> int:
    try:
        specs = [InstanceSpec.parse(t) for t in args.instance]
        shared = [SharedSpec.parse(t) for t in args.shared_events]
        admin = RouterAdmin(AdminAuth.from_specs(args.admin_token),
                            _secret(args.upstream_admin_token))
        router = Router(specs, host=args.host, port=args.port, limits=limits_from_args(args),
                        upstream_timeout=args.upstream_timeout,
                        shared=shared, admin=admin, prefetch=args.prefetch,
                        **choice_from_args(args))
    except OSError as e:  # the port (a file, e.g. a tokenizer, names itself)
        why = str(e) if e.filename else listen_error(e, args.host, args.port)
        print(f"lmc router: {why}", file=sys.stderr)
        return 2
    except (ValueError, ImportError) as e:
        print(f"lmc router: {e}", file=sys.stderr)
        return 2
    return router.run_until_signalled(f"router at {router.url} ({router.policy}): "
                                      f"{', '.join(i.url for i in router.instances)}")
