"""Where the remote tier lives: URL → server addresses, TLS and credentials.

Accepted forms (Valkey speaks the same protocol, so ``valkey``/``valkeys`` are aliases)::

    redis://[user:password@]host[:port][/db][?query]        plain TCP
    rediss://...                                             TLS
    redis+cluster://[user:password@]host:port,host:port,...  Redis Cluster (seed nodes)
    rediss+cluster://...                                     Redis Cluster over TLS

The query string takes redis-py's connection options (``ssl_ca_certs``, ``ssl_cert_reqs``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname``...). Timeouts come from the lmc
config (``remote_timeout``), not from the URL.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit

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
