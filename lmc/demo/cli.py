"""``lmc demo``'s flags."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmc.cli_args import int_in


def _cli(args: argparse.Namespace) -> int:
    import torch

    from lmc.demo.run import default_threads, run_demo

    torch.set_num_threads(args.threads or default_threads())
    try:
        run_demo(args.model, args.config, baseline=not args.no_baseline, rounds=args.rounds,
                 quick=args.quick, short=args.quick or args.short,
                 sliding_window=args.sliding_window)
    except BrokenPipeError:
        raise  # the reader went away (lmc demo | head): lmc.cli ends quietly
    except (ValueError, OSError) as e:
        print(f"lmc demo: {e}", file=sys.stderr)
        return 2
    return 0


def register_cli(sub: Any) -> None:
    from lmc.cli_args import add_command
    from lmc.demo import __doc__ as doc
    from lmc.demo.run import default_threads

    p = add_command(sub, "demo", "cold vs warm TTFT and answers on the built-in reference "
                    "engine", doc)
    p.add_argument("--model", metavar="DIR",
                   help="local HF checkpoint directory, or its config.json (default: "
                        "SmolLM2-135M-Instruct, converted on first use)")
    p.add_argument("--config", metavar="FILE",
                   help="lmc YAML config (default: configs/demo.yaml's values with a "
                        "temporary disk directory)")
    p.add_argument("--quick", action="store_true",
                   help="the random-weight demo model on a small workload (seconds)")
    p.add_argument("--short", action="store_true",
                   help="a shorter script: one chat of two rounds, one document question "
                        "(about a minute on the real model)")
    p.add_argument("--sliding-window", type=int_in(16, 1 << 20), default=None, metavar="W",
                   help="the random-weight demo model's hybrid twin: every other layer attends "
                        "to the last W tokens (lmc stores its KV per group)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the engine-alone requests (and so the speed-up)")
    p.add_argument("--threads", type=int_in(1, 4096), default=None, metavar="N",
                   help=f"torch threads for every engine (default: half the cores, here "
                        f"{default_threads()}), the same in every pass")
    p.add_argument("--rounds", type=int_in(1, 100), default=None, metavar="N",
                   help="interleaved rounds of no-lmc and warm-lmc requests behind the table's "
                        "two rows and the speed-up (default: 1 on the real model, 3 on the "
                        "random one)")
    p.set_defaults(func=_cli)
