"""A replay's results for people: a progress line, a table, and a PNG plot.

Figures an operator compares (TTFT percentiles, throughput, the share of prompt tokens each
tier supplied) are printed in the units ``lmc stats`` uses (``lmc.units``). A figure the
target could not report is printed as "unknown" with the reason, never as zero.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from lmc import units
from lmc.storage.funnel_report import format_funnel
from lmc.workloads.replay import ReplayResult, RequestRecord, percentile

PLOT_EXTRA = "pip install 'lmc-kvcache[plot]'"


class ProgressBar:
    """One stderr line redrawn in place on a terminal; on a pipe, a line every 10%. Each line
    gives the time left (ETA). With a concurrency cap, by Little's law: the requests left
    times the median latency so far, over the requests that run at once (``parallel``: the
    cap, or fewer sessions, whose turns run one after another). Why not the pace so far
    (elapsed over finished, times the requests left): the first answer comes after one
    latency while ``parallel`` requests ran, so that pace said 5m 18s where 1m 33s was left
    (the README's replay, 4 at once). Without a cap (every request may be queued at once,
    and a latency is mostly queueing) the pace is all there is. In timed mode the ETA is
    never less than the time until the trace's last arrival."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 28,
                 last_arrival_s: float | None = None, parallel: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.failed = 0
        self.ttfts: list[float] = []
        self.latencies: list[float] = []
        self._last_decile = -1
        self.last_arrival_s = last_arrival_s
        self.parallel = parallel
        self.clock = clock
        self.started = clock()

    def start(self) -> None:
        """The replay's clock starts now (after the engine is loaded)."""
        self.started = self.clock()

    def eta(self, finished: int, total: int) -> float | None:
        """Seconds left, or None before the first request finished."""
        if finished <= 0:
            return None
        elapsed = self.clock() - self.started
        left_n = total - finished
        if self.latencies and self.parallel:
            at_once = max(1, min(self.parallel, left_n))
            left = left_n * statistics.median(self.latencies) / at_once
        else:  # no latency known (every answer failed) or no cap known: the pace so far
            left = elapsed / finished * left_n
        if self.last_arrival_s is not None:
            left = max(left, self.last_arrival_s - elapsed)
        return max(0.0, left)

    def __call__(self, rec: RequestRecord, finished: int, total: int) -> None:
        if not rec.ok:
            self.failed += 1
        elif rec.ttft_s is not None:
            self.ttfts.append(rec.ttft_s)
        if rec.ok and rec.latency_s is not None:
            self.latencies.append(rec.latency_s)
        decile = 10 * finished // max(1, total)
        if not self.tty and decile == self._last_decile and finished != total:
            return
        self._last_decile = decile
        fill = self.width * finished // max(1, total)
        p50 = percentile(self.ttfts, 0.5)
        eta = self.eta(finished, total)
        line = (f"replay [{'#' * fill}{'.' * (self.width - fill)}] {finished}/{total}"
                f"  TTFT p50 {units.seconds(p50) if p50 is not None else '-'}"
                + (f"  failed {self.failed}" if self.failed else "")
                + (f"  ETA {units.seconds(eta)}" if eta is not None and finished < total
                   else f"  took {units.seconds(self.clock() - self.started)}"
                   if finished == total else ""))
        end = "\n" if finished == total or not self.tty else ""
        self.stream.write(("\r\033[K" if self.tty else "") + line + end)
        self.stream.flush()


def _fmt_s(x: float | None) -> str:
    return units.seconds(x) if x is not None else "-"


def _count(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:,.0f}"


