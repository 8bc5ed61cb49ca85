"""Run the node-wide KV cache server: the engines of a host share it as their remote tier.

Every setting is a flag, an LMC_SERVER_<KEY> environment variable and a key of the YAML file
given with --config (configs/server/server.yaml lists them all with their defaults); flags
win over variables, which win over the file. Sizes take 512MB, 4GiB or bytes; booleans
true/false. It binds its ports first, then builds (and pre-faults) its memory pool, then
serves until SIGTERM or Ctrl-C, when it drains in-flight requests and flushes its disk tier.
"""

# Why the flags are generated from ServerConfig's schema: a new key can never lack one.

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmc.server.server_config import ServerConfig

_MAPPINGS = {"quotas": ("--quota", "NS=SIZE", "a namespace's memory quota (repeatable)"),
             "cache": ("--cache", "KEY=VALUE", "a CacheConfig key for the storage (repeatable)")}
_LISTS = {"tokens": ("--tokens", "FILE:NS[,NS...]",
                     "a tenant token file and the namespaces it grants, or FILE:admin "
                     "(repeatable)")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE",
                   help="YAML file of server keys (configs/server/server.yaml)")
    for key, default, doc in ServerConfig.describe():
        if key in _MAPPINGS or key in _LISTS:
            flag, metavar, help_ = _MAPPINGS.get(key) or _LISTS[key]
            p.add_argument(flag, dest=key, action="append", metavar=metavar, help=help_)
            continue
        shown = "" if default is None else f" (default {_shown(default)})"
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, metavar=metavar_for(key, default,
                                                                                  doc),
                       help=f"{doc}{shown}")


_METAVARS = {"host": "ADDR", "metrics_host": "ADDR", "unix_socket": "PATH", "disk": "DIR",
             "token": "TOKEN", "redis": "URL", "unix_socket_mode": "MODE",
             "log_level": "{DEBUG,INFO,WARNING,ERROR}", "eviction_policy": "{lru,fifo}"}


def metavar_for(key: str, default: Any, doc: str) -> str:
    """What a flag's value looks like: named for the key's kind, never a bare VALUE."""
    if key in _METAVARS:
        return _METAVARS[key]
    if isinstance(default, bool):
        return "{true,false}"
    if key == "port" or key.endswith("_port"):
        return "PORT"
    if key.endswith(("_file", "_dir")):
        return "PATH"
    if doc.startswith("seconds"):
        return "SECONDS"
    if key == "size" or key.endswith("_size") or key.startswith(("max_meta", "max_payload",
                                                                  "max_value", "quota")):
        return "SIZE"
    if isinstance(default, int) or key.startswith("max_") or key.endswith("_threads"):
        return "N"
    return key.upper()


def _shown(default: Any) -> str:
    return str(default).lower() if isinstance(default, bool) else str(default)


def _pairs(items: list[str], flag: str) -> dict[str, Any]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[k] = v
    return out


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    overrides: dict[str, Any] = {}
    for key in ServerConfig.field_names():
        v = getattr(args, key, None)
        if v is None:
            continue
        overrides[key] = _pairs(v, _MAPPINGS[key][0]) if key in _MAPPINGS else v
    return ServerConfig.load(args.config, overrides=overrides)


def _main(args: argparse.Namespace) -> int:
    from lmc.server.daemon import run

    try:
        config = config_from_args(args)
    except (ValueError, OSError) as e:
        print(f"lmc server: {e}", file=sys.stderr)
        return 2
    return run(config)


def register_cli(subparsers: Any) -> None:
    from lmc.cli_args import add_command

    p = add_command(subparsers, "server", "run the node-wide KV cache server daemon", __doc__)
    add_arguments(p)
    p.set_defaults(func=_main)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmc.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    try:
        return _main(p.parse_args(argv))
    except KeyboardInterrupt:  # before the signal handlers exist (building the pool)
        print("\nlmc server: interrupted", file=sys.stderr)
        return 130
