"""``lmc workload``: write a trace of a standard workload (see ``docs/workloads.md``)."""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any

from lmc.cli_args import int_in, positive_int
from lmc.workloads.trace import write_trace

WORKLOAD_DOC = """Write a workload trace (JSONL, see docs/workloads.md) for lmc replay and lmc plan.

  chat      multi-turn conversations (12-18 turns) over a shared system prompt; each turn's
            prompt is the whole history so far
  prefix    N groups x M prompts, each group over its own long system prompt
  docqa     long documents asked a new question each round
  rag       a pool of documents; each query retrieves k of them in a random order (their
            spans marked as reusable segments, for lmc replay --blend)
  sharegpt  conversations from a ShareGPT-style JSON file
  agent     coding-agent sessions: a long shared tools prefix, turns appending tool
            results, sub-agents forking, think time; background traffic with a burst

Text is generated from a seed (same seed, same trace). Sizes are in tokens: exact lower
bounds with --tokenizer (the trace then holds token ids), estimated from words without.
Arrivals: a Poisson process with --rate, else all at t=0 (replay them with --fast)."""

# --------------------------------------------------------------------------- parsing
def _int_range(limit: int) -> Any:
    """argparse type: ``12-18`` or ``15``, both ends in ``[1, limit]``."""

    def parse(text: str) -> tuple[int, int]:
        parts = text.split("-")
        try:
            lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
        except ValueError:
            lo, hi = 0, -1
        if lo < 1 or hi < lo or hi > limit:
            raise argparse.ArgumentTypeError(f"expected N or MIN-MAX with 1 <= MIN <= MAX "
                                             f"<= {limit}, got {text!r}")
        return lo, hi

    return parse


def _rate(text: str) -> float:
    try:
        r = float(text)
    except ValueError:
        r = -1.0
    if not 0 < r < float("inf"):
        raise argparse.ArgumentTypeError(f"expected requests per second > 0, got {text!r}")
    return r


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v < 1e6:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return v


# -------------------------------------------------------------------------- workload
def _workload(args: argparse.Namespace) -> int:
    from lmc.workloads import generators as g

    try:
        tok = g.load_tokenizer(args.tokenizer) if args.tokenizer else None
        skipped = 0
        arrivals: list[float] | None = None
        if args.kind == "agent":
            if args.rate is not None:
                raise ValueError("agent: arrivals come from --think-s, --session-gap-s and "
                                 "the background's rates, not --rate")
            from lmc.workloads.agent import AgentSpec, agent_drafts
            drafts, arrivals = agent_drafts(AgentSpec(
                args.sessions, args.turns, args.system_tokens, args.task_tokens,
                args.tool_tokens, args.output_len, args.fork, args.sub_turns, args.think_s,
                args.session_gap_s, args.background_rate, args.background_tokens,
                args.burst_rate, args.burst_s, args.burst_at, args.seed), tok)
        elif args.kind == "chat":
            drafts = g.chat_drafts(g.ChatSpec(args.conversations, args.turns, args.system_tokens,
                                              args.user_tokens, args.output_len, args.active,
                                              args.seed), tok)
        elif args.kind == "prefix":
            drafts = g.prefix_drafts(g.PrefixSpec(args.groups, args.prompts_per_group,
                                                  args.system_tokens, args.question_tokens,
                                                  args.output_len, args.seed), tok)
        elif args.kind == "docqa":
            drafts = g.docqa_drafts(g.DocQASpec(args.documents, args.doc_tokens, args.rounds,
                                                args.question_tokens, args.output_len,
                                                args.order, args.seed), tok)
        elif args.kind == "rag":
            drafts = g.rag_drafts(g.RagSpec(args.documents, args.doc_words, args.k,
                                            args.queries, args.question_words,
                                            args.system_words, args.output_len,
                                            args.separator, args.seed), tok)
        else:
            drafts, skipped = g.sharegpt_drafts(g.ShareGPTSpec(
                args.file, args.max_conversations, args.max_output_len, args.active,
                args.seed), tok)
        if not drafts:
            raise ValueError("the workload has no requests")
        if arrivals is None:
            arrivals = g.arrival_times(len(drafts), args.rate, args.seed)
        lengths: list[int] = []

        def counted(reqs: Any) -> Any:
            for r in reqs:
                lengths.append(len(r.prompt_tokens) if r.prompt_tokens is not None
                               else len(r.prompt_text))
                yield r

        n = write_trace(args.output, counted(g.render(drafts, arrivals, tok)))
    except (ValueError, OSError) as e:
        print(f"lmc workload: {e}", file=sys.stderr)
        return 2
    unit = "tokens" if tok is not None else "characters"
    sessions = len({d.session_id for d in drafts if d.session_id is not None})
    groups = len({d.prefix_group for d in drafts if d.prefix_group is not None})
    span = (f"arrivals over {arrivals[-1]:.1f} s at {args.rate:g}/s" if args.rate
            else f"arrivals over {arrivals[-1]:.1f} s" if arrivals[-1] > 0
            else "all arriving at t=0")
    print(f"wrote {n} requests to {args.output}: {sessions} sessions, {groups} prefix groups; "
          f"prompts {min(lengths):,}-{max(lengths):,} {unit} "
          f"(mean {sum(lengths) / n:,.0f}); {span}"
          + (f"; {skipped} conversations skipped (no answered human turn)" if skipped else ""))
    return 0


