"""What a replay measures, and replay on the reference engine in-process.

Both targets (this one and :mod:`lmc.workloads.http_target`) fill the same
:class:`ReplayResult`: one :class:`RequestRecord` per trace request, the tokens each lmc
tier supplied (or None where the target cannot tell: never guessed), and a timeline of
cumulative per-tier tokens for the hit-rate plot.

The reference engine is driven by one loop: send what the :class:`Dispatcher` says is
due, run one engine step, record what finished, sleep only when the engine is idle until
the next arrival. Prompts are tokenized before the clock starts, so TTFT is the engine's
and lmc's, not the tokenizer's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmc.storage import funnel_report
from lmc.workloads.dispatch import Dispatcher
from lmc.workloads.trace import TraceRequest


@dataclass
class RequestRecord:
    """One request's outcome; times in seconds from the replay's start. ``ttft_s`` and
    ``latency_s`` count from ``due_s`` (see :mod:`lmc.workloads.dispatch`)."""

    request_id: str
    session_id: str | None
    prefix_group: str | None
    due_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens the target reported as not computed
    output_ids: list[int] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ReplayResult:
    target: str
    mode: str  # "timed" or "fast"
    records: list[RequestRecord]
    duration_s: float
    tier_tokens: dict[str, float] | None  # prompt tokens supplied by each lmc tier
    tier_source: str  # where tier_tokens came from, or why they are unknown
    load_failures: float | None = None  # lmc loads that failed (the engine recomputed)
    # (seconds, prompt tokens of the requests sent so far, {tier: tokens supplied so far}):
    # a tier's tokens arrive after the request is sent, so the share never overshoots
    timeline: list[tuple[float, float, dict[str, float]]] = field(default_factory=list)
    # Ctrl-C: ``records`` holds the requests that finished, of ``total_requests``
    interrupted: bool = False
    total_requests: int | None = None
    # blending (lmc.blend): segment tokens loaded from lmc and placed anywhere in a prompt,
    # and of those, the ones recomputed; None where the target does not blend
    blend_tokens: float | None = None
    blend_recomputed: float | None = None
    # the hit-rate funnel over the replay (lmc.storage.funnel_report.view's rows)
    funnel: dict[str, Any] | None = None

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def failed(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.ok]

    def ttft_percentile(self, q: float) -> float | None:
        return percentile([r.ttft_s for r in self.ok if r.ttft_s is not None], q)

    @property
    def prompt_tokens(self) -> int | None:
        known = [r.prompt_tokens for r in self.ok if r.prompt_tokens is not None]
        return sum(known) if len(known) == len(self.ok) else None

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the two nearest samples; None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


Progress = Callable[[RequestRecord, int, int], None]  # (record, finished, total)


# --------------------------------------------------------------------------- reference
@dataclass(frozen=True)
class SessionHints:
    """Cache hints a replay adds to each request (``lmc replay --session-hints``,
    ``--background-priority``; :mod:`lmc.connectors.core.hints`): a request of a session
    pins its chain for ``ttl`` s under the session and gives it ``priority``; one without
    a session gets ``background_priority``."""

    ttl: float | None = None
    priority: int | None = None
    background_priority: int | None = None

    def params(self, req: TraceRequest) -> dict[str, Any] | None:
        """The request's ``kv_transfer_params`` (None: nothing to say)."""
        if req.session_id is None:
            return None if self.background_priority is None else \
                {"lmc_priority": self.background_priority}
        out: dict[str, Any] = {"lmc_session": req.session_id[:256]}
        if self.ttl is not None:
            out["lmc_ttl"] = self.ttl
        if self.priority is not None:
            out["lmc_priority"] = self.priority
        return out if len(out) > 1 else None


