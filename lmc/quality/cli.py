"""Judge a lossy KV feature on one model against exact KV, and write its verdicts.

``lmc quality --model DIR|NAME [--feature blend] [--settings 0,0.15,...]`` runs the model on
the bundled document-QA prompts (each question over two documents) and a bundled text, with
exact KV and with the KV the feature serves at each setting, and prints per setting: the mean
and largest KL divergence of the next-token distributions over the answers (teacher-forced on
the exact-KV answer), their top-1 agreement, the perplexity change on the text, and how many
greedy answers stay identical (and correct). A setting passes when it is within every
threshold; its verdict, bound to the weights' identity, the dtype, the feature and the
setting, is written to ``<model>/lmc_quality/`` (or ``--verdicts DIR``), signed when an
integrity secret is configured (``--config``, ``LMC_INTEGRITY_SECRET``). A feature's gate
turns it on only where a verdict passed. ``--list`` prints the verdicts already there.
Features: blend (a setting is a recompute ratio), kv-cast (a float type), kv-codec (a codec
and its parameters, docs/codecs.md); docs/quality.md.
Exit status: 0 when a setting passed, 1 when none did, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lmc.quality.feature import FEATURES, LossyKVFeature, load_feature
from lmc.quality.verdict import Thresholds, Verdict, VerdictStore

MAX_SETTINGS = 16
HEADER = (f"{'feature':8s} {'setting':>13s} {'KL mean':>8s} {'KL max':>7s} {'top-1':>6s} "
          f"{'ppl exact->served':>18s} {'change':>7s} {'QA agree':>8s} {'same':>6s} "
          f"{'correct':>7s}  verdict")


def format_row(v: Verdict) -> str:
    m = v.measurement
    ppl = f"{_ppl(m.ppl_exact)}->{_ppl(m.ppl_served)}" if m.text_tokens else "-"
    agree = f"{round(m.qa_agreement * m.questions)}/{m.questions}"
    same = f"{round(m.qa_identical * m.questions)}/{m.questions}"
    correct = f"{m.qa_correct_served}/{m.qa_correct_exact}"
    verdict = "PASS" if v.passed else "FAIL: " + "; ".join(v.failed)
    return (f"{v.feature:8s} {v.setting:>13s} {m.kl_mean:8.4f} {m.kl_max:7.3f} {m.top1:6.3f} "
            f"{ppl:>18s} {m.ppl_change:+7.2%} {agree:>8s} {same:>6s} {correct:>7s}  {verdict}")


def _ppl(x: float) -> str:
    return f"{x:.2f}" if x < 1000 else f"{x:.3g}"


def markdown_table(verdicts: Sequence[Verdict]) -> list[str]:
    """The RESULTS.md rows for these verdicts."""
    out = ["| feature | setting | KL mean (nats) | KL max | top-1 | perplexity exact -> served "
           "| change | QA agreement | QA answers identical | QA correct (served/exact) | "
           "verdict |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for v in verdicts:
        m = v.measurement
        verdict = "**PASS**" if v.passed else "FAIL (" + "; ".join(v.failed) + ")"
        out.append(f"| {v.feature} | {v.setting} | {m.kl_mean:.4f} | {m.kl_max:.3f} | "
                   f"{m.top1:.3f} | {m.ppl_exact:.2f} -> {m.ppl_served:.2f} | "
                   f"{m.ppl_change:+.2%} | {round(m.qa_agreement * m.questions)}/{m.questions}"
                   f" | {round(m.qa_identical * m.questions)}/{m.questions}"
                   f" | {m.qa_correct_served}/{m.qa_correct_exact} | {verdict} |")
    return out


# ----------------------------------------------------------------------- CLI

def settings_list(feature: LossyKVFeature, text: str | None) -> list[str]:
    """``--settings``: comma-separated; a piece ``name=value`` is a parameter of the setting
    before it (``int4-kivi,group=64,fp8-e4m3`` is two codec settings)."""
    raw: list[str] = []
    for piece in text.split(",") if text else []:
        if "=" in piece and raw:
            raw[-1] += "," + piece
        else:
            raw.append(piece)
    raw = raw or list(feature.default_settings)
    out = list(dict.fromkeys(feature.parse_setting(s.strip()) for s in raw))
    if not 1 <= len(out) <= MAX_SETTINGS:
        raise ValueError(f"give 1 to {MAX_SETTINGS} settings, got {len(out)}")
    return out


def add_arguments(p: argparse.ArgumentParser, settings_flag: str = "--settings") -> None:
    from lmc.cli_args import float_in, int_in
    from lmc.quality.check import DEFAULT_ANSWER_TOKENS
    from lmc.quality.check import DEFAULT_THRESHOLDS as T

    p.add_argument("--model", required=True, metavar="DIR|NAME",
                   help="checkpoint directory, or a model lmc model get knows")
    p.add_argument(settings_flag, dest="settings", metavar="S,S,...",
                   help="comma-separated settings (default: the feature's)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--questions", type=int_in(1, 1000), default=None, metavar="N",
                   help="only the first N bundled questions (default: all)")
    p.add_argument("--prompts", metavar="FILE",
                   help="JSONL prompts ({\"pieces\": [segment, ..., question]} per line) "
                        "instead of the bundled questions")
    p.add_argument("--answer-tokens", type=int_in(1, 1024), default=DEFAULT_ANSWER_TOKENS,
                   metavar="N", help="longest answer compared (default %(default)s)")
    p.add_argument("--text", default="harbour", help="bundled text for the perplexity "
                   "(harbour | workshop | none; default %(default)s)")
    p.add_argument("--kl-max", type=float_in(0, 100), default=T.kl_mean_max, metavar="NATS",
                   help="largest passing mean KL (default %(default)s)")
    p.add_argument("--min-top1", type=float_in(0, 1), default=T.top1_min, metavar="F",
                   help="smallest passing top-1 agreement (default %(default)s)")
    p.add_argument("--max-ppl-change", type=float_in(0, 100), default=T.ppl_change_max,
                   metavar="F", help="largest passing relative perplexity rise "
                   "(default %(default)s)")
    p.add_argument("--min-agreement", type=float_in(0, 1), default=T.qa_agreement_min,
                   metavar="F", help="smallest passing fraction of questions answered the "
                   "same or still correctly (default %(default)s)")
    p.add_argument("--verdicts", metavar="DIR",
                   help="verdict folder (default: lmc_quality next to the model's config.json)")
    p.add_argument("--config", metavar="FILE",
                   help="lmc config: its integrity_secret (or _file) signs the verdicts, as the "
                   "engines that read them must have (LMC_INTEGRITY_SECRET works too); its "
                   "model_revision names the weights")
    p.add_argument("--threads", type=int_in(1, 256), default=None, metavar="N",
                   help="torch threads (default: half the cores)")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.add_argument("--answers", action="store_true",
                   help="print each question's exact and served answers under its setting")
    p.add_argument("--list", action="store_true",
                   help="print the verdicts already in the folder; measure nothing")


def register_cli(sub: Any) -> None:
    from lmc.cli_args import add_command

    p = add_command(sub, "quality", "judge a lossy KV feature (blending, a codec) on a model "
                    "against exact KV; write its verdicts", __doc__)
    p.add_argument("--feature", default="blend", choices=sorted(FEATURES),
                   help="the lossy KV feature (default %(default)s)")
    add_arguments(p)
    p.set_defaults(func=main, command="quality")


def resolve_model(text: str, dtype: str) -> Path:
    """A checkpoint folder, or a known model's (converted on first use)."""
    path = Path(text)
    if (path / "config.json").is_file():
        return path
    from lmc.models import known_model

    try:
        known_model(text)
    except ValueError:
        raise ValueError(f"{text} is neither a checkpoint directory (no config.json) nor a "
                         "model lmc model get knows") from None
    from lmc.models import checkpoint_dir

    return checkpoint_dir(text, "bf16" if dtype in ("bfloat16", "bf16") else "fp32",
                          progress=lambda line: print(line, file=sys.stderr))


