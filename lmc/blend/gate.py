"""``lmc blend-check``: ``lmc quality --feature blend`` under the name it had before the
quality harness judged every lossy KV feature; ``--ratios`` are its settings (default
0.15, 0.3, 0.5, 0.7, 0.85). See ``lmc quality --help`` and docs/quality.md.
Exit status: 0 when a ratio below 1 passed, 1 when none did, 2 bad input.
"""

from __future__ import annotations

import argparse
from typing import Any


def register_cli(sub: Any) -> None:
    from lmc.cli_args import add_command, int_in
    from lmc.quality.cli import add_arguments, main

    p = add_command(sub, "blend-check", "lmc quality --feature blend (the recompute ratios "
                    "as --ratios)", __doc__)
    add_arguments(p, settings_flag="--ratios")
    # the flags blend-check had before lmc quality, under their new names' meanings
    p.add_argument("--num-prompts", dest="questions", type=int_in(1, 1000),
                   help=argparse.SUPPRESS)
    p.add_argument("--tokens", dest="answer_tokens", type=int_in(1, 1024),
                   help=argparse.SUPPRESS)
    p.set_defaults(func=main, feature="blend", command="blend-check")
