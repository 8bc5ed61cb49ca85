"""Where the remote tier lives: URL → server addresses, TLS and credentials.

Accepted forms (Valkey speaks the same protocol, so ``valkey``/``valkeys`` are aliases)::

    redis://[user:password@]host[:port][/db][?query]        plain TCP
    rediss://...                                             TLS
    redis+cluster://[user:password@]host:port,host:port,...  Redis Cluster (seed nodes)
    rediss+cluster://...                                     Redis Cluster over TLS

The query string takes lmc's options of the tier (``connections``, ``ttl``...: taken out
before this module sees the URL) and redis-py's connection options (``ssl_ca_certs``,
``ssl_cert_reqs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname``...); any other
name is refused here, at start, with the closest known name (``?tll=1h``: did you mean
``ttl``?), not by every call later. Timeouts come from the lmc config (``remote_timeout``),
not from the URL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from redis.connection import Connection, SSLConnection, parse_url

# scheme -> (tls, cluster)
SCHEMES: dict[str, tuple[bool, bool]] = {
    "redis": (False, False), "rediss": (True, False),
    "valkey": (False, False), "valkeys": (True, False),
    "redis+cluster": (False, True), "rediss+cluster": (True, True),
    "valkey+cluster": (False, True), "valkeys+cluster": (True, True),
}
_IGNORED = ("socket_timeout", "socket_connect_timeout", "timeout", "retry_on_timeout",
            "retry_on_error", "max_connections", "health_check_interval", "protocol")
DEFAULT_PORT = 6379


@dataclasses.dataclass(frozen=True)
class RedisTarget:
    nodes: tuple[tuple[str, int], ...]   # the server, or the cluster's seed nodes
    cluster: bool
    tls: bool
    options: dict[str, Any]              # redis-py Connection keyword arguments
    display: str                         # the URL with the password masked

    @property
    def connection_class(self) -> type[Connection]:
        return SSLConnection if self.tls else Connection


def _mask(spec: str) -> str:
    parts = urlsplit(spec)
    if parts.password is None:
        return spec
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def _host_port(item: str, spec: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [ipv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise ValueError(f"remote_url {_mask(spec)!r}: empty host in {item!r}")
    try:
        return host, int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"remote_url {_mask(spec)!r}: bad port in {item!r}") from None


@functools.cache
def redis_py_options() -> frozenset[str]:
    """The keyword options redis-py's connections take (what a URL's query may pass on)."""
    names = {"db", "username", "password"}
    for cls in (Connection, SSLConnection):
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            with contextlib.suppress(TypeError, ValueError):
                names.update(n for n, p in inspect.signature(init).parameters.items()
                             if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                           p.KEYWORD_ONLY))
    return frozenset(names)


def _lmc_options() -> tuple[str, ...]:
    from .backend import RedisBackend  # at call time: the backend imports this module

    return tuple(RedisBackend.OPTIONS)


def check_query(spec: str, query: str) -> None:
    """Refuse a query option neither lmc nor redis-py takes, naming the closest of both."""
    known = redis_py_options() | set(_IGNORED)
    for name, _ in parse_qsl(query, keep_blank_values=True):
        if name in known:
            continue
        lmc_names = _lmc_options()
        near = difflib.get_close_matches(name, [*lmc_names, *sorted(known)], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"remote_url {_mask(spec)!r}: unknown option {name!r}{hint} (lmc's: "
                         f"{', '.join(lmc_names)}; or a redis-py connection option such as "
                         "ssl_ca_certs)")


def parse_target(spec: str) -> RedisTarget:
    """Parse a remote URL; ``ValueError`` names what is wrong (never the password)."""
    scheme, sep, rest = spec.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"remote_url {_mask(spec)!r}: scheme must be one of "
                         f"{', '.join(sorted(SCHEMES))}")
    tls, cluster = SCHEMES[scheme.lower()]
    base = "rediss" if tls else "redis"
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    items = [h for h in hosts.split(",") if h.strip()]
    if not items:
        raise ValueError(f"remote_url {_mask(spec)!r}: no host given")
    if len(items) > 1 and not cluster:
        raise ValueError(f"remote_url {_mask(spec)!r}: several hosts need a +cluster scheme "
                         f"(e.g. redis+cluster://{hosts})")
    nodes = tuple(_host_port(h, spec) for h in items)
    if query:
        check_query(spec, query)
    # redis-py parses credentials, db and the query options of a one-host URL
    one = f"{base}://{userinfo + '@' if userinfo else ''}{items[0].strip()}"
    one += f"/{path}" if path else ""
    one += f"?{query}" if query else ""
    try:
        opts = parse_url(one)
    except ValueError as e:
        raise ValueError(f"remote_url {_mask(spec)!r}: {e}") from None
    for k in ("host", "port", "connection_class", "path", *_IGNORED):
        opts.pop(k, None)
    if cluster and opts.get("db", 0) != 0:
        raise ValueError(f"remote_url {_mask(spec)!r}: Redis Cluster has only database 0")
    return RedisTarget(nodes, cluster, tls, opts, _mask(spec))
