"""Size lmc's tiers for a trace: per-tier hit rate and predicted TTFT for a grid of L1, disk
and remote sizes and write policies, from lmc's own chunking, keys and tier classes, with no
KV bytes moved.

  lmc plan --calibrate [--model DIR]        measure prefill and tier loads here (once)
  lmc plan TRACE --l1 1GiB,4GiB,16GiB --disk 0,100GiB --policy write_through,write_on_evict

TTFT comes from the calibration profile (prefill time per length, load bandwidth per tier,
measured on this machine); without one, `lmc plan` says how to make it. The table lists
every configuration; --target-hit-rate names the smallest one reaching it (least L1 first,
then remote, then disk); --plot draws hit rate and TTFT over L1 size with the knee marked.
See docs/planner.md for what is modelled and how it was validated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from lmc.cli_args import int_in, positive_int
from lmc.settings import parse_size

PLAN_SUMMARY = "size the cache tiers for a trace: hit rate and predicted TTFT per configuration"

# Bounds of the numeric options (docs/threats/cli.md): past them a run would overflow a
# C integer, allocate without end, or mean nothing.
MAX_SIZE = 1 << 50  # 1 PiB per tier
MAX_CHUNK = 1 << 20  # tokens per chunk (and --align, --lengths, --load-tokens, a step)
MAX_KV_BYTES_PER_TOKEN = 1 << 30
MAX_JOBS = 1024
MAX_REPS = 1000


def _sizes(text: str, what: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            size = 0 if part == "0" else parse_size(part, what)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if size > MAX_SIZE:
            raise argparse.ArgumentTypeError(f"{what} {part!r}: at most 1PiB")
        out.append(size)
    if not out:
        raise argparse.ArgumentTypeError(f"{what}: give at least one size (e.g. 4GiB)")
    return out


def _policies(text: str) -> list[str]:
    from lmc.storage.manager import WRITE_POLICIES

    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in WRITE_POLICIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--policy {bad[0] if bad else text!r}: choose from "
                                         f"{', '.join(WRITE_POLICIES)}")
    return out


def _rate(text: str) -> float:
    try:
        v = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--target-hit-rate {text!r}: a fraction such as "
                                         f"0.8 (or 80%)") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"--target-hit-rate {text!r}: must be in (0, 1]")
    return v


def _lengths(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: token counts such as "
                                         f"256,1024,4096") from None
    if len(out) < 2 or out[0] < 1 or out[-1] > MAX_CHUNK:
        raise argparse.ArgumentTypeError(f"--lengths: at least two token counts in "
                                         f"[1, {MAX_CHUNK}]")
    return out


def register_cli(sub: Any) -> None:
    from lmc.cli_args import add_command

    p = add_command(sub, "plan", PLAN_SUMMARY, __doc__)
    p.add_argument("trace", nargs="?", metavar="TRACE", help="JSONL trace (docs/workloads.md)")
    p.add_argument("--l1", type=lambda t: _sizes(t, "--l1"), default=[1 << 30, 4 << 30, 16 << 30],
                   metavar="SIZES", help="L1 (CPU pool) sizes, comma-separated "
                   "(default 1GiB,4GiB,16GiB)")
    p.add_argument("--disk", type=lambda t: _sizes(t, "--disk"), default=[0], metavar="SIZES",
                   help="disk tier sizes, 0 = none (default 0)")
    p.add_argument("--remote", type=lambda t: _sizes(t, "--remote"), default=[0],
                   metavar="SIZES", help="remote tier (an lmc daemon's memory) sizes, 0 = none")
    p.add_argument("--policy", type=_policies, default=["write_through"], metavar="POLICIES",
                   help="write policies: write_through,write_on_evict (default write_through)")
    p.add_argument("--target-hit-rate", type=_rate, metavar="RATE",
                   help="name the smallest configuration whose hit rate reaches RATE (0.8)")
    p.add_argument("--plot", metavar="PNG", help="draw hit rate and TTFT over L1 size here")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--profile", metavar="PATH",
                   help="calibration profile (default ~/.cache/lmc/plan-profile.json)")
    p.add_argument("--no-ttft", action="store_true",
                   help="hit rates only: no calibration profile needed (also what a plan "
                   "without a profile at the default place gives)")
    p.add_argument("--kv-bytes-per-token", type=int_in(1, MAX_KV_BYTES_PER_TOKEN), metavar="N",
                   help="KV bytes per token (default: the profile's model's, else --model's "
                   "or --tokenizer's checkpoint's, else the calibration model's 8 KiB)")
    p.add_argument("--codec", metavar="CODEC",
                   help="the disk and remote tiers hold KV through this codec (fp8-e4m3, "
                   "int8, int4-kivi...; docs/codecs.md): each holds that much more KV")
    p.add_argument("--kv-dtype", choices=("float32", "float16", "bfloat16"), default="bfloat16",
                   help="the engine's KV dtype, for --codec's ratio (default bfloat16)")
    p.add_argument("--head-size", type=int_in(1, 4096), default=None, metavar="N",
                   help="KV head size, for --codec's scales (default: --model's, else 128)")
    p.add_argument("--chunk-size", type=int_in(1, MAX_CHUNK), default=None, metavar="N",
                   help="tokens per chunk (default: the profile's, else 256)")
    p.add_argument("--align", type=int_in(1, MAX_CHUNK), default=1, metavar="N",
                   help="round hits down to N tokens (an engine loading whole blocks: vLLM's "
                        "block size; the reference engine: 1)")
    p.add_argument("--step-tokens", type=int_in(0, MAX_CHUNK), default=0, metavar="N",
                   help="the engine's token budget per step under chunked prefill (vLLM's "
                        "max_num_batched_tokens, the reference engine's): TTFT is predicted "
                        "as lmc's load policy decides for it (default 0: no chunked prefill)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer.json, or a checkpoint directory holding one: turns text "
                        "prompts into ids (the engine's own, so keys match what it caches)")
    p.add_argument("--limit", type=positive_int, metavar="N",
                   help="plan the first N requests only")
    p.add_argument("--jobs", type=int_in(0, MAX_JOBS), default=0, metavar="N",
                   help="grid points simulated in parallel (default 0: one per core)")
    g = p.add_argument_group("calibration (lmc plan --calibrate)")
    g.add_argument("--calibrate", action="store_true", help="measure and store the profile")
    g.add_argument("--model", metavar="DIR", help="checkpoint to measure (default: a small "
                   "random-weight Llama made on first use)")
    g.add_argument("--lengths", type=_lengths, default=[256, 1024, 2048, 4096],
                   metavar="N,N,...", help="prefill lengths to measure")
    g.add_argument("--load-tokens", type=int_in(1, MAX_CHUNK), default=4096, metavar="N",
                   help="tokens per tier-load measurement")
    g.add_argument("--reps", type=int_in(1, MAX_REPS), default=3, metavar="N",
                   help="repetitions per figure")
    g.add_argument("--threads", type=int_in(0, 4096), default=0, metavar="N",
                   help="torch threads the engine computes with while measured (default 0: "
                   "half the cores, as lmc replay and lmc demo run it)")
    g.add_argument("--disk-dir", metavar="DIR", help="where the disk-tier measurement writes")
    g.add_argument("--remote-url", "--redis", dest="remote_url", metavar="URL",
                   help="also measure this remote tier (redis://, lmc://, mooncake://..., "
                   "any remote_url; --redis is the old name)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    if not args.trace:
        print("lmc plan: give a TRACE to plan (or --calibrate to measure this machine)",
              file=sys.stderr)
        return 2
    try:
        return _plan(args)
    except (ValueError, OSError) as e:  # InputError (a ValueError) names file:line
        hint = " (give lmc plan --tokenizer PATH)" if "tokenizer is needed" in str(e) else ""
        print(f"lmc plan: {e}{hint}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    from lmc.demo import default_threads
    from lmc.planner.calibrate import CalibrationRefused, calibrate
    from lmc.planner.costmodel import default_profile_path

    path = Path(args.profile) if args.profile else default_profile_path()
    try:
        prof = calibrate(args.model, lengths=args.lengths, reps=args.reps,
                         load_tokens=args.load_tokens, chunk_size=args.chunk_size or 256,
                         disk_dir=args.disk_dir, remote_url=args.remote_url,
                         threads=args.threads or default_threads())
    except CalibrationRefused as e:  # measured, but nonsense: the old profile stays
        kept = (f"the previous profile {path} is kept" if path.is_file()
                else f"no profile written to {path}")
        print(f"lmc plan --calibrate: refused: {e}.\n{kept}; was the machine busy? Measure "
              "again on a quieter machine, or with more --reps (each figure is the median of "
              "its quieter rounds). Meanwhile `lmc plan TRACE` plans hit rates without TTFT.",
              file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"lmc plan --calibrate: {e}", file=sys.stderr)
        return 2
    path = prof.save(path)
    print(f"calibration profile written to {path}")
    return 0


def _kv_bytes_per_token(args: argparse.Namespace) -> int:
    """KV bytes per token without a profile: ``--model``'s or ``--tokenizer``'s checkpoint's
    (its config.json, as the reference engine holds it: fp32), else the calibration model's,
    said on stderr (the sizes a plan compares are in bytes)."""
    from lmc.planner.calibrate import DEFAULT_KV_BYTES_PER_TOKEN, kv_bytes_per_token

    for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        if value and (Path(value).expanduser() / "config.json").is_file():
            bpt = kv_bytes_per_token(Path(value).expanduser())
            print(f"lmc plan: {bpt:,} bytes of KV per token, from {flag} {value}'s config.json "
                  "(fp32; --kv-bytes-per-token for your engine's dtype)", file=sys.stderr)
            return bpt
    print(f"lmc plan: {DEFAULT_KV_BYTES_PER_TOKEN:,} bytes of KV per token, the calibration "
          "model's (give --kv-bytes-per-token, or --model DIR, for yours)", file=sys.stderr)
    return DEFAULT_KV_BYTES_PER_TOKEN


def _hybrid_bytes(args: argparse.Namespace, chunk: int, trace: Any, bpt: int) -> int:
    """``--model``'s bytes per token if it is a hybrid sliding-window/full model: what lmc
    stores of the trace's prompts (its sliding layers only around each prompt's
    checkpoints), said on stderr beside every layer's."""
    if not args.model or not (Path(args.model).expanduser() / "config.json").is_file():
        return bpt
    from lmc.planner.calibrate import hybrid_bytes_per_token

    got = hybrid_bytes_per_token(Path(args.model).expanduser(), chunk,
                                 [int(n) for n in trace.num_tokens])
    if got is None:
        return bpt
    stored, every, words = got
    print(f"lmc plan: hybrid model ({words}): {stored:,.0f} bytes of KV stored per prompt "
          f"token of this trace, {every:,} for every layer of every token (fp32)",
          file=sys.stderr)
    return max(1, round(stored))

