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
API either way. Several ``--prefill``/``--decode`` instances are chosen among as ``lmc
router`` chooses (:mod:`lmc.router.dispatch`, :mod:`lmc.router.policy`): each may be given
as ``URL,events=tcp://host:port[,replay=tcp://host:port]`` (its KV events, vLLM's format),
and ``--policy prefix`` sends the request's prefill and its decode each to the instance
of its set with the longest cached prefix of the prompt (token ids, or text with
``--tokenizer``; the router's ``--weight-*``/``--load-weight``), balanced against requests
in flight; an instance whose events are stale, silent or absent is credited nothing.
``--policy round_robin`` takes turns (the default when no instance has ``events=``, as
before; ``prefix`` is the default when one has).

Health, as ``lmc router``'s (:mod:`lmc.router.health`): ``GET /health`` of every instance
every ``--health-interval`` seconds; an unhealthy one is not chosen until it answers again,
and a role with no healthy instance left is a 503 naming it (``GET /health`` of the proxy
too). An instance that refuses a request's connection (down since its last check) is marked
unhealthy at once and the request goes to another healthy instance of its role, once;
nothing has reached the client then. Any other failure is a 502 naming the instance, never
retried (a prefill may have run; a decode may have started streaming).

``GET /metrics`` (Prometheus, :mod:`lmc.router.metrics`, the router's series named
``lmc_pd_proxy_*`` with a ``role`` label): requests per role, instance and reason, failures,
retries, predicted and reported cached tokens, in flight, health, event freshness.
``GET /lmc/pd-proxy``: counts, routing and each instance's state as JSON.

Client connections, request time and size are bounded as in :mod:`lmc.http.json_api`
(``--max-connections``, ``--read-timeout``, ``--max-body``); an instance's answer is read
within ``--upstream-timeout`` per read and at most ``--max-body`` bytes (the producer's;
the consumer's is streamed through). A producer that answers garbage (not JSON, not an
object, ``kv_transfer_params`` not an object) or nothing is a 502 naming it. The relaying is
:mod:`lmc.router.relay` (shared with ``lmc router``). Threat model: docs/threats/http.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

from lmc.http.json_api import (
    HttpError,
    HttpLimits,
    RateLimitedWarnings,
    add_limit_args,
    limits_from_args,
    listen_error,
)
from lmc.router.dispatch import (
    Fleet,
    Front,
    InstanceSpec,
    Pick,
    add_choice_args,
    cache_salt,
    choice_from_args,
    prompt_tokens,
)
from lmc.router.health import DEFAULT_INTERVAL
from lmc.router.metrics import CONTENT_TYPE, RoutingMetrics
from lmc.router.policy import Weights
from lmc.router.relay import (
    TIMEOUT,
    UPSTREAM_ERRORS,
    RelayHandler,
    Upstream,
    encode,
    read_bounded,
    what,
)

log = logging.getLogger(__name__)
_warn = RateLimitedWarnings(limit=10, window=10.0, logger=log)


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


def _spec(u: str | InstanceSpec, flag: str) -> InstanceSpec:
    return u if isinstance(u, InstanceSpec) else InstanceSpec.parse(u, flag)


ROLES = ("prefill", "decode")
TAIL_BYTES = 64 << 10  # of a decode answer, kept to read its usage


class Proxy(Front):
    """The proxy (module docstring). Each instance's ``GET /health`` is probed every
    ``health_interval`` seconds (the router's default); ``None`` probes nothing: every
    instance is then taken as healthy, and one refusing a connection is still passed over
    for that request, but not marked."""

    def __init__(self, prefill: Sequence[str | InstanceSpec],
                 decode: Sequence[str | InstanceSpec], host: str = "127.0.0.1",
                 port: int = 0, limits: HttpLimits | None = None,
                 upstream_timeout: float = TIMEOUT, *, policy: str | None = None,
                 weights: Weights | None = None, stale_after: float = 10.0,
                 max_blocks: int = 1 << 21, tokenizer: Any = None,
                 health_interval: float | None = DEFAULT_INTERVAL) -> None:
        if not prefill or not decode:
            raise ValueError("pd-proxy needs at least one --prefill and one --decode URL")
        if not 0 < upstream_timeout <= 86400:
            raise ValueError(f"upstream timeout must be in (0, 86400] seconds, got "
                             f"{upstream_timeout}")
        p_specs = [_spec(u, "--prefill") for u in prefill]
        d_specs = [_spec(u, "--decode") for u in decode]
        if policy is None:  # without events, turns (as before events existed)
            policy = "prefix" if any(s.events for s in p_specs + d_specs) else "round_robin"
        self.policy = policy
        kw: dict[str, Any] = {"policy": policy, "weights": weights,
                              "upstream_timeout": upstream_timeout,
                              "stale_after": stale_after, "max_blocks": max_blocks,
                              "unique": False}
        self.prefill = Fleet(p_specs, what="prefill instance", flag="--prefill", **kw)
        self.decode = Fleet(d_specs, what="decode instance", flag="--decode", **kw)
        self.fleets = {"prefill": self.prefill, "decode": self.decode}
        self.tokenizer = tokenizer
        self.stale_after = stale_after
        self.health_interval = health_interval
        self.metrics = RoutingMetrics("lmc_pd_proxy", ("role",))
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "prefill_failures": 0, "decode_failures": 0,
                       "retries": 0}
        self.routed: dict[str, dict[str, dict[str, int]]] = {"prefill": {}, "decode": {}}
        self.listen(type("Handler", (_Handler,), {"proxy": self}), host, port, limits,
                    self.prefill.sources + self.decode.sources, stale_after)
        self.check_health([self.prefill, self.decode], health_interval, "lmc-pd-health")

    def pick(self, tokens: list[int] | None = None, salt: str | None = None
             ) -> tuple[Pick, Pick]:
        """The prefill and the decode instance of a request, each counted in flight until
        :meth:`done`; a 503 naming the role if one has no healthy instance."""
        p = self.prefill.pick(tokens, salt)
        try:
            d = self.decode.pick(tokens, salt)
        except BaseException:
            self.prefill.done(p.instance)
            raise
        return p, d

    def sent(self, role: str, c: Pick, n_tokens: int) -> None:
        """``c``'s instance took the request (its connection was made)."""
        with self._lock:
            per = self.routed[role].setdefault(c.instance.url, {})
            per[c.reason] = per.get(c.reason, 0) + 1
        self.metrics.sent((role, c.instance.url), c.reason, n_tokens, c.predicted)

    def count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def missing(self) -> list[str]:
        """The roles with no healthy instance now."""
        return [r for r in ROLES if not self.fleets[r].healthy()]

    def state(self) -> dict[str, Any]:
        with self._lock:
            routed = {r: {u: dict(v) for u, v in per.items()} for r, per in self.routed.items()}
            counts = dict(self.counts)
        return {**counts, "prefill": [i.url for i in self.prefill.instances],
                "decode": [i.url for i in self.decode.instances], "policy": self.policy,
                "health_interval": self.health_interval, "routed": routed,
                "instances": {"prefill": self.prefill.state(),
                              "decode": self.decode.state()}}

    def prometheus(self) -> bytes:
        return self.metrics.scrape([((r, i.url), i) for r in ROLES
                                    for i in self.fleets[r].instances], self.stale_after)


