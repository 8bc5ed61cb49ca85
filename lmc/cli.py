"""The ``lmc`` command line. Subcommands live in the modules that implement them: each module in
``COMMAND_MODULES`` offers ``register_cli(subparsers)`` and sets ``func`` on its parser."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import importlib.util
import os
import sys
from typing import Any

from lmc.cli_args import add_command

# Each subcommand's module (it offers ``register_cli(subparsers)`` and sets ``func`` on its
# parser) and the one-line summary ``lmc --help`` lists. A module is imported only when its
# command runs: they pull in torch, and ``lmc --help`` should answer at once.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("lmc.demo", "cold vs warm TTFT and answers on the built-in reference engine"),
    "server": ("lmc.server.cli", "run the node-wide KV cache server daemon"),
    "stats": ("lmc.server.stats_cli", "print a running lmc server's statistics"),
    "cache": ("lmc.control_cli", "pin, prioritise, delete, clear or prefetch cached prompts "
              "of a running server, router or daemon"),
    "workload": ("lmc.workloads.cli", "write a workload trace (chat, prefix, docqa, rag, "
                 "sharegpt, agent)"),
    "replay": ("lmc.workloads.replay_cli", "replay a trace on the reference engine or an "
               "OpenAI-compatible server: TTFT, throughput, hits per tier"),
    "pd-proxy": ("lmc.router.pd_proxy", "prefill on a kv_producer, decode on a kv_consumer, "
                 "behind one /v1/completions"),
    "router": ("lmc.router.app", "route requests to the instance with the longest cached "
               "prefix (KV events), balanced against load"),
    "plan": ("lmc.planner.cli", "size the cache tiers for a trace: hit rate and predicted "
             "TTFT per configuration"),
    "quality": ("lmc.quality.cli", "judge a lossy KV feature (blending, a codec) on a model "
                "against exact KV; write its verdicts"),
    "blend-check": ("lmc.blend.gate", "lmc quality --feature blend (the recompute ratios as "
                    "--ratios)"),
    "model": ("lmc.models.cli", "get a real model's checkpoint (offline, from a package); "
              "list those converted"),
}
COMMAND_MODULES = tuple(dict.fromkeys(module for module, _ in COMMANDS.values()))


def _config(args: argparse.Namespace) -> int:
    from lmc.config_cli import run

    return run(args)


def _bench_runner() -> Any:
    """``benchmarks/run_all.py`` of the source checkout lmc runs from, or None: the
    benchmarks (and the tools they compare against) are not part of an installed package."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "run_all.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("lmc_bench_run_all", path)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look it up
    spec.loader.exec_module(mod)
    return mod


def _add_bench(sub: Any) -> None:
    runner = _bench_runner()
    b = add_command(sub, "bench", "run the core, disk, Redis, daemon and TTFT benchmarks "
                    "and print RESULTS.md-style tables",
                    runner.__doc__ if runner else "Needs a source checkout of lmc.")
    if runner is None:
        b.set_defaults(func=lambda _a: print(
            "lmc bench: the benchmarks are not installed with lmc; run it from a source "
            "checkout (benchmarks/run_all.py)", file=sys.stderr) or 2)
        return
    runner.add_arguments(b)
    b.set_defaults(func=runner.run)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``only``, just that subcommand is built in full and the
    others are listed by their summary without importing their modules."""
    p = argparse.ArgumentParser(prog="lmc", description="KV-cache middleware for LLM engines")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    from lmc import config_cli

    c = add_command(sub, "config", "validate a config (YAML + LMC_* env) and print it resolved",
                    config_cli.DOC)
    config_cli.add_arguments(c)
    c.set_defaults(func=_config)
    _add_bench(sub)
    registered: set[str] = set()
    for command, (name, summary) in COMMANDS.items():
        if only is not None and command != only:
            if importlib.util.find_spec(name) is not None:
                sub.add_parser(command, help=summary)  # listed; built when it runs
            continue
        if name in registered:
            continue
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not (name == e.name or name.startswith(f"{e.name}.")):
                raise  # the module exists but something it needs is missing
            continue
        mod.register_cli(sub)
        registered.add(name)
    return p


def main(argv: list[str] | None = None) -> int:
    """Ordinary ways out (Ctrl-C, a closed pipe such as ``lmc stats | head``) end with a
    line or silently, never a traceback."""
    try:
        parser = build_parser(only=_command(argv))
        _refuse_unknown_command(parser, _command(argv))
        args = _parse(parser, argv)
        if args.version:
            from lmc import __version__

            print(__version__)
            return 0
        if not getattr(args, "func", None):
            build_parser(only="").print_help()
            return 1
        return int(args.func(args))
    except KeyboardInterrupt:
        # the command's own cleanup has run (engines closed in its finally blocks); end here
        # with 130: Python's finalization after an interrupt sometimes ended the process by
        # SIGINT instead (rc -2, ~1 run in 10 of the demo's Ctrl-C test on a fresh clone)
        print(f"\nlmc {_command(argv)}: interrupted", file=sys.stderr)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(130)
    except ImportError as e:  # an optional package a setting needs: the message names its extra
        if "pip install" not in str(e):
            raise  # a broken install or a bug: the traceback is the useful part
        print(f"lmc {_command(argv)}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away: point stdout at /dev/null so the final flush is quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _refuse_unknown_command(parser: argparse.ArgumentParser, command: str) -> None:
    """A mistyped command (``lmc sever``) is refused naming the closest one: argparse alone
    lists every choice and leaves the reader to spot the typo."""
    if not command:
        return
    known = next((list(a.choices) for a in parser._actions
                  if isinstance(a, argparse._SubParsersAction)), [])
    if command in known:
        return
    near = difflib.get_close_matches(command, known, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    parser.error(f"unknown command {command!r}{hint}; commands: {', '.join(known)}")


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parse_args``, except that an unknown flag after a subcommand is reported by that
    subcommand's parser (its usage, the closest flag it has): argparse alone reports it from
    the top level, with ``lmc``'s usage, which lists no flag of ``lmc server``."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        target = _innermost(parser, args)
        flags = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
        first = next((e.split("=", 1)[0] for e in extra if e.startswith("--")), None)
        near = difflib.get_close_matches(first, flags, n=1, cutoff=0.6) if first else []
        hint = f" (did you mean {near[0]}?)" if near else ""
        target.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace
               ) -> argparse.ArgumentParser:
    """The parser of the (sub)command that ran: ``lmc workload chat``'s, not ``lmc``'s."""
    while True:
        chosen = next((a.choices[getattr(args, a.dest)] for a in parser._actions
                       if isinstance(a, argparse._SubParsersAction)
                       and getattr(args, a.dest, None) in a.choices), None)
        if chosen is None:
            return parser
        parser = chosen


def _command(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return next((a for a in args if not a.startswith("-")), "").strip()


if __name__ == "__main__":
    sys.exit(main())