def _codec_ratio(args: argparse.Namespace, chunk: int) -> float:
    """Stored bytes per KV byte under ``--codec`` (a full chunk of two planes of 8 heads),
    said on stderr with what it gives: the disk and remote sizes planned are the KV held."""
    import torch

    from lmc.storage.kvcodecs.stage import parse_stage
    from lmc.units import size

    head = args.head_size
    if head is None and args.model and (Path(args.model).expanduser() / "config.json").is_file():
        from lmc.reference.model_config import ModelConfig

        head = ModelConfig.from_file(Path(args.model).expanduser() / "config.json").head_dim
    head = head or 128
    stage = parse_stage(args.codec, "--codec", head)
    dtype = getattr(torch, args.kv_dtype)
    shape = (1, 2, chunk, 8 * head)
    raw = 2 * chunk * 8 * head * dtype.itemsize
    ratio = (stage.coded_bytes(shape, dtype) if stage.encodes(dtype) else raw) / raw
    held = ", ".join(f"{size(d)} disk holds {size(int(d / ratio))}" for d in args.disk if d)
    print(f"lmc plan: codec {stage.ident} stores {ratio:.3f} of {args.kv_dtype} KV "
          f"(head size {head}){': ' + held if held else ''}; the disk and remote sizes below "
          "are the KV they hold (a lossless stage's gain is not counted)", file=sys.stderr)
    return ratio


