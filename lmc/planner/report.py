"""What the planner tells an operator: a table, the knee, the smallest configuration that
reaches a target hit rate, and a plot.

"Smallest" orders configurations by L1 bytes first (host DRAM in every engine process is the
dearest tier), then remote bytes, then disk bytes. The knee of a hit-rate curve over L1 size
is the point farthest above the straight line joining the curve's ends (sizes on a log
scale): past it, each doubling of L1 buys clearly less than before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmc import units
from lmc.planner.costmodel import Profile
from lmc.planner.keys import KeyedTrace
from lmc.planner.sim import TIERS, GridPoint, SimResult


@dataclass
class Row:
    point: GridPoint
    hit: dict[str, float]  # per tier: loaded tokens / prompt tokens
    hit_total: float
    ttft_mean: float | None
    ttft_p95: float | None
    saved_mean: float | None  # baseline (no cache) mean TTFT minus predicted
    sim_s: float

    def to_json(self) -> dict[str, Any]:
        return {"l1_bytes": self.point.l1, "disk_bytes": self.point.disk,
                "remote_bytes": self.point.remote, "policy": self.point.policy,
                "hit_rate": {"total": self.hit_total, **self.hit},
                "ttft_mean_s": self.ttft_mean, "ttft_p95_s": self.ttft_p95,
                "ttft_saved_mean_s": self.saved_mean, "sim_seconds": self.sim_s}


def rows(results: Sequence[SimResult], trace: KeyedTrace, profile: Profile | None,
         step_tokens: int = 0) -> tuple[list[Row], float | None]:
    """One row per result, and the no-cache mean TTFT (``None`` without a profile), for an
    engine computing at most ``step_tokens`` positions a step (chunked prefill; 0: none)."""
    n = as_numpy(trace.num_tokens)
    base = (float(np.mean(profile.compute_s(0, n, step_tokens)))
            if profile is not None and len(n) else None)
    out = []
    for r in results:
        hit = {t: r.hit_rate(t) for t in TIERS if t in r.hit_tokens}
        mean = p95 = saved = None
        if profile is not None and len(n):
            ttft = profile.ttft_s(n, {t: as_numpy(a) for t, a in r.per_request.items()},
                                  step_tokens=step_tokens)
            mean, p95 = float(np.mean(ttft)), float(np.percentile(ttft, 95))
            saved = base - mean if base is not None else None
        out.append(Row(r.point, hit, r.hit_rate(), mean, p95, saved, r.seconds))
    return out, base


def step_budget(step_tokens: int) -> str:
    """The line naming the per-step token budget the TTFT column was predicted for."""
    if step_tokens <= 0:
        return ("chunked prefill: none (--step-tokens 0): each prompt's rest computed in one "
                "step")
    return (f"chunked prefill: {step_tokens:,} tokens per step (--step-tokens): a load hides "
            "under the first step only")


def as_numpy(a: Any) -> np.ndarray:
    """An ``array('l')`` as int64 without a Python-level copy."""
    return np.frombuffer(a, dtype=np.dtype(f"i{a.itemsize}")).astype(np.int64, copy=False)


def _size(n: int) -> str:
    return "-" if n == 0 else units.size_exact(n) if n % (1 << 20) == 0 else units.size(n)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _secs(x: float | None) -> str:
    return "-" if x is None else units.seconds(x)


def format_table(table: Sequence[Row], base: float | None,
                 knees: AbstractSet[GridPoint] = frozenset()) -> str:
    tiers = [t for t in TIERS if any(t in r.hit for r in table)]
    head = ["policy", "L1", "disk", "remote", *[f"hit {t}" for t in tiers], "hit total",
            "TTFT mean", "TTFT p95", "saved"]
    lines = [head]
    for r in table:
        policy = r.point.policy if (r.point.disk or r.point.remote) else "(L1 only)"
        lines.append([policy, _size(r.point.l1), _size(r.point.disk), _size(r.point.remote),
                      *[_pct(r.hit.get(t, 0.0)) for t in tiers],
                      _pct(r.hit_total) + (" <knee" if r.point in knees else ""),
                      _secs(r.ttft_mean), _secs(r.ttft_p95), _secs(r.saved_mean)])
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                      enumerate(zip(x, widths))) for x in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    if base is not None:
        text.append(f"no cache: TTFT mean {units.seconds(base)} (every prompt token computed)")
    return "\n".join(text)


def series(table: Sequence[Row]) -> dict[tuple[int, int, str], list[Row]]:
    """Rows grouped by everything but L1 size, each sorted by L1 size."""
    out: dict[tuple[int, int, str], list[Row]] = {}
    for r in table:
        out.setdefault((r.point.disk, r.point.remote, r.point.policy), []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r.point.l1)
    return out


def knee(curve: Sequence[Row]) -> Row | None:
    """The knee of hit rate over L1 size (see the module doc); None under 3 points."""
    if len(curve) < 3:
        return None
    x = np.log2([max(r.point.l1, 1) for r in curve])
    y = np.array([r.hit_total for r in curve])
    if x[-1] == x[0] or y[-1] - y[0] < 0.01:  # flat (under a point gained): no knee
        return None
    xs, ys = (x - x[0]) / (x[-1] - x[0]), (y - y[0]) / (y[-1] - y[0])
    gain = ys - xs  # height above the chord
    i = int(np.argmax(gain))
    return curve[i] if gain[i] > 1e-9 else None


def smallest_reaching(table: Sequence[Row], target: float) -> Row | None:
    ok = [r for r in table if r.hit_total >= target]
    return min(ok, key=lambda r: (r.point.l1, r.point.remote, r.point.disk,
                                  r.point.policy)) if ok else None


def describe(r: Row) -> str:
    parts = [f"L1 {_size(r.point.l1)}"]
    if r.point.disk:
        parts.append(f"disk {_size(r.point.disk)}")
    if r.point.remote:
        parts.append(f"remote {_size(r.point.remote)}")
    if r.point.disk or r.point.remote:
        parts.append(r.point.policy)
    ttft = f", predicted TTFT mean {units.seconds(r.ttft_mean)}" if r.ttft_mean else ""
    return f"{', '.join(parts)}: hit rate {_pct(r.hit_total)}{ttft}"


def plot(table: Sequence[Row], path: str | Path, title: str = "") -> Path:
    """Hit rate and predicted mean TTFT over L1 size, one line per (disk, remote, policy),
    knees marked. Needs matplotlib (the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("lmc plan --plot needs matplotlib: pip install "
                          "'lmc-kvcache[plot]'") from None
    groups = series(table)
    has_ttft = any(r.ttft_mean is not None for r in table)
    fig, axes = plt.subplots(2 if has_ttft else 1, 1, figsize=(7.5, 7 if has_ttft else 4),
                             sharex=True, squeeze=False)
    ax_hit = axes[0][0]
    for (disk, remote, policy), curve in groups.items():
        label = "L1 only" if not (disk or remote) else ", ".join(
            [f"disk {_size(disk)}"] * bool(disk) + [f"remote {_size(remote)}"] * bool(remote)
            + [policy])
        xs = [r.point.l1 / 2**30 for r in curve]
        line, = ax_hit.plot(xs, [100 * r.hit_total for r in curve], marker="o", label=label)
        k = knee(curve)
        if k is not None:
            ax_hit.plot([k.point.l1 / 2**30], [100 * k.hit_total], marker="*", markersize=16,
                        color=line.get_color(), markeredgecolor="black", linestyle="none")
            ax_hit.annotate(f"knee: {_size(k.point.l1)}", (k.point.l1 / 2**30,
                            100 * k.hit_total), textcoords="offset points", xytext=(8, -14),
                            fontsize=8)
        if has_ttft:
            axes[1][0].plot(xs, [1e3 * (r.ttft_mean or math.nan) for r in curve], marker="o",
                            color=line.get_color(), label=label)
            if k is not None and k.ttft_mean is not None:
                axes[1][0].plot([k.point.l1 / 2**30], [1e3 * k.ttft_mean], marker="*",
                                markersize=16, color=line.get_color(),
                                markeredgecolor="black", linestyle="none")
    ax_hit.set_ylabel("hit rate (% of prompt tokens loaded)")
    ax_hit.set_ylim(0, 100)
    ax_hit.grid(alpha=0.3)
    ax_hit.legend(fontsize=8)
    if title:
        ax_hit.set_title(title, fontsize=10)
    bottom = axes[-1][0]
    if has_ttft:
        axes[1][0].set_ylabel("predicted mean TTFT (ms)")
        axes[1][0].grid(alpha=0.3)
    bottom.set_xscale("log", base=2)
    sizes = sorted({r.point.l1 for r in table})
    bottom.set_xticks([x / 2**30 for x in sizes], [_size(x) for x in sizes])
    bottom.minorticks_off()
    bottom.set_xlabel("L1 size (CPU pool per engine)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
