"""``lmc replay``: drive a real engine with a trace and report what lmc did for it."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmc.cli_args import float_in, int_in, positive_int
from lmc.workloads.trace import TraceError, TraceRequest, read_trace

MAX_CONCURRENCY = 1 << 16  # requests in flight (the dispatcher keeps a slot per request)
MAX_THREADS = 4096
MAX_TIMEOUT_S = 86400.0

REPLAY_DOC = """Replay a trace on a real engine and report TTFT, throughput and lmc hits per tier.

Targets:
  reference[:MODEL_DIR]  the built-in reference engine in this process (default model: lmc
                         demo --quick's), with lmc configured by --config (default: lmc
                         demo's tiers, CPU then a temporary disk directory), or --no-lmc for
                         the engine alone
  http://host:port       any OpenAI-compatible server (/v1/completions, streamed: TTFT is the
                         first streamed token); per-tier hits come from the server's lmc
                         counters (vLLM with lmc: /metrics; lmc's reference server:
                         /lmc/stats), else they are reported as unknown

A trace's marked segments (lmc workload rag) go to the reference engine with each prompt;
--blend makes its connector blend them (segment caching with selective recompute, gated by
the model's lmc quality verdict for blend) and the summary shows the tokens blending reused.

Requests are sent at their arrival times (or --fast: as soon as possible); a turn of a
session waits for the previous turn's answer, and --concurrency N caps requests in flight.
TTFT counts from when a request could be sent. Every request generates exactly its
output_len tokens (greedy; EOS ignored where the target supports it).

The progress line shows the time left (ETA). Ctrl-C stops the replay and still prints the
summary of the requests that finished, and writes --records and --plot for them (exit 130)."""


def _reference_llm(spec: str, args: argparse.Namespace, cleanup: list[Callable[[], None]]
                   ) -> tuple[Any, str]:
    """The in-process engine for ``reference[:MODEL_DIR]`` and a description of it."""
    import torch

    from lmc.demo import (
        DEMO_CONFIG,
        DEMO_MODEL,
        ENGINE_ARGS,
        default_threads,
        demo_model_dir,
        resolve_model_dir,
    )

    torch.set_num_threads(args.threads or default_threads())
    engine_args = dict(ENGINE_ARGS)
    _, _, model = spec.partition(":")
    if model:
        model_dir = resolve_model_dir(model, given_as="--target reference:")
    else:
        model_dir = demo_model_dir()
        engine_args["max_model_len"] = DEMO_MODEL["max_position_embeddings"]
    if args.max_num_seqs:
        engine_args["max_num_seqs"] = args.max_num_seqs
    from lmc.reference import LLM

    if args.no_lmc:
        return LLM(model_dir, **engine_args), f"reference engine ({model_dir.name}), no lmc"
    from lmc.config import CacheConfig
    from lmc.connectors.reference import LMCReferenceConnector

    if args.config:
        cfg = load_config(args.config)
    else:
        disk = tempfile.mkdtemp(prefix="lmc-replay-disk-")
        cleanup.append(lambda: shutil.rmtree(disk, ignore_errors=True))
        cfg = CacheConfig.load(overrides={**DEMO_CONFIG, "local_disk": disk})
    if args.blend:
        from lmc.connectors.reference.blend import BlendConnector

        settings: dict[str, Any] = {"override": args.blend_override}
        if args.blend_ratio is not None:
            settings["ratio"] = args.blend_ratio
        if args.blend_verdicts is not None:
            settings["verdicts"] = args.blend_verdicts
        conn: LMCReferenceConnector = BlendConnector(cfg, model_dir=model_dir, blend=settings)
    else:
        conn = LMCReferenceConnector(cfg, model_dir=model_dir)
    try:
        llm = LLM(model_dir, kv_connector=conn, **engine_args)
    except BaseException:
        conn.shutdown()
        raise
    tiers = ", ".join(conn.cache.tier_names)
    name = f"reference engine ({model_dir.name}) with lmc ({tiers})"
    if args.blend:
        blender = getattr(conn, "blender", None)
        name += (f", blending at recompute ratio {blender.ratio:.2f}" if blender is not None
                 else ", blending off (no passing lmc quality verdict; see the log)")
    return llm, name


def load_config(path: str) -> Any:
    """``--config``: lmc's YAML loader (it names the file of a bad or too deeply nested one)."""
    from lmc.config import CacheConfig

    return CacheConfig.load(path)


def _only_for(which: str, **given: Any) -> None:
    """Refuse options the chosen target would silently ignore."""
    wrong = [f"--{k.replace('_', '-')}" for k, v in given.items() if v]
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: only for {which}")


def _hints(args: argparse.Namespace) -> Any:
    """``--session-hints TTL[,PRIORITY]`` and ``--background-priority P`` as the
    replay's :class:`~lmc.workloads.replay.SessionHints` (None: none given)."""
    from lmc.workloads.replay import SessionHints
    if args.session_hints is None and args.background_priority is None:
        return None
    ttl = prio = None
    if args.session_hints is not None:
        ttl_text, _, prio_text = args.session_hints.partition(",")
        try:
            ttl = float(ttl_text)
            prio = int(prio_text) if prio_text else None
        except ValueError:
            ttl = -1.0
        if not 0 < ttl < 1e6 or (prio is not None and not -10 <= prio <= 10):
            raise ValueError(f"--session-hints {args.session_hints!r}: expected TTL seconds "
                             "> 0, then optionally ,PRIORITY in [-10, 10]")
    return SessionHints(ttl, prio, args.background_priority)


def _replay(args: argparse.Namespace) -> int:
    from lmc.workloads import report

    cleanup: list[Callable[[], None]] = []
    llm = None
    try:
        if args.plot:
            report.check_plot_available()
        for flag, out in (("--plot", args.plot), ("--records", args.records)):
            if out and not Path(out).resolve().parent.is_dir():  # found now, not after the run
                raise ValueError(f"{flag} {out}: no directory {Path(out).resolve().parent}")
            if out and Path(out).is_dir():
                raise ValueError(f"{flag} {out}: is a directory, expected a file to write")
        requests: list[TraceRequest] = list(read_trace(args.trace))
        if args.limit:
            requests = requests[:args.limit]
        if not requests:
            raise ValueError(f"{args.trace}: no requests")
        sessions = len({r.session_id if r.session_id is not None else f"\0{i}"
                        for i, r in enumerate(requests)})
        bar = report.ProgressBar(len(requests), last_arrival_s=None if args.fast else max(
            r.arrival_s for r in requests),
            parallel=min(sessions, args.concurrency) if args.concurrency else None)
        target = args.target
        if target == "reference" or target.startswith("reference:"):
            _only_for("the HTTP target", model=args.model, openai_strict=args.openai_strict,
                      timeout=args.timeout != 600.0)
            if args.no_lmc:
                _only_for("a target with lmc (segments are stored in lmc)", blend=args.blend)
            if not args.blend:
                _only_for("--blend", blend_ratio=args.blend_ratio is not None,
                          blend_override=args.blend_override,
                          blend_verdicts=args.blend_verdicts is not None)
            from lmc.workloads.replay import replay_reference

            llm, name = _reference_llm(target, args, cleanup)
            bar.start()
            res = replay_reference(requests, llm, fast=args.fast, concurrency=args.concurrency,
                                   progress=bar, keep_outputs=bool(args.records), target=name,
                                   hints=_hints(args))
        elif target.startswith(("http://", "https://")):
            _only_for("the reference target (a server's engine and lmc are configured where "
                      "it runs)", config=args.config, no_lmc=args.no_lmc, threads=args.threads,
                      max_num_seqs=args.max_num_seqs, blend=args.blend,
                      blend_ratio=args.blend_ratio is not None,
                      blend_override=args.blend_override,
                      blend_verdicts=args.blend_verdicts is not None)
            from lmc.workloads.http_target import replay_http

            res = replay_http(requests, target, model=args.model, fast=args.fast,
                              concurrency=args.concurrency, progress=bar,
                              vllm_extras=not args.openai_strict, timeout=args.timeout,
                              hints=_hints(args))
        else:
            raise ValueError(f"--target {target!r}: expected reference[:MODEL_DIR] or "
                             "http://host:port")
    except (TraceError, ValueError, OSError) as e:
        print(f"lmc replay: {e}", file=sys.stderr)
        return 2
    finally:
        if llm is not None:
            llm.close()
        for fn in cleanup:
            fn()
    if res.interrupted:
        print(f"\nlmc replay: interrupted after {len(res.records)} of {res.total_requests} "
              "requests; the summary, records and plot cover those", file=sys.stderr)
    print(report.format_report(res, args.trace))
    if args.records:
        try:
            with open(args.records, "w", encoding="utf-8") as f:
                for r in res.records:
                    f.write(json.dumps(vars(r), separators=(",", ":")) + "\n")
        except OSError as e:  # the run's report is printed already; say what was not saved
            print(f"lmc replay: --records {args.records}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"\nper-request records: {args.records}")
    if args.plot:
        report.plot(res, args.plot, title=f"{Path(args.trace).name} on {res.target}")
        print(f"plot: {args.plot}")
    if res.interrupted:
        return 130
    return 1 if res.failed and not res.ok else 0


def _register_replay(sub: Any) -> None:
    from lmc.cli_args import add_command

    p = add_command(sub, "replay", "replay a trace on the reference engine or an "
                    "OpenAI-compatible server: TTFT, throughput, hits per tier", REPLAY_DOC)
    p.add_argument("trace", metavar="TRACE", help="trace file (JSONL, see lmc workload)")
    p.add_argument("--target", required=True, metavar="TARGET",
                   help="reference[:MODEL_DIR] or http://host:port")
    p.add_argument("--fast", action="store_true",
                   help="ignore arrival times: send each request as soon as it may go")
    p.add_argument("--concurrency", type=int_in(1, MAX_CONCURRENCY), default=None, metavar="N",
                   help="at most N requests in flight (default: no limit)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="replay only the first N requests")
    p.add_argument("--plot", metavar="PNG",
                   help="write a plot: TTFT over time and hit rate by tier (needs the plot "
                        "extra)")
    p.add_argument("--records", metavar="FILE",
                   help="write one JSON line per request (times, tokens, hits, errors)")
    p.add_argument("--session-hints", metavar="TTL[,PRIORITY]",
                   help="send each session's requests with cache hints: its chain pinned "
                   "for TTL s between turns, and PRIORITY (-10..10) (kv_transfer_params)")
    p.add_argument("--background-priority", type=int_in(-10, 10), default=None, metavar="P",
                   help="requests of no session get this retention priority")
    ref = p.add_argument_group("reference target")
    ref.add_argument("--config", metavar="FILE", help="lmc YAML config (default: lmc demo's)")
    ref.add_argument("--no-lmc", action="store_true", help="the engine alone (a baseline)")
    ref.add_argument("--threads", type=int_in(1, MAX_THREADS), default=None, metavar="N",
                     help="torch threads (default: half the cores)")
    ref.add_argument("--max-num-seqs", type=int_in(1, MAX_CONCURRENCY), default=None, metavar="N",
                     help="engine batch size (default: lmc demo's)")
    ref.add_argument("--blend", action="store_true",
                     help="reuse the trace's marked segments anywhere in a prompt (lmc.blend; "
                          "on only for a model with a passing lmc quality verdict)")
    ref.add_argument("--blend-ratio", type=float_in(0, 1), default=None, metavar="R",
                     help="recompute ratio (default: the smallest a verdict passed)")
    ref.add_argument("--blend-verdicts", metavar="DIR", default=None,
                     help="the folder of lmc quality verdicts the gate reads (default: "
                          "lmc_quality next to the model's config.json)")
    ref.add_argument("--blend-override", action="store_true",
                     help="blend without a passing verdict (logged as a warning; outputs may "
                          "differ from full prefill)")
    http = p.add_argument_group("HTTP target")
    http.add_argument("--model", metavar="NAME",
                      help="model name to ask for (default: the first in /v1/models)")
    http.add_argument("--openai-strict", action="store_true",
                      help="send only standard OpenAI fields (no ignore_eos / "
                           "return_token_ids): answers may then stop early")
    http.add_argument("--timeout", type=float_in(0, MAX_TIMEOUT_S, low_open=True),
                      default=600.0, metavar="S",
                      help="per-request timeout in seconds (default %(default)s)")
    p.set_defaults(func=_replay)


def register_cli(sub: Any) -> None:
    _register_replay(sub)
