"""The HTTP fronts the shared attack suite (``tests/http/test_attacks.py``) runs against, one
line each. A front is built in this process in front of an honest reference server (its
upstream; the reference server ignores it) and, for the flood at RLIMIT_NOFILE 128, started
as its own process from a command line that prints ``... at http://HOST:PORT`` once it
serves. Adding a front is one :class:`FrontSpec` line in :data:`FRONTS`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmc.http.json_api import HttpLimits
from lmc.reference import LLM
from lmc.reference.serve import Server
from lmc.router.app import InstanceSpec, Router
from lmc.router.pd_proxy import Proxy


@dataclass(frozen=True)
class FrontSpec:
    """How to run one front under attack.

    ``make(checkpoint, upstream_url, limits)`` returns the front, not yet serving: anything
    with ``serve_forever()``, ``close()``, ``port`` and ``httpd`` (its
    :class:`lmc.http.json_api.BoundedHTTPServer`). ``argv(checkpoint, upstream_url)`` is the
    ``python`` command line running it as a process (the suite appends the flags of
    :func:`lmc.http.json_api.add_limit_args`, which every front takes). ``alive(front)`` says whether what
    serves behind the socket still runs (the reference server's engine loop)."""

    name: str
    make: Callable[[Path, str, HttpLimits], Any]
    argv: Callable[[Path, str], list[str]]
    alive: Callable[[Any], bool] = lambda front: True


FRONTS = [
    FrontSpec("serve", lambda ckpt, up, lim: Server(LLM(ckpt, num_blocks=32), limits=lim),
              lambda ckpt, up: ["-m", "lmc.reference.serve", "--model", str(ckpt), "--port",
                                "0", "--num-blocks", "32"], alive=lambda s: s.loop.alive),
    FrontSpec("router", lambda ckpt, up, lim: Router([InstanceSpec(up)], limits=lim),
              lambda ckpt, up: ["-m", "lmc.cli", "router", "--port", "0", "--instance", up]),
    FrontSpec("pd-proxy", lambda ckpt, up, lim: Proxy([up], [up], limits=lim),
              lambda ckpt, up: ["-m", "lmc.cli", "pd-proxy", "--port", "0", "--prefill", up,
                                "--decode", up]),
]