def _register_workload(sub: Any) -> None:
    from lmc.cli_args import add_command, help_text
    from lmc.workloads import generators as g

    p = add_command(sub, "workload", "write a workload trace (chat, prefix, docqa, rag, "
                    "sharegpt, agent)",
                    WORKLOAD_DOC)
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)

    def kind(name: str, summary: str, doc: str | None) -> argparse.ArgumentParser:
        k = kinds.add_parser(name, help=summary,
                             description=f"{summary}.\n\n{help_text(inspect.cleandoc(doc or ''))}",
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        k.add_argument("-o", "--output", required=True, metavar="FILE",
                       help="trace file to write (JSONL)")
        k.add_argument("--seed", type=int_in(-2**63, 2**63 - 1), default=0,
                       help="default %(default)s")
        k.add_argument("--rate", type=_rate, default=None, metavar="R",
                       help="Poisson arrivals, R requests/s (default: all at t=0)")
        k.add_argument("--tokenizer", metavar="PATH",
                       help="tokenizer.json or a model directory: write token ids (prefixes "
                            "shared exactly) and size text in real tokens")
        k.set_defaults(func=_workload)
        return k

    count, tokens = int_in(1, g.MAX_COUNT), int_in(1, g.MAX_SEGMENT_TOKENS)
    output_len = int_in(1, g.MAX_OUTPUT_LEN)
    c = kind("chat", "multi-turn conversations over a shared system prompt", g.chat_drafts.__doc__)
    d = g.ChatSpec()
    c.add_argument("--conversations", type=count, default=d.conversations, metavar="N",
                   help="default %(default)s")
    c.add_argument("--turns", type=_int_range(g.MAX_COUNT), default=d.turns, metavar="MIN-MAX",
                   help="turns per conversation (default 12-18)")
    c.add_argument("--system-tokens", type=tokens, default=d.system_tokens, metavar="N",
                   help="default %(default)s")
    c.add_argument("--user-tokens", type=_int_range(g.MAX_SEGMENT_TOKENS),
                   default=d.user_tokens, metavar="MIN-MAX",
                   help="tokens per question (default 30-120)")
    c.add_argument("--output-len", type=output_len, default=d.output_len,
                   help="tokens per answer (also the synthetic answer kept in the history)")
    c.add_argument("--active", type=count, default=d.active,
                   help="conversations open at once, turns interleaved (default %(default)s)")

    pr = kind("prefix", "N groups x M prompts over long system prompts", g.prefix_drafts.__doc__)
    dp = g.PrefixSpec()
    pr.add_argument("--groups", type=count, default=dp.groups, metavar="N",
                   help="default %(default)s")
    pr.add_argument("--prompts-per-group", type=count, default=dp.prompts_per_group,
                    metavar="N",
                   help="default %(default)s")
    pr.add_argument("--system-tokens", type=tokens, default=dp.system_tokens, metavar="N",
                   help="default %(default)s")
    pr.add_argument("--question-tokens", type=tokens, default=dp.question_tokens, metavar="N",
                   help="default %(default)s")
    pr.add_argument("--output-len", type=output_len, default=dp.output_len, metavar="N",
                   help="default %(default)s")

    dq = kind("docqa", "long documents re-asked in rounds", g.docqa_drafts.__doc__)
    dd = g.DocQASpec()
    dq.add_argument("--documents", type=count, default=dd.documents, metavar="N",
                   help="default %(default)s")
    dq.add_argument("--doc-tokens", type=tokens, default=dd.doc_tokens, metavar="N",
                   help="default %(default)s")
    dq.add_argument("--rounds", type=count, default=dd.rounds, metavar="N",
                   help="default %(default)s")
    dq.add_argument("--question-tokens", type=tokens, default=dd.question_tokens, metavar="N",
                   help="default %(default)s")
    dq.add_argument("--output-len", type=output_len, default=dd.output_len, metavar="N",
                   help="default %(default)s")
    dq.add_argument("--order", choices=("tile", "random"), default=dd.order,
                    help="document order each round (default %(default)s)")

    rg = kind("rag", "documents retrieved k at a time in a random order", g.rag_drafts.__doc__)
    dr = g.RagSpec()
    words = int_in(1, g.MAX_SEGMENT_TOKENS)
    rg.add_argument("--documents", type=count, default=dr.documents, metavar="N",
                    help="documents in the pool (default %(default)s)")
    rg.add_argument("--doc-words", type=words, default=dr.doc_words, metavar="N",
                    help="words per document (default %(default)s)")
    rg.add_argument("-k", "--k", type=count, default=dr.k, metavar="K",
                    help="documents per query (default %(default)s)")
    rg.add_argument("--queries", type=count, default=dr.queries, metavar="N",
                    help="default %(default)s")
    rg.add_argument("--question-words", type=words, default=dr.question_words, metavar="N",
                    help="default %(default)s")
    rg.add_argument("--system-words", type=words, default=dr.system_words, metavar="N",
                    help="default %(default)s")
    rg.add_argument("--output-len", type=output_len, default=dr.output_len, metavar="N",
                    help="default %(default)s")
    rg.add_argument("--separator", default=dr.separator, metavar="TEXT",
                    help="joins a text prompt's pieces (default %(default)r)")

    from lmc.workloads import agent
    ag = kind("agent", "coding-agent sessions and background traffic with a burst",
              agent.__doc__)
    da = agent.AgentSpec()
    secs = _seconds
    ag.add_argument("--sessions", type=count, default=da.sessions, metavar="N",
                    help="agent sessions (default %(default)s)")
    ag.add_argument("--turns", type=_int_range(g.MAX_COUNT), default=da.turns,
                    metavar="MIN-MAX", help="turns per session (default 6-14)")
    ag.add_argument("--system-tokens", type=tokens, default=da.system_tokens, metavar="N",
                    help="the shared tools prefix (default %(default)s)")
    ag.add_argument("--task-tokens", type=_int_range(g.MAX_SEGMENT_TOKENS),
                    default=da.task_tokens, metavar="MIN-MAX", help="default 150-400")
    ag.add_argument("--tool-tokens", type=_int_range(g.MAX_SEGMENT_TOKENS),
                    default=da.tool_tokens, metavar="MIN-MAX",
                    help="a tool result appended per turn (default 100-600)")
    ag.add_argument("--output-len", type=output_len, default=da.output_len, metavar="N",
                    help="default %(default)s")
    ag.add_argument("--fork", type=_fraction, default=da.fork, metavar="P",
                    help="chance a turn forks a sub-agent (default %(default)s)")
    ag.add_argument("--sub-turns", type=_int_range(g.MAX_COUNT), default=da.sub_turns,
                    metavar="MIN-MAX", help="a sub-agent's turns (default 2-4)")
    ag.add_argument("--think-s", type=secs, default=da.think_s, metavar="S",
                    help="mean think time between a session's turns (default %(default)s)")
    ag.add_argument("--session-gap-s", type=secs, default=da.session_gap_s, metavar="S",
                    help="mean gap between session starts (default %(default)s)")
    ag.add_argument("--background-rate", type=secs, default=da.background_rate, metavar="R",
                    help="unrelated requests per second (default %(default)s)")
    ag.add_argument("--background-tokens", type=_int_range(g.MAX_SEGMENT_TOKENS),
                    default=da.background_tokens, metavar="MIN-MAX", help="default 800-2400")
    ag.add_argument("--burst-rate", type=secs, default=da.burst_rate, metavar="R",
                    help="background requests per second during the burst "
                    "(default %(default)s)")
    ag.add_argument("--burst-s", type=secs, default=da.burst_s, metavar="S",
                    help="the burst's length (default %(default)s)")
    ag.add_argument("--burst-at", type=_fraction, default=da.burst_at, metavar="F",
                    help="where the burst starts, a fraction of the sessions' span "
                    "(default %(default)s)")

    sg = kind("sharegpt", "conversations from a ShareGPT-style JSON file", g.sharegpt_drafts.__doc__)
    sg.add_argument("file", metavar="FILE", help="ShareGPT-style JSON")
    sg.add_argument("--max-conversations", type=positive_int, default=None)
    sg.add_argument("--max-output-len", type=output_len, default=1024)
    sg.add_argument("--active", type=count, default=4,
                    help="conversations open at once, turns interleaved (default %(default)s)")


def register_cli(sub: Any) -> None:
    _register_workload(sub)
