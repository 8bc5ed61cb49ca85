"""The ``lmc`` command line. Subcommands live in the modules that implement them: each module in
``COMMAND_MODULES`` offers ``register_cli(subparsers)`` and sets ``func`` on its parser."""

from __future__ import annotations

import argparse
import importlib
import sys

import yaml

COMMAND_MODULES = ("lmc.demo", "lmc.server.cli", "lmc.server.stats_cli")


def _config(args: argparse.Namespace) -> int:
    from lmc.config import CacheConfig

    if args.keys:
        for key, default, doc in CacheConfig.describe():
            print(f"{key:20s} default {default!r:12}  {doc}")
        return 0
    try:
        cfg = CacheConfig.load(args.config)
    except (ValueError, OSError) as e:
        print(f"lmc config: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(cfg.public_dict(), sort_keys=False).rstrip())  # secrets masked
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmc", description="KV-cache middleware for LLM engines")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("config", help="validate a config (YAML + LMC_* env) and print it resolved")
    c.add_argument("--config", help="YAML file (defaults only when omitted)")
    c.add_argument("--keys", action="store_true", help="list every key with its default")
    c.set_defaults(func=_config)
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not (name == e.name or name.startswith(f"{e.name}.")):
                raise  # the module exists but something it needs is missing
            continue
        mod.register_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.version:
        from lmc import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        build_parser().print_help()
        return 1
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