def _plan(args: argparse.Namespace) -> int:
    from lmc.planner import report
    from lmc.planner.costmodel import Profile, default_profile_path
    from lmc.planner.keys import load_trace
    from lmc.planner.sim import grid, run_grid

    profile = None
    if not args.no_ttft:
        if args.profile or default_profile_path().is_file():
            profile = Profile.load(args.profile)
        else:  # nothing measured yet: hit rates, which need no profile, and how to get TTFT
            print(f"lmc plan: no calibration profile at {default_profile_path()}: hit rates "
                  "only (for TTFT measure this machine once: lmc plan --calibrate)",
                  file=sys.stderr)
    if profile is not None:
        from lmc.planner.calibrate import refusals

        why = refusals(profile)  # one saved before calibration checked its fit
        if why:
            raise ValueError(f"calibration profile {args.profile or default_profile_path()}: "
                             f"{'; '.join(why)}; make it again with `lmc plan --calibrate` "
                             "(or plan hit rates alone with --no-ttft)")
    bpt = args.kv_bytes_per_token or (profile.kv_bytes_per_token if profile else None) \
        or _kv_bytes_per_token(args)
    if args.chunk_size is not None:
        chunk = args.chunk_size
    else:
        chunk = profile.chunk_size if profile else 256
    tok = None
    if args.tokenizer:
        from lmc.workloads.generators import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
    t0 = time.perf_counter()
    trace = load_trace(args.trace, chunk_size=chunk, tokenizer=tok, limit=args.limit)
    t_keys = time.perf_counter() - t0
    if not len(trace):
        raise ValueError(f"{args.trace}: no requests")
    if not args.kv_bytes_per_token and profile is None:  # a hybrid model stores less
        bpt = _hybrid_bytes(args, chunk, trace, bpt)
    disk, remote = args.disk, args.remote
    if args.codec:
        ratio = _codec_ratio(args, chunk)
        disk = [int(d / ratio) for d in disk]
        remote = [int(r / ratio) for r in remote]
    points = grid(args.l1, disk, remote, args.policy)
    t1 = time.perf_counter()
    results = run_grid(trace, points, bytes_per_token=bpt, align=args.align,
                       jobs=args.jobs or None, step_tokens=args.step_tokens)
    t_sim = time.perf_counter() - t1
    table, base = report.rows(results, trace, profile, args.step_tokens)
    knees = {k.point for c in report.series(table).values() if (k := report.knee(c))}
    best = report.smallest_reaching(table, args.target_hit_rate) \
        if args.target_hit_rate else None
    if args.plot:
        report.plot(table, args.plot, title=f"{Path(args.trace).name}: {len(trace):,} requests, "
                    f"{trace.prompt_tokens:,} prompt tokens")
    if args.json:
        print(json.dumps({
            "trace": args.trace, "requests": len(trace), "prompt_tokens": trace.prompt_tokens,
            "distinct_chunks": trace.num_keys, "kv_bytes_per_token": bpt, "chunk_size": chunk,
            "no_cache_ttft_mean_s": base, "profile": args.profile if profile else None,
            "step_tokens": args.step_tokens,
            "results": [r.to_json() for r in table],
            "knees": [r.to_json() for r in table if r.point in knees],
            "target_hit_rate": args.target_hit_rate,
            "smallest_reaching_target": best.to_json() if best else None,
            "seconds": {"keys": t_keys, "simulation": t_sim}}, indent=1))
        return 0
    from lmc import units

    print(f"{args.trace}: {len(trace):,} requests, {trace.prompt_tokens:,} prompt tokens, "
          f"{trace.num_keys:,} distinct chunks of {chunk} tokens, "
          f"{units.size(bpt)} of KV per token")
    print(report.format_table(table, base, knees))
    if profile is not None:
        print(report.step_budget(args.step_tokens))
    if args.target_hit_rate:
        print(f"smallest configuration reaching {100 * args.target_hit_rate:.0f}%: "
              + (report.describe(best) if best else "none in this grid (try larger sizes)"))
    if args.plot:
        print(f"plot written to {args.plot}")
    print(f"keys {units.seconds(t_keys)}, simulation of {len(points)} configurations "
          f"{units.seconds(t_sim)}")
    return 0
