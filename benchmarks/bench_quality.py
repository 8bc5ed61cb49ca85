"""The quality harness on the real model: every lossy KV feature's figures, and the yardstick
the thresholds were chosen against.

One ``lmc quality`` run (SmolLM2-135M-Instruct, fp32, the bundled document-QA set and text)
measures blending at several recompute ratios and ``kv-cast`` at each narrower float, then,
as the yardstick, the same weights run in bfloat16 (the whole model, its own KV): the
difference every bf16 deployment of an fp32 checkpoint accepts. Printed as RESULTS.md tables
(``--record`` appends them), with each setting's verdict under the default thresholds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from lmc.quality.check import DEFAULT_THRESHOLDS, QualityRun
from lmc.quality.cli import markdown_table
from lmc.quality.feature import load_feature
from lmc.quality.runner import SequenceRunner
from lmc.quality.verdict import Verdict, VerdictStore
from lmc.user_cache import cache_dir

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blend", default="0,0.05,0.15,0.3,0.5,0.7,0.85,1")
    ap.add_argument("--cast", default="bfloat16,float16,float8_e4m3fn,float8_e5m2")
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--no-yardstick", action="store_true", help="skip the bf16 model run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--verdicts", type=Path, default=None,
                    help="where the verdicts go (default: the folder bench_blend.py's gate "
                         "reads, so it need not measure again)")
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lmc.models import checkpoint_dir

    model = checkpoint_dir("smollm2-135m-instruct", "fp32")
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    run = QualityRun(model, questions=args.questions, say=print)
    store = VerdictStore(args.verdicts or cache_dir() / "bench" / "verdicts" / model.name)
    rows: list[Verdict] = []

    def measured(v: Verdict) -> None:
        store.write(v)
        print(v.feature, v.setting, v.passed, v.failed, flush=True)

    for name, settings in (("kv-cast", args.cast), ("blend", args.blend)):
        feature = load_feature(name)
        chosen = [feature.parse_setting(s) for s in settings.split(",") if s]
        rows += run.judge(feature, chosen, measured=measured)
    yardstick = None
    if not args.no_yardstick:
        print("yardstick: the model in bfloat16")
        other = SequenceRunner(model, "bfloat16", capacity=run.model.max_len)
        m = run.harness.measure_model(other)
        failed = DEFAULT_THRESHOLDS.failures(m)
        yardstick = Verdict(run.model_id, "float32", "model-in", "bfloat16", not failed, failed,
                            DEFAULT_THRESHOLDS, m, run.workload.description)
    elapsed = time.perf_counter() - t0
    w = run.workload.description
    t = DEFAULT_THRESHOLDS
    lines = [
        "",
        f"### Quality of lossy KV on the real model (`python benchmarks/bench_quality.py`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"SmolLM2-135M-Instruct, fp32, {run.model_id}; {w['questions']} bundled questions "
        f"({w.get('qa')}, each over two documents, answers up to {w['answer_tokens']} tokens, "
        f"teacher-forced on the exact-KV answer) and the `{w.get('text')}` text "
        f"({w.get('text_context_tokens')} tokens of context served, the rest scored); "
        f"{args.threads} torch thread(s), load average {load0:.1f} at start, {elapsed:.0f} s "
        f"in all. Default thresholds: mean KL <= {t.kl_mean_max}, top-1 >= {t.top1_min}, "
        f"perplexity change <= +{t.ppl_change_max:.0%}, QA agreement >= {t.qa_agreement_min}. "
        f"`model-in bfloat16` is the yardstick: the same weights run in bf16, their own KV "
        f"included.",
        "",
        *markdown_table(rows + ([yardstick] if yardstick else [])),
        "",
        "Seconds per setting (this process, over all cases): " + ", ".join(
            f"{v.feature} {v.setting} {v.measurement.seconds:.0f}" for v in rows) + ".",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.record:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
