"""Which instance of a set gets a request: the choosing ``lmc router`` and ``lmc pd-proxy``
share (one :class:`Fleet` per set: the router's instances; the pd-proxy's prefill and its
decode instances).

An instance is ``URL[,events=ENDPOINT][,replay=ENDPOINT]`` (:class:`InstanceSpec`): its
KV events (vLLM's format; lmc's tiers with ``kv_events`` on) feed a
:class:`~lmc.router.index.PrefixIndex` through :class:`~lmc.router.feed.EventFeed`, which
the owner of the fleets runs (one thread for all). :meth:`Fleet.pick` scores the healthy
instances with :func:`lmc.router.policy.choose`: ``prefix`` weighs the prompt's cached
prefix per medium against requests in flight; an instance whose events are stale or absent
is credited nothing; ``round_robin`` takes turns. The prompt is known as token ids
(:func:`prompt_tokens`: ids as given, or text through a tokenizer); otherwise the least
loaded wins. Events can misroute a request, never fail it: the instance still answers it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmc.http.json_api import BoundedHTTPServer, HttpError, HttpLimits, printable
from lmc.router.feed import EventFeed, SaltedKeys, SharedSource, SharedSpec, Source, match_instance
from lmc.router.health import DEFAULT_INTERVAL, HealthChecks
from lmc.router.index import Match
from lmc.router.policy import POLICIES, Candidate, Weights, choose
from lmc.router.relay import TIMEOUT, Upstream

log = logging.getLogger(__name__)
MAX_PROMPT_TOKENS = 1 << 20


@dataclass(frozen=True)
class InstanceSpec:
    url: str
    events: str | None = None
    replay: str | None = None

    @classmethod
    def parse(cls, text: str, flag: str = "--instance") -> InstanceSpec:
        """``URL[,events=ENDPOINT][,replay=ENDPOINT]``; ``flag`` names the option in errors."""
        url, *opts = text.split(",")
        kw: dict[str, str] = {}
        for o in opts:
            k, eq, v = o.partition("=")
            if not eq or k not in ("events", "replay") or k in kw:
                raise ValueError(f"{flag} {text[:200]!r}: expected URL[,events=tcp://host:"
                                 f"port][,replay=tcp://host:port], got {o[:60]!r}")
            if not v.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{flag}: {k}={v[:80]!r} is not a tcp:// or ipc:// "
                                 f"endpoint")
            kw[k] = v
        if "replay" in kw and "events" not in kw:
            raise ValueError(f"{flag} {text[:200]!r}: replay= needs events=")
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


@dataclass
class Pick:
    instance: Instance
    reason: str  # prefix | load | stale | no_tokens | round_robin (lmc.router.policy)
    predicted: int  # prompt tokens the events say are cached there
    match: Match | None = None  # the events' view per medium (None: not known)


class Fleet:
    """A set of instances and the policy that chooses among them (module docstring)."""

    def __init__(self, specs: Sequence[InstanceSpec], *, policy: str = "prefix",
                 weights: Weights | None = None, upstream_timeout: float = TIMEOUT,
                 stale_after: float = 10.0, max_blocks: int = 1 << 21,
                 what: str = "instance", flag: str = "--instance",
                 unique: bool = True, shared: Sequence[SharedSpec] = ()) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if not 0 < upstream_timeout <= 86400:
            raise ValueError(f"upstream timeout must be in (0, 86400] s, got {upstream_timeout}")
        self.policy = policy
        self.weights = weights or Weights()
        self.stale_after = stale_after
        self.what = what
        self.instances = [Instance(s, upstream_timeout, max_blocks) for s in specs]
        if unique and len({i.url for i in self.instances}) < len(self.instances):
            raise ValueError(f"an {flag} URL is given twice")
        # shared stores (lmc server with kv_events): their prefixes count for their users
        self.shared = [SharedSource(s, max_blocks) for s in shared]
        self._lock = threading.Lock()
        self._turn = 0

    @property
    def sources(self) -> list[Source]:
        return [i.source for i in self.instances if i.source is not None] + \
            list(self.shared)

    def pick(self, tokens: Sequence[int] | None, salt: str | None,
             exclude: frozenset[str] | set[str] = frozenset()) -> Pick:
        """The instance for a prompt (token ids, or None if unknown), counted in flight
        (the caller calls :meth:`done`). A 503 if no healthy one is left."""
        keys = SaltedKeys(tokens, None, salt) if tokens is not None else None
        now = time.monotonic()
        with self._lock:
            live = [i for i in self.instances if i.healthy and i.url not in exclude]
            if not live:
                raise HttpError(503, f"no healthy {self.what} to send the request to"
                                + (" (the others failed it)" if exclude else ""))
            cands = []
            for inst in live:
                m = None if keys is None else match_instance(
                    inst.url, inst.source, self.shared, keys, self.stale_after, now)
                cands.append(Candidate(inst.in_flight, m))
            c = choose(cands, None if tokens is None else len(tokens), self.weights,
                       self._turn, self.policy)
            self._turn += 1
            inst = live[c.index]
            inst.in_flight += 1
        return Pick(inst, c.reason, min(c.match.tokens(), len(tokens or ())),
                    c.match if tokens is not None else None)

    def done(self, inst: Instance) -> None:
        with self._lock:
            inst.in_flight -= 1

    def mark(self, inst: Instance, healthy: bool, why: str = "") -> None:
        """Set ``inst``'s health (its checks: :mod:`lmc.router.health`); a change is one INFO
        line naming it and why (the instance's words escaped: it may lie)."""
        with self._lock:
            changed, inst.healthy = inst.healthy != healthy, healthy
        if changed:
            log.info("%s %s is %s%s", self.what, inst.url,
                     "healthy again" if healthy else "unhealthy",
                     f": {printable(why, 160)}" if why else "")

    def healthy(self) -> int:
        """How many instances are healthy now."""
        return sum(i.healthy for i in self.instances)

    def state(self, now: float | None = None) -> list[dict[str, Any]]:
        """Each instance: health, load and what its events say (for ``GET /lmc/...``)."""
        now = time.monotonic() if now is None else now
        out = []
        for i in self.instances:
            s = i.source
            out.append({"url": i.url, "healthy": i.healthy, "in_flight": i.in_flight,
                        "events": None if s is None else {
                            "endpoint": s.endpoint, "synced": s.synced,
                            "fresh": s.fresh(self.stale_after, now),
                            "blocks": s.index.blocks, **s.counts, **s.index.counts}})
        return out


class Front:
    """What both fronts are besides their fleets: the bounded HTTP server (each client
    connection holds one upstream connection at a time), one event feed for all their
    instances' sources and the health checks of all their instances."""

    httpd: BoundedHTTPServer
    feed: EventFeed | None = None
    health: HealthChecks | None = None
    port: int
    url: str

    def check_health(self, fleets: Sequence[Fleet], interval: float | None,
                     name: str) -> None:
        """Probe every instance of ``fleets`` every ``interval`` s (None: never; the
        instances are then taken as healthy whatever happens)."""
        if interval is not None:
            self.health = HealthChecks(fleets, interval, name).start()

    def listen(self, handler: type, host: str, port: int, limits: HttpLimits | None,
               sources: Sequence[Source], stale_after: float) -> None:
        self.httpd = BoundedHTTPServer((host, port), handler, limits or HttpLimits(),
                                       fds_per_connection=2)
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        try:
            self.feed = EventFeed(sources, stale_after) if sources else None
        except BaseException:
            self.httpd.server_close()
            raise
        if self.feed is not None:
            self.feed.start()

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        if self.health is not None:
            self.health.close()
        self.httpd.shutdown()
        self.httpd.close_all()
        self.httpd.server_close()
        if self.feed is not None:
            self.feed.close()

    def run_until_signalled(self, banner: str) -> int:
        """Serve, print ``banner`` (the line scripts wait for), stop at SIGTERM/SIGINT."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        threading.Thread(target=self.serve_forever, name="http", daemon=True).start()
        print(banner, flush=True)
        stop.wait()
        self.close()
        return 0


def add_choice_args(p: Any, policy_default: str | None, policy_help: str) -> None:
    """The flags of the choosing, the same in ``lmc router`` and ``lmc pd-proxy``."""
    from lmc.cli_args import float_in, int_in
    p.add_argument("--policy", choices=POLICIES, default=policy_default, help=policy_help)
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
    p.add_argument("--stale-after", type=float_in(0.5, 86400), default=10.0, metavar="SECONDS",
                   help="events silent this long are not trusted")
    p.add_argument("--max-blocks", type=int_in(1, 1 << 28), default=1 << 21,
                   help="blocks remembered per instance")
    p.add_argument("--health-interval", type=float_in(0.1, 3600), default=DEFAULT_INTERVAL,
                   metavar="SECONDS", help="GET /health of each instance this often; one "
                   "that fails it gets no requests until it answers again")


def choice_from_args(args: Any) -> dict[str, Any]:
    """Keywords of :class:`Fleet` (and ``tokenizer``) from :func:`add_choice_args`' flags; a
    tokenizer that cannot be loaded is a ``ValueError`` naming the file."""
    tokenizer = None
    if args.tokenizer:
        try:
            from lmc.reference.tokenizer import Tokenizer
            tokenizer = Tokenizer(args.tokenizer)
        except Exception as e:  # missing file, no `tokenizers`, not a tokenizer.json
            raise ValueError(f"--tokenizer {args.tokenizer}: {str(e)[:200]}") from None
    return {"policy": args.policy, "stale_after": args.stale_after,
            "max_blocks": args.max_blocks, "tokenizer": tokenizer,
            "health_interval": args.health_interval,
            "weights": Weights(args.weight_gpu, args.weight_cpu, args.weight_storage,
                               args.load_weight)}


def prompt_tokens(body: dict[str, Any], tokenizer: Any = None) -> list[int] | None:
    """The prompt's token ids if they can be known: ids as given (one prompt, at most
    :data:`MAX_PROMPT_TOKENS`, each a uint32), or text through ``tokenizer``. A malformed
    prompt is left for the instance to refuse in its own words."""
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
        except Exception:  # a prompt the tokenizer cannot take: the instance says why
            return None
    return None


def cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and len(salt) <= 1024 else None