class _Handler(RelayHandler):
    proxy: Proxy

    def do_GET(self) -> None:
        proxy = self.proxy
        if self.path == "/health":
            missing = proxy.missing()
            self.answer_json(503 if missing else 200, {"status": "ok"} if not missing else {
                "status": "no healthy " + " and no healthy ".join(
                    f"{r} instance" for r in missing)})
        elif self.path == "/metrics":
            self.relay_bytes(200, proxy.prometheus(), CONTENT_TYPE)
        elif self.path == "/lmc/pd-proxy":
            self.answer_json(200, proxy.state())
        elif self.path == "/v1/models":
            live = [i for i in proxy.decode.instances if i.healthy] or proxy.decode.instances
            self.relay_get(live[0].upstream, "decode instance")
        else:
            self.answer_error(404, f"no such path {self.path[:200]}")

    def do_POST(self) -> None:
        body = self.request_body()
        if body is None:
            return
        try:
            p_data = encode(prefill_body(body))
        except HttpError as e:
            self.answer_error(e.status, str(e))
            return
        proxy = self.proxy
        proxy.count("requests")
        tokens = prompt_tokens(body, proxy.tokenizer) if self.path == "/v1/completions" \
            else None
        salt = cache_salt(body)
        try:
            p, d = proxy.pick(tokens, salt)
        except HttpError as e:  # no healthy instance of a role
            self.answer_error(e.status, str(e))
            return
        self._held = {"prefill": p, "decode": d}
        self._tokens, self._salt = tokens, salt
        try:
            self._request(body, p_data)
        finally:
            for role, c in self._held.items():
                proxy.fleets[role].done(c.instance)

    def _connect(self, role: str, data: bytes) -> tuple[Upstream, Any, Any]:
        """Post ``data`` to the held ``role`` instance. One that refuses the connection
        (down since its last health check) is marked unhealthy and the request goes to
        another healthy one, once: nothing has reached the client yet. Raises
        :class:`HttpError` (502 naming the instance, 503 naming the role)."""
        proxy = self.proxy
        fleet = proxy.fleets[role]
        for attempt in (0, 1):
            c = self._held[role]
            up = c.instance.upstream
            try:
                conn, r = up.post(self.path, data)
            except UPSTREAM_ERRORS as e:
                proxy.metrics.failures.labels(role, up.url).inc()
                failed = HttpError(502, f"{role} instance {up.url}: {what(e)}")
                if not isinstance(e, ConnectionRefusedError):
                    raise failed from None
                if proxy.health is not None:  # else nothing would bring it back
                    fleet.mark(c.instance, False, what(e))
                if attempt:  # the second refusal: the role may have none left
                    if proxy.health is not None and not fleet.healthy():
                        raise HttpError(503, f"no healthy {role} instance left: {up.url} "
                                        f"and the one tried before refused the "
                                        f"connection") from None
                    raise failed from None
                try:
                    nxt = fleet.pick(self._tokens, self._salt, {up.url})
                except HttpError:
                    raise HttpError(503, f"no healthy {role} instance left: {up.url} "
                                    f"refused the connection") from None
                fleet.done(c.instance)
                self._held[role] = nxt
                proxy.count("retries")
                proxy.metrics.retries.labels(role).inc()
                continue
            proxy.sent(role, c, len(self._tokens or ()))
            return up, conn, r
        raise AssertionError("unreachable")

    def _request(self, body: dict[str, Any], p_data: bytes) -> None:
        try:
            params = self._prefill(p_data)
        except HttpError as e:
            self.proxy.count("prefill_failures")
            self.answer_error(e.status, str(e))
            return
        if params is _RELAYED:
            return
        if not params:
            _warn("prefill instance %s answered no kv_transfer_params (not a kv_producer?): "
                  "the decode instance prefills itself", self._held["prefill"].instance.url)
        self._decode(encode({**body, "kv_transfer_params": params}))

    def _prefill(self, data: bytes) -> Any:
        """The producer's parameters, or ``_RELAYED`` once its refusal went to the client."""
        limit = self.server.limits.max_body
        up, conn, r = self._connect("prefill", data)
        try:
            answer = read_bounded(r, limit, f"prefill instance {up.url}")
            if r.status != 200:  # the client sees the producer's refusal (a bad prompt, ...)
                if not 400 <= r.status < 600:
                    raise HttpError(502, f"prefill instance {up.url} answered status "
                                    f"{r.status}")
                self.proxy.count("prefill_failures")
                self.relay_bytes(r.status, answer, r.getheader("Content-Type"))
                return _RELAYED
            params = producer_params(r.status, answer, up.url)
            self.proxy.metrics.answered(("prefill", up.url), answer[-TAIL_BYTES:])
            return params
        except UPSTREAM_ERRORS as e:
            self.proxy.metrics.failures.labels("prefill", up.url).inc()
            raise HttpError(502, f"prefill instance {up.url}: {what(e)}") from None
        except HttpError:
            self.proxy.metrics.failures.labels("prefill", up.url).inc()
            raise
        finally:
            conn.close()

    def _decode(self, data: bytes) -> None:
        """Relay the consumer's answer as it comes (streamed or not)."""
        try:
            up, conn, r = self._connect("decode", data)
        except HttpError as e:
            self.proxy.count("decode_failures")
            self.answer_error(e.status, str(e))
            return
        try:
            tail = self.relay_answer(r, f"decode instance {up.url}", TAIL_BYTES)
            if tail is None:
                self.proxy.count("decode_failures")
                self.proxy.metrics.failures.labels("decode", up.url).inc()
            elif r.status == 200:
                self.proxy.metrics.answered(("decode", up.url), tail)
        finally:
            conn.close()