def format_report(res: ReplayResult, trace: str = "") -> str:
    ok, failed = res.ok, res.failed
    dur = max(res.duration_s, 1e-9)
    mode = "at the trace's arrival times" if res.mode == "timed" else "as fast as possible"
    lines = [f"replay{' of ' + trace if trace else ''} on {res.target}, {mode}"]
    if res.interrupted:
        lines.append(f"interrupted: the {len(res.records)} of {res.total_requests} requests "
                     "that finished")
    lines.append("")
    rows: list[tuple[str, str]] = [
        ("requests", f"{len(ok)} ok, {len(failed)} failed, {units.seconds(res.duration_s)}"),
    ]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    rows.append(("TTFT", "  ".join(f"p{q} {_fmt_s(percentile(ttfts, q / 100))}"
                                   for q in (50, 95, 99))
                 + (f"  mean {_fmt_s(sum(ttfts) / len(ttfts))}" if ttfts else "")))
    prompt = res.prompt_tokens
    thr = f"{len(ok) / dur:.2f} req/s, {_count(res.output_tokens / dur)} output tok/s"
    if prompt is not None:
        thr += f", {_count(prompt / dur)} prompt tok/s"
    rows.append(("throughput", thr))
    rows.append(("prompt tokens", f"{prompt:,}" if prompt is not None else
                 "unknown (the server reported no usage)"))
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if ok and len(cached) == len(ok) and prompt:
        rows.append(("not computed", units.ratio(sum(cached), prompt)
                     + "  (reported per request by the target)"))
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    lines += ["", f"lmc hits by tier (prompt tokens supplied; {res.tier_source})"]
    if res.tier_tokens is None:
        lines.append("  unknown")
    elif not res.tier_tokens:
        lines.append("  none")
    else:
        for tier, n in res.tier_tokens.items():
            share = units.ratio(n, prompt) if prompt else f"{n:,.0f} tokens"
            lines.append(f"  {tier:<12}{share}")
    if res.blend_tokens is not None:  # segment reuse, next to the prefix hits above
        share = units.ratio(res.blend_tokens, prompt) if prompt else \
            f"{res.blend_tokens:,.0f} tokens"
        lines.append(f"  {'blended':<12}{share} (segments reused anywhere in the prompt; "
                     f"{res.blend_recomputed or 0:,.0f} of their tokens recomputed)")
    if res.load_failures is not None:
        lines.append(f"  {'load fails':<12}{res.load_failures:,.0f} (the engine recomputed "
                     "those tokens)")
    if res.funnel is not None:
        lines += format_funnel(res.funnel)
    if failed:
        lines += ["", f"failed requests ({len(failed)}):"]
        for r in failed[:5]:
            lines.append(f"  {r.request_id}: {r.error}")
        if len(failed) > 5:
            lines.append(f"  ... and {len(failed) - 5} more")
    return "\n".join(lines)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        from lmc.storage.integrity import MissingPackage

        raise MissingPackage(f"--plot needs matplotlib: {PLOT_EXTRA}") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def check_plot_available() -> None:
    """Raise the install hint before a long replay rather than after it."""
    _pyplot()


def plot(res: ReplayResult, path: str, title: str = "") -> None:
    """PNG: TTFT of each request over the replay (failures marked), and the cumulative
    share of prompt tokens each lmc tier supplied."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ok = [r for r in res.ok if r.ttft_s is not None]
    ax1.scatter([r.due_s for r in ok], [r.ttft_s for r in ok], s=10, label="TTFT")
    failed = res.failed
    if failed:
        ax1.scatter([r.due_s for r in failed], [0] * len(failed), marker="x", color="red",
                    label=f"failed ({len(failed)})")
    p50 = res.ttft_percentile(0.5)
    if p50 is not None:
        ax1.axhline(p50, color="gray", linestyle="--", linewidth=1,
                    label=f"p50 {units.seconds(p50)}")
    ax1.set_ylabel("TTFT (s)")
    ax1.set_title(title or f"replay on {res.target}")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.grid(alpha=0.3)

    if res.tier_tokens is None:
        ax2.text(0.5, 0.5, f"per-tier hits {res.tier_source}", ha="center", va="center",
                 wrap=True, transform=ax2.transAxes)
    elif len(res.timeline) < 2:
        ax2.text(0.5, 0.5, "no lmc tiers", ha="center", va="center", transform=ax2.transAxes)
    else:
        times = [t for t, _, _ in res.timeline]
        tiers = sorted({k for _, _, d in res.timeline for k in d})
        total = [0.0] * len(times)
        for tier in tiers:
            share = [d.get(tier, 0.0) / p if p else 0.0 for _, p, d in res.timeline]
            total = [a + b for a, b in zip(total, share)]
            ax2.step(times, share, where="post", label=tier)
        ax2.step(times, total, where="post", color="black", linewidth=1, linestyle="--",
                 label="all tiers")
        ax2.set_ylim(0, max(1.0, max(total) * 1.05))
    per_req = [(r.due_s, r.cached_tokens / r.prompt_tokens) for r in ok
               if r.cached_tokens is not None and r.prompt_tokens]
    if per_req:  # what each request itself was spared, where the target reports it
        ax2.scatter([x for x, _ in per_req], [y for _, y in per_req], s=8, color="gray",
                    alpha=0.6, label="per request (not computed)")
        ax2.set_ylim(0, max(1.0, ax2.get_ylim()[1]))
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(loc="upper left", fontsize=8)
    ax2.set_ylabel("hit rate (tiers: cumulative)")
    ax2.set_xlabel("seconds since the start of the replay (request due time)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
