"""What the demo prints after its passes: the table, where each lmc pass's computed tokens
come from, the answers, and the headline speed-up (read from the table's own two rows)."""

from __future__ import annotations

from dataclasses import dataclass

from lmc.demo.passes import PassResult, Turn


def pct(q: float, xs: list[float]) -> float:
    """Percentile with linear interpolation between the two nearest samples."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def loaded_tokens(r: PassResult, tiers: list[str]) -> float:
    return sum(r.stats.get(f"worker.tokens_from_{t}", 0) for t in tiers)


def row_name(r: PassResult) -> str:
    """The pass's name, with ``x3`` when its row is the mean of 3 interleaved rounds."""
    return r.name + (f" x{len(r.rounds)}" if len(r.rounds) > 1 else "")


def format_table(results: list[PassResult], tiers: list[str]) -> str:
    """One row per pass. A row of several rounds shows one round's tokens and bytes (their
    mean) and the TTFT percentiles of all its requests."""
    mib = 1 << 20
    head = (f"{'pass':<28}{'TTFT p50':>10}{'TTFT p95':>10}{'prompt tok':>12}"
            + "".join(f"{'from ' + t:>11}" for t in tiers)
            + f"{'computed':>10}{'KV loaded':>11}{'KV saved':>10}{'disk I/O':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        s, n, k = r.stats, max(1, r.prompt_tokens), max(1, len(r.rounds))
        from_tier = [s.get(f"worker.tokens_from_{t}", 0) for t in tiers]
        computed = n - sum(from_tier)
        disk = s.get("cache.disk.read_bytes", 0) + s.get("cache.disk.write_bytes", 0)
        lines.append(
            f"{row_name(r):<28}{pct(.5, r.ttfts) * 1e3:>8.1f}ms"
            f"{pct(.95, r.ttfts) * 1e3:>8.1f}ms{r.prompt_tokens // k:>12,}"
            + "".join(f"{x / n:>11.1%}" for x in from_tier) + f"{computed / n:>10.1%}"
            + f"{s.get('cache.retrieve_bytes', 0) / k / mib:>8.1f}MiB"
            + f"{s.get('cache.store_bytes', 0) / k / mib:>7.1f}MiB{disk / k / mib:>7.1f}MiB")
    several = [r for r in results if len(r.rounds) > 1]
    if several:
        lines.append(f"(x{len(several[0].rounds)}: {len(several[0].rounds)} interleaved rounds; "
                     "tokens and bytes are one round's, TTFTs those of every request)")
    return "\n".join(lines)


# ----------------------------------------------------------------- computed tokens
CAUSES = {  # cause -> (its name in the breakdown, what it means: said once below it)
    "miss": ("held by no tier", "text no tier held: never seen before, or the rest of a "
             "chunk an earlier, shorter prompt ended in (a chunk is found only with all of its "
             "tokens)"),
    "unanswered": ("tier too slow to answer", "a lower tier did not answer the lookup within "
                   "a tenth of recomputing the prompt: lmc computed rather than wait (the "
                   "tier may have held them)"),
    "choice": ("recomputed by choice", "lmc's load policy predicted computing them sooner "
               "than loading them from the tier that held them (load_policy: auto)"),
    "stopped": ("loads stopped", "a load stopped itself when finishing it was predicted "
                "slower than computing the rest"),
    "failed": ("loads failed", "a load failed or came up short: the engine computed them"),
    "last": ("last tokens", "each prompt's last token is always computed: its forward gives "
             "the first output token"),
    "other": ("not accounted for", "the counters do not say why"),
}


def computed_causes(r: PassResult, tiers: list[str]) -> dict[str, int]:
    """An lmc pass's computed prompt tokens (those no tier supplied) by cause; they sum to
    the table's "computed" count. Without a load policy's counters, misses are what the
    other causes leave."""
    s = r.stats
    computed = int(r.prompt_tokens - loaded_tokens(r, tiers))
    parts = {"last": min(r.requests, computed),
             "choice": int(s.get("policy.recomputed_by_choice", 0)),
             "stopped": int(s.get("worker.stopped_tokens", 0)),
             "failed": int(s.get("worker.recomputed_after_failure", 0))}
    if "policy.recomputed_by_miss" in s:
        parts["miss"] = int(s["policy.recomputed_by_miss"])
        parts["other"] = computed - sum(parts.values())
    else:
        parts["miss"] = computed - sum(parts.values())
    # of the misses, those past a hit a lower tier left unanswered (their last tokens are
    # the "last" cause's already)
    late = min(parts["miss"], int(s.get("cache.lookup_unanswered_tokens", 0))
               - int(s.get("cache.lookups_unanswered", 0)))
    if late > 0:
        parts["unanswered"], parts["miss"] = late, parts["miss"] - late
    return {k: v for k, v in parts.items() if v}


def format_computed(results: list[PassResult], tiers: list[str]) -> str:
    """Per lmc pass, ``2,645: 2,639 held by no tier, 6 last tokens``; then what each cause
    that occurred means."""
    lines = ["where each lmc pass's computed tokens come from:"]
    seen: list[str] = []
    for r in results:
        if not r.stats:
            continue  # the engine alone computes every token
        causes = computed_causes(r, tiers)
        total = sum(causes.values())
        order = [c for c in CAUSES if c in causes]
        seen += [c for c in order if c not in seen]
        k = max(1, len(r.rounds))
        lines.append(f"  {row_name(r):<28}{total // k:>8,}"
                     + (": " + ", ".join(f"{causes[c] // k:,} {CAUSES[c][0]}" for c in order)
                        if order else ""))
    lines += [f"  ({CAUSES[c][0]}: {CAUSES[c][1]})" for c in CAUSES if c in seen]
    return "\n".join(lines)


# --------------------------------------------------------------------------- answers
def same_outputs(results: list[PassResult]) -> list[str]:
    """Where a pass's (or round's) generated tokens differ from the first pass's first
    round, as ``"lmc, warm (L1), round 2, request 3"``; empty when all are identical."""
    ref = results[0].outputs[0]
    out = []
    for r in results:
        for k, rnd in enumerate(r.outputs):
            for i, (a, b) in enumerate(zip(ref, rnd)):
                if a != b:
                    where = f", round {k + 1}" if len(r.outputs) > 1 else ""
                    out.append(f"{r.name}{where}, request {i + 1}")
    return out


def format_answers(turns: list[Turn], result: PassResult, max_tokens: int) -> str:
    lines = []
    for turn, answer, cut in zip(turns, result.answers, result.cut):
        who = (f"chat {turn.chat + 1}, round {turn.round + 1}" if turn.chat >= 0
               else f"document, question {turn.question + 1}")
        lines.append(f"  {who:<20} {turn.text}")
        lines.append(f"  {'':<20} -> {answer}" + (f" ... [cut at {max_tokens} tokens]"
                                                  if cut else ""))
    return "\n".join(lines)


# -------------------------------------------------------------------------- headline
@dataclass
class Headline:
    """The demo's one number: the table's TTFT p50 with no lmc over its TTFT p50 served
    from lmc's CPU tier. Both rows come from the same interleaved rounds (each request
    asked of both engines back to back, so both see the same machine load); with more
    than one round, the per-round ratios give the range."""

    base: PassResult
    warm: PassResult

    @property
    def ratio(self) -> float:
        return pct(.5, self.base.ttfts) / pct(.5, self.warm.ttfts)

    @property
    def round_ratios(self) -> list[float]:
        return [pct(.5, a) / pct(.5, b) for a, b in zip(self.base.rounds, self.warm.rounds)]

    def line(self) -> str:
        n = len(self.base.rounds)
        rs = self.round_ratios
        spread = f"; per round {min(rs):.1f}x-{max(rs):.1f}x" if n > 1 else ""
        return (f"speed-up: {self.ratio:.1f}x TTFT p50 (the table's rows: no lmc "
                f"{pct(.5, self.base.ttfts) * 1e3:,.0f} ms, warm L1 "
                f"{pct(.5, self.warm.ttfts) * 1e3:,.1f} ms; each request asked of both "
                f"engines back to back, {n} round{'s' if n > 1 else ''}{spread})")

    MEANING = ("meaning: how many times sooner the first token arrives when lmc supplies a "
               "prompt's KV from CPU memory instead of the engine prefilling it; same prompts, "
               "same outputs.")
