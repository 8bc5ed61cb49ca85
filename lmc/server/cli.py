"""``lmc server``: every config key is also a flag (``--unix-socket``, ``--metrics-port``...),
generated from the schema so that a new key can never lack one. Flags win over
``LMC_SERVER_<KEY>`` variables, which win over the YAML file."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmc.server.config import ServerConfig

_MAPPINGS = {"quotas": ("--quota", "NS=SIZE", "a namespace's memory quota (repeatable)"),
             "cache": ("--cache", "KEY=VALUE", "a CacheConfig key for the storage (repeatable)")}
_LISTS = {"tokens": ("--tokens", "FILE:NS[,NS...]",
                     "a tenant token file and the namespaces it grants, or FILE:admin "
                     "(repeatable)")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file of server keys (configs/server/server.yaml)")
    for key, default, doc in ServerConfig.describe():
        if key in _MAPPINGS or key in _LISTS:
            flag, metavar, help_ = _MAPPINGS.get(key) or _LISTS[key]
            p.add_argument(flag, dest=key, action="append", metavar=metavar, help=help_)
            continue
        shown = "" if default is None else f" (default {default!r})"
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, metavar="VALUE",
                       help=f"{doc}{shown}")


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
    p = subparsers.add_parser("server", help="run the node-wide KV cache server daemon",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=_main)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmc.server", description=__doc__)
    add_arguments(p)
    return _main(p.parse_args(argv))
