"""What every ``lmc`` subcommand's parser shares: ``add_command`` (its ``--help`` from the
module's docstring) and the argparse types every numeric flag takes (``int_in``,
``float_in``, ``positive_int``), each refusing a bad value at the flag with what was given.

Why apart from :mod:`lmc.cli`: the subcommands (the daemon, the router, the planner, ...)
build their parsers with these, and :mod:`lmc.cli` imports the subcommands: with the helpers
there, every app would import the entry point above it (docs/design.md, the import ranks).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any


def help_text(doc: str | None) -> str:
    """A module docstring as ``--help`` prose: RST markup (``code``, **bold**) removed."""
    text = re.sub(r"``([^`]+)``", r"\1", doc or "")
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", text).strip()


MAX_WHOLE = 2**63 - 1  # what a C long holds: larger counts overflow far from the flag


def _whole(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:  # also: more than 4300 digits
        return None


def positive_int(text: str) -> int:
    """argparse type for counts: a whole number >= 1, refused with what was given."""
    n = _whole(text)
    if n is None:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    if not 1 <= n <= MAX_WHOLE:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 and <= {MAX_WHOLE}, "
                                         f"got {text}")
    return n


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """argparse type: a whole number in ``[lo, hi]``. Every numeric option takes one (or
    :func:`positive_int`, :func:`float_in`): a value past what the command can do is refused
    at the flag, not found later as an overflow, a hang or a silent default."""

    def parse(text: str) -> int:
        n = _whole(text)
        if n is None or not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"expected a whole number in [{lo}, {hi}], "
                                             f"got {text!r}")
        return n

    return parse


def float_in(lo: float, hi: float, *, low_open: bool = False) -> Callable[[str], float]:
    """argparse type: a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``low_open``)."""
    left = "(" if low_open else "["

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        if not (lo < x <= hi if low_open else lo <= x <= hi):  # NaN fails both
            raise argparse.ArgumentTypeError(f"expected a number in {left}{lo:g}, {hi:g}], "
                                             f"got {text!r}")
        return x

    return parse


def add_command(sub: Any, name: str, summary: str, doc: str | None) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` starts with ``doc`` (cleaned), paragraphs kept."""
    return sub.add_parser(name, help=summary, description=help_text(doc) or summary,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