def main(args: argparse.Namespace) -> int:
    """Run the command (``args.feature`` names the feature); exit status as documented."""
    from lmc.config import CacheConfig
    from lmc.storage.integrity import Integrity

    try:
        cfg = CacheConfig.load(args.config)
        integrity = Integrity.from_config(cfg)  # before minutes of work
        feature = load_feature(args.feature)
        settings = settings_list(feature, args.settings)
        model_dir = resolve_model(args.model, args.dtype)
        store = (VerdictStore(args.verdicts, integrity) if args.verdicts
                 else VerdictStore.next_to(model_dir, integrity))
        if args.list:
            return _list(store, args)
        thresholds = Thresholds(args.kl_max, args.min_top1, args.max_ppl_change,
                                args.min_agreement)
        verdicts = _measure(model_dir, feature, settings, thresholds, store, cfg, args)
    except (ValueError, OSError, ImportError) as e:
        print(f"lmc {args.command}: {e}", file=sys.stderr)
        return 2
    signed = " (signed with the integrity secret)" if integrity is not None else ""
    if args.json:
        print(json.dumps([asdict(v) for v in verdicts], indent=2))
    else:
        print(f"verdicts written to {store.folder}{signed}")
    passed = [v.setting for v in verdicts if v.passed]
    usable = [s for s in passed if feature.preference(s) is not None]
    choice = min(usable, key=lambda s: feature.preference(s) or 0.0) if usable else None
    if not args.json:
        if choice is not None:
            print(f"verdict: {feature.name} PASS at {', '.join(passed)}; unasked, the gate "
                  f"turns it on at {choice}")
        else:
            print(f"verdict: {feature.name} FAIL ({'passed only at ' + ', '.join(passed) if passed else 'no setting passed'}"
                  f"): it stays off for this model unless a setting is given")
    return 0 if choice is not None else 1