def replay_reference(requests: Sequence[TraceRequest], llm: Any, *, fast: bool = False,
                     concurrency: int | None = None, progress: Progress | None = None,
                     keep_outputs: bool = True, target: str = "reference",
                     warm_up: bool = True, hints: SessionHints | None = None) -> ReplayResult:
    """Replay ``requests`` on a :class:`lmc.reference.LLM` (with or without an lmc
    connector); greedy, exactly ``output_len`` tokens each (EOS ignored). ``warm_up`` runs
    one untimed request of random tokens first, so the first timed request does not pay
    the engine's one-time costs (allocations, lazy imports: seconds here)."""
    import random

    from lmc.reference.request import SamplingParams

    if warm_up:
        rng = random.Random(0x1DC)
        vocab = min(llm.config.vocab_size, 1 << 15)
        # long enough to store chunks: the first stores pay for pool pages too
        warm = [rng.randrange(vocab) for _ in range(min(512, llm.max_model_len - 8))]
        llm.generate([warm], max_tokens=2, ignore_eos=True)

    conn = getattr(llm, "kv_connector", None)
    funnel_base = funnel_report.numbers(conn.stats()) if conn is not None else {}
    worker = getattr(conn, "worker", None)
    blender = getattr(conn, "blender", None)
    blend_base = (blender.stats.tokens_reused, blender.stats.tokens_recomputed) \
        if blender is not None else (0, 0)
    tiers = list(conn.engine.tier_names) if conn is not None else []
    prompts: dict[str, list[int]] = {}
    spans: dict[str, list[tuple[int, int]] | None] = {}
    records: dict[str, RequestRecord] = {}
    for r in requests:
        records[r.request_id] = RequestRecord(r.request_id, r.session_id, r.prefix_group, 0.0)
        prompts[r.request_id], spans[r.request_id] = _prompt(r, llm)

    def tier_counts() -> dict[str, float]:
        got = dict(worker.stats.tokens_by_tier) if worker is not None else {}
        return {t: float(got.get(t, 0)) for t in tiers}

    base_tiers = tier_counts()  # an engine used before: count this replay only

    def tier_now() -> dict[str, float]:
        return {t: n - base_tiers[t] for t, n in tier_counts().items()}

    base_failures = worker.stats.load_failures if worker is not None else 0
    disp = Dispatcher(requests, fast=fast, concurrency=concurrency)
    sent_at: dict[str, float] = {}
    timeline: list[tuple[float, float, dict[str, float]]] = [(0.0, 0.0, tier_now())]
    sent_prompt = 0.0
    start = time.perf_counter()
    last_point = 0.0

    finished: list[RequestRecord] = []

    def finish(rec: RequestRecord, now: float) -> None:
        disp.done(rec.request_id, now)
        finished.append(rec)
        if progress is not None:
            progress(rec, disp.finished, len(records))

    interrupted = False
    try:
        while not disp.all_done:
            now = time.perf_counter() - start
            for req in disp.ready(now):
                rec = records[req.request_id]
                rec.due_s = disp.due[req.request_id]
                params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
                sent_at[req.request_id] = time.perf_counter()
                try:
                    llm.add_request(prompts[req.request_id], params,
                                    request_id=req.request_id,
                                    kv_transfer_params=None if hints is None
                                    else hints.params(req),
                                    segments=spans[req.request_id])
                    sent_prompt += len(prompts[req.request_id])
                except ValueError as e:  # too long for the model, a token id out of its vocab
                    rec.error = str(e)
                    finish(rec, time.perf_counter() - start)
            if llm.has_unfinished_requests():
                outs = llm.step()
                t_step = time.perf_counter()
                for out in outs:
                    rec = records[out.request_id]
                    rec.prompt_tokens = len(out.prompt_token_ids)
                    rec.output_tokens = len(out.token_ids)
                    rec.cached_tokens = out.num_cached_tokens
                    if keep_outputs:
                        rec.output_ids = list(out.token_ids)
                    failed = (llm.pop_error(out.request_id) if out.finish_reason == "abort"
                              else None)
                    if failed is not None:  # the engine failed this request alone: say why
                        rec.error = f"the engine failed this request: {failed}"
                    elif out.ttft_s is None:
                        rec.error = f"no token generated (finish reason {out.finish_reason})"
                    else:
                        first = sent_at[out.request_id] + out.ttft_s
                        rec.ttft_s = first - (start + rec.due_s)
                        rec.latency_s = t_step - (start + rec.due_s)
                    finish(rec, t_step - start)
                if outs or t_step - start - last_point >= 0.25:
                    last_point = t_step - start
                    timeline.append((last_point, sent_prompt, tier_now()))
                continue
            nxt = disp.next_due()
            if nxt is not None:
                time.sleep(max(0.0, nxt - (time.perf_counter() - start)))
    except KeyboardInterrupt:  # Ctrl-C: what finished is reported (the caller closes the engine)
        interrupted = True
    duration = time.perf_counter() - start
    if conn is not None:  # a lower tier's queued writes land (briefly when interrupted)
        conn.engine.flush(timeout=5 if interrupted else 60)
    tier_tokens = tier_now() if conn is not None else None
    if tier_tokens:
        timeline.append((duration, sent_prompt, tier_tokens))
    failures = (worker.stats.load_failures - base_failures) if worker is not None else None
    source = ("lmc connector counters (in-process)" if conn is not None
              else "no lmc connector: every prompt token computed")
    if conn is None:
        tier_tokens = {}
    done = finished if interrupted else list(records.values())
    res = ReplayResult(target, "fast" if fast else "timed", done, duration, tier_tokens,
                       source, failures, timeline, interrupted, len(records))
    if blender is not None:
        res.blend_tokens = float(blender.stats.tokens_reused - blend_base[0])
        res.blend_recomputed = float(blender.stats.tokens_recomputed - blend_base[1])
    if conn is not None:
        res.funnel = funnel_report.view(funnel_report.delta(
            funnel_report.numbers(conn.stats()), funnel_base))
    return res


def _prompt(req: TraceRequest, llm: Any) -> tuple[list[int], list[tuple[int, int]] | None]:
    """A request's token ids and segment spans, before the clock starts: token prompts as
    given; text through the engine's own tokenizer (a model without tokenizer.json says
    so), split at ``segment_separator`` the way ``LLM.generate(segment_separator=)``
    splits it (each piece tokenized alone, the separators dropped)."""
    if req.prompt_tokens is not None:
        return list(req.prompt_tokens), (list(req.segments) if req.segments is not None
                                         else None)
    if req.segment_separator is not None:
        ids, found = llm.encode_segments(req.prompt_text, separator=req.segment_separator)
        return ids, found
    return llm.encode(req.prompt_text), None