_RELAYED = object()


def register_cli(sub: Any) -> None:
    from lmc.cli_args import add_command, float_in, int_in
    p = add_command(sub, "pd-proxy", "prefill on a kv_producer, decode on a kv_consumer, "
                    "behind one /v1/completions", __doc__)
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a kv_producer instance: http://host:port[,events=tcp://host:port"
                   "[,replay=tcp://host:port]] (its KV events); repeat for several")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a kv_consumer instance, as --prefill; repeat for several")
    add_choice_args(p, None, "how to choose among several instances: the longest cached "
                    "prefix (events=) against load, or in turn (default: prefix if an "
                    "instance has events=, else round_robin)")
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
        choice = choice_from_args(args)
    except ValueError as e:
        print(f"lmc pd-proxy: {e}", file=sys.stderr)
        return 2
    try:
        proxy = Proxy(args.prefill, args.decode, args.host, args.port,
                      limits_from_args(args), args.upstream_timeout, **choice)
    except OSError as e:
        print(f"lmc pd-proxy: {listen_error(e, args.host, args.port)}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"lmc pd-proxy: {e}", file=sys.stderr)
        return 2
    proxy.httpd.access_log = getattr(args, "access_log", True)
    return proxy.run_until_signalled(
        f"pd-proxy at {proxy.url} ({proxy.policy}): prefill "
        f"{', '.join(i.url for i in proxy.prefill.instances)}; decode "
        f"{', '.join(i.url for i in proxy.decode.instances)}")
