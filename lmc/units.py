"""Numbers for people: byte sizes, durations and rates as an operator reads them.

Why one module: ``lmc config``, ``lmc stats`` and the demo print the same kinds of figures,
and a size shown as ``4294967296`` in one place and ``4 GiB`` in another makes people
compare by eye. Sizes that a config file would accept are printed in a form it accepts again
(``2GiB``, ``500MB``), so ``lmc config`` output is itself a valid config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lmc.settings import parse_size

_IEC = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_SI = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def size_exact(n: int) -> str:
    """``n`` bytes in the largest unit that divides it (``2GiB``, ``500MB``, ``123B``):
    exact, and parseable again as a config size."""
    if n == 0:
        return "0"
    for units in (_IEC, _SI):
        for name, mult in units:
            if n % mult == 0:
                return f"{n // mult}{name}"
    return f"{n}B"


def size(n: float) -> str:
    """``n`` bytes to three significant figures in IEC units: ``3.73 GiB``, ``812 B``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for name, mult in _IEC:
        if n >= mult:
            return f"{sign}{_sig3(n / mult)} {name}"
    return f"{sign}{int(n)} B"


def rate(bytes_per_s: float) -> str:
    return f"{size(bytes_per_s)}/s"


def seconds(s: float) -> str:
    """A duration: ``850 us``, ``12.5 ms``, ``3.20 s``, ``2h 05m``, ``3d 04h``."""
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{_sig3(s * 1e3)} ms"
    if s < 60:
        return f"{_sig3(s)} s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h:02d}h"
    if h:
        return f"{h}h {m:02d}m"
    return f"{m}m {sec:02d}s"


def seconds_exact(s: float) -> str:
    """A duration a config accepts again: ``500ms``, ``1.5s``, ``60s``."""
    if 0 < s < 1 and float(s * 1000).is_integer():
        return f"{int(s * 1000)}ms"
    return f"{s:g}s"


def ratio(part: float, whole: float) -> str:
    """``part/whole`` as a percentage with its denominator: ``93.8% (15/16)``."""
    if not whole:
        return f"- (0/{_num(whole)})"
    return f"{100 * part / whole:.1f}% ({_num(part)}/{_num(whole)})"


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.3g}"


def _sig3(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def readable_settings(cfg: Any) -> dict[str, Any]:
    """A settings object's public values with sizes and durations in config units.

    A field is a size when its default is a size string (``"1GiB"``) and a duration when its
    one-line doc starts with "seconds"; every other value is shown as it is."""
    out = cfg.public_dict()
    for f in dataclasses.fields(cfg):
        v = out.get(f.name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if isinstance(v, int) and _is_size_default(f.default):
            out[f.name] = size_exact(v)
        elif str(f.metadata.get("doc", "")).startswith("seconds"):
            out[f.name] = seconds_exact(v)
    return out


def _is_size_default(default: Any) -> bool:
    if not isinstance(default, str) or default.strip().isdigit():
        return False
    try:
        parse_size(default, "default")
    except ValueError:
        return False
    return True