def _measure(model_dir: Path, feature: LossyKVFeature, settings: list[str],
             thresholds: Thresholds, store: VerdictStore, cfg: Any,
             args: argparse.Namespace) -> list[Verdict]:
    import torch

    from lmc.quality.check import run_quality

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // 2))
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    say(f"lmc {args.command}: {feature.name} at {', '.join(settings)} on {model_dir}")
    rows: list[Verdict] = []

    def measured(v: Verdict) -> None:
        store.write(v)
        if not args.json:
            if not rows:
                print(HEADER)
            print(format_row(v), flush=True)
        rows.append(v)

    return run_quality(model_dir, feature, settings, dtype=args.dtype, device=args.device,
                       thresholds=thresholds, answer_tokens=args.answer_tokens,
                       questions=args.questions, prompts=args.prompts,
                       text=None if args.text == "none" else args.text,
                       model_revision=cfg.model_revision, say=say, measured=measured,
                       answers=lambda answers: _print_answers(answers, args))


def _print_answers(answers: list[Any], args: argparse.Namespace) -> None:
    if not args.answers:
        return
    mark = {True: "right", False: "WRONG", None: "?"}
    out = sys.stderr if args.json else sys.stdout
    for a in answers:
        same = "same" if a.exact == a.served else "DIFFERS"
        print(f"    {a.case}: exact ({mark[a.exact_correct]}) {a.exact!r}", file=out)
        if a.exact != a.served:
            print(f"    {' ' * len(a.case)}  served ({mark[a.served_correct]}, {same}) "
                  f"{a.served!r}", file=out)


def _list(store: VerdictStore, args: argparse.Namespace) -> int:
    dtypes = {p.name.rsplit("@", 1)[-1].removesuffix(".json")
              for p in (store.folder.iterdir() if store.folder.is_dir() else [])
              if p.name.endswith(".json")}
    found: list[Verdict] = []
    for name in sorted(FEATURES):
        for dtype in sorted(dtypes):
            for _path, entry in store.entries(name, dtype):
                if isinstance(entry, ValueError):
                    print(f"unusable: {entry}", file=sys.stderr)
                else:
                    found.append(entry)
    if args.json:
        print(json.dumps([asdict(v) for v in found], indent=2))
    elif found:
        print(HEADER)
        for v in found:
            print(format_row(v) + f"  [{v.dtype}, {v.model_id}]")
    else:
        print(f"no verdicts in {store.folder}")
    return 0
