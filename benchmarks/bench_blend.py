"""Blending vs prefix caching on a RAG-shaped workload, on the reference engine, gated by
``lmc quality`` on the same model.

A pool of documents; each query puts ``k`` of them, in a random order, between one system
prompt and a new question (``lmc.blend.rag_workload``). The same queries run on fresh engines
and caches, taking turns query by query: the engine alone (no cache), through lmc with prefix
caching only (the plain reference connector), and blended (the blend connector) at the ratio
the quality gate chooses for this model and at ``--also-ratios`` (forced on, and labelled so,
where no verdict covers them). The gate's verdicts are measured first (``lmc quality
--feature blend`` at ``--gate-ratios``, into ``--verdicts``) unless that folder already holds
them. Printed: TTFT p50/p95 over the queries after the warm-up (the first ``docs`` queries,
by which time most documents have been seen), prompt tokens reused, what the blender
recomputed, the gate's decision, and one table per ratio joining the verdict's quality
figures to the TTFT measured here. ``--record`` appends it all to benchmarks/RESULTS.md.

``--model``: a checkpoint folder or a model ``lmc model get`` knows (default
smollm2-135m-instruct, fp32); ``--random`` uses a random-weight one of
``--hidden``/``--layers`` instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from lmc.blend.blender import DEFAULT_RATIO
from lmc.blend.rag_workload import make_rag_workload
from lmc.blend.setting import BlendRatios
from lmc.connectors.core.model_id import model_identity
from lmc.quality.check import run_quality
from lmc.quality.cli import markdown_table, resolve_model
from lmc.quality.gate import decide
from lmc.quality.verdict import Verdict, VerdictStore
from lmc.reference import LLM, make_tiny_checkpoint
from lmc.user_cache import cache_dir

ROOT = Path(__file__).resolve().parents[1]
LMC_L1 = "512MiB"  # prefix-only: a prefix chain per query
BLEND_L1 = "256MiB"  # blended: the system prompt and each document once


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


class Mode:
    """One engine and cache, and the figures of the queries it ran after the warm-up."""

    def __init__(self, model: Path, lmc: dict | None, blend: dict | None,
                 blocks: int) -> None:
        kw = dict(num_blocks=blocks, max_num_batched_tokens=4096, max_num_seqs=1)
        self.llm = LLM(model, lmc_config=lmc, blend=blend, **kw)
        self.lmc = lmc is not None  # False: the engine alone, no connector
        self.blend = blend
        self.blender = getattr(self.llm.kv_connector, "blender", None)
        self.ttfts: list[float] = []
        self.cpu: list[float] = []  # this process's CPU seconds per query: blind to other load
        self.reused = self.total = 0

    def run(self, ids: list[int], spans: list[tuple[int, int]], count: bool) -> None:
        before = self.blender.stats.tokens_reused if self.blender else 0
        c0 = time.process_time()
        out = self.llm.generate(ids, max_tokens=1, segments=spans if self.blend else None)[0]
        if count:
            self.cpu.append(time.process_time() - c0)
            self.ttfts.append(out.ttft_s)
            seg = (self.blender.stats.tokens_reused - before) if self.blender else 0
            self.reused += out.num_cached_tokens + seg
            self.total += len(ids)

    def p(self, q: float) -> float:
        return percentile(self.ttfts, q)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=36)
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--doc-words", type=int, default=120)
    ap.add_argument("--model", default="smollm2-135m-instruct", metavar="DIR|NAME",
                    help="checkpoint folder or a model lmc model get knows (default "
                    "%(default)s, fp32)")
    ap.add_argument("--random", action="store_true", help="a random-weight model")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--verdicts", type=Path, default=None,
                    help="the gate's verdict folder (default: one per model in lmc's cache)")
    ap.add_argument("--gate-ratios", default="0,0.05,0.15,0.3,0.5,0.7,0.85",
                    help="ratios measured when the folder has no blend verdicts")
    ap.add_argument("--gate-questions", type=int, default=None,
                    help="bundled questions the gate measures (default: all)")
    ap.add_argument("--also-ratios", type=lambda t: [float(x) for x in t.split(",") if x],
                    default=[0.15, 0.3, 0.5, 0.7, 0.85, 1.0],
                    help="blended ratios run besides the gate's")
    ap.add_argument("--no-engine-alone", action="store_true",
                    help="leave out the engine without lmc (no cache)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    return ap.parse_args()


def the_model(args: argparse.Namespace) -> tuple[Path, str]:
    if args.random:
        path = make_tiny_checkpoint(cache_dir() / "bench" / f"blend-h{args.hidden}-l{args.layers}",
                                    seed=7, hidden=args.hidden, layers=args.layers, heads=8,
                                    kv_heads=4, vocab=2048, max_position_embeddings=4096)
        return path, (f"random-weight model (hidden {args.hidden}, {args.layers} layers)")
    path = resolve_model(args.model, "float32")
    if path.name.startswith("smollm2-135m-instruct"):
        return path, "SmolLM2-135M-Instruct"
    return path, path.name


def gate_verdicts(model: Path, store: VerdictStore, args: argparse.Namespace
                  ) -> list[Verdict]:
    """The blend verdicts in ``store``, measured now where there are none."""
    found = [e for _, e in store.entries("blend", "float32") if isinstance(e, Verdict)]
    if found:
        print(f"gate: {len(found)} blend verdicts from {store.folder}", flush=True)
        return found
    rules = BlendRatios()
    from lmc.blend.lossy import BlendFeature

    ratios = [rules.parse_setting(r) for r in args.gate_ratios.split(",")]
    print(f"gate: measuring blend at {', '.join(ratios)} (lmc quality)", flush=True)
    return run_quality(model, BlendFeature(), ratios, questions=args.gate_questions,
                       say=lambda line: print(line, flush=True), measured=store.write)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model, model_name = the_model(args)
    model_id = model_identity(model)
    store = VerdictStore(args.verdicts or cache_dir() / "bench" / "verdicts" / model.name)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    verdicts = sorted(gate_verdicts(model, store, args), key=lambda v: float(v.setting))
    decision = decide(store, BlendRatios(), model_id, "float32")
    print(f"gate: {'on at ' + decision.setting if decision.on else 'off'} ({decision.why})")
    t1 = time.perf_counter()
    llm = LLM(model, num_blocks=8)
    assert llm.tokenizer is not None
    encode = llm.tokenizer.encode
    wl = make_rag_workload(num_docs=args.docs, doc_words=args.doc_words, k=args.k,
                           num_queries=args.queries, seed=11)
    queries = [wl.prompt_tokens(q, encode) for q in wl.queries]
    blocks = max(len(ids) for ids, _ in queries) // 16 + 8  # the longest prompt, once
    ratios = sorted({*([float(decision.setting)] if decision.setting else []),
                     *args.also_ratios})
    covered = {r: decide(store, BlendRatios(), model_id, "float32", f"{r:g}").on
               for r in ratios}
    prefix = Mode(model, {"chunk_size": 256, "local_cpu_size": LMC_L1}, None, blocks)
    alone = [] if args.no_engine_alone else [Mode(model, None, None, blocks)]
    modes = alone + [prefix] + [
        Mode(model, {"chunk_size": 256, "local_cpu_size": BLEND_L1},
             {"ratio": r, "verdicts": str(store.folder), "override": not covered[r]}, blocks)
        for r in ratios]
    for i, (ids, spans) in enumerate(queries):  # interleaved: every mode sees the same load
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            mode.run(ids, spans, i >= args.docs)
            print(f"\rquery {i + 1}/{len(queries)}", end="", flush=True)
    print()
    for mode in modes:
        mode.llm.close()
    default_decision = decide(store, BlendRatios(), model_id, "float32",
                              f"{DEFAULT_RATIO:g}")
    text = report(args, model_name, modes, prefix, queries, verdicts, decision, covered,
                  load0, t1 - t0, time.perf_counter() - t1, default_decision)
    print(text)
    if args.record:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
            f.write(text)
    return 0


def _verdict_row(v: Verdict | None) -> str:
    if v is None:
        return "| - | - | - | - | no verdict |"
    m = v.measurement
    verdict = "**PASS**" if v.passed else "FAIL (" + "; ".join(v.failed) + ")"
    return (f"| {m.kl_mean:.4f} | {m.top1:.3f} | {m.ppl_change:+.2%} | "
            f"{round(m.qa_agreement * m.questions)}/{m.questions} | {verdict} |")


def report(args: argparse.Namespace, model_name: str, modes: list[Mode], prefix: Mode,
           queries: list, verdicts: list[Verdict], decision, covered: dict, load0: float,
           gate_s: float, replay_s: float, default_decision) -> str:
    mean_len = statistics.fmean(len(ids) for ids, _ in queries)
    alone = next((m for m in modes if not m.lmc), None)
    load1 = os.getloadavg()
    command = "python benchmarks/bench_blend.py " + " ".join(sys.argv[1:])
    lines = [
        "",
        f"### Blending vs prefix caching, RAG workload (`{command.strip()}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Reference engine on CPU, {model_name} (fp32, {args.threads} torch thread(s)), "
        f"{args.queries} queries: {args.k} of {args.docs} documents ({args.doc_words} words "
        f"each) in random order + a new question, {mean_len:.0f} prompt tokens on average; "
        f"figures over the {len(prefix.ttfts)} queries after the first {args.docs}, the "
        f"engines taking turns query by query (every mode sees the same load); lmc L1 "
        f"{LMC_L1} (prefix-only) / {BLEND_L1} (blended: segments only), chunk 256; load "
        f"average {load0:.1f} at start, {load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f} "
        f"(1/5/15 min) at the end; gate {gate_s:.0f} s, replay {replay_s:.0f} s. CPU is this "
        f"process's CPU time per query (blind to the machine's other load); the ratios are "
        f"medians of per-query ratios, so they compare modes under the same load.",
        "",
        "| mode | TTFT p50 | TTFT p95 | prompt tokens reused | CPU per query p50 | TTFT vs "
        "prefix-only | TTFT vs no cache | CPU vs prefix-only |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(base: Mode | None, mode: Mode, cpu: bool = False) -> str:
        if base is None:
            return "-"
        a, b = (base.cpu, mode.cpu) if cpu else (base.ttfts, mode.ttfts)
        return f"{statistics.median(y / x for x, y in zip(a, b, strict=True)):.2f}"

    def name_of(mode: Mode) -> str:
        if not mode.lmc:
            return "no cache (engine alone)"
        if mode is prefix:
            return "prefix caching only"
        r = mode.blend["ratio"]
        if decision.setting is not None and r == float(decision.setting):
            gate = "the gate's ratio"
        else:
            gate = "a verdict covers it" if covered[r] else "override: no verdict covers it"
        return f"blended, ratio {r:.2f} ({gate})"

    for mode in modes:
        lines.append(f"| {name_of(mode)} | {mode.p(0.5) * 1e3:.1f} ms | "
                     f"{mode.p(0.95) * 1e3:.1f} ms | {mode.reused / mode.total:.1%} | "
                     f"{percentile(mode.cpu, 0.5) * 1e3:.0f} ms | **{ratio(prefix, mode)}** | "
                     f"{ratio(alone, mode)} | {ratio(prefix, mode, True)} |")
    for mode in modes:
        if mode.blender is None:
            continue
        s = mode.blender.stats.as_dict()
        lines += ["", f"Blender at {mode.blend['ratio']:.2f}, all {args.queries} queries: "
                  f"{s.get('segments_hit', 0)} segments loaded ({s.get('tokens_reused', 0)} "
                  f"tokens), {s.get('segments_computed', 0)} computed alone and stored "
                  f"({s.get('tokens_computed_alone', 0)} tokens), "
                  f"{s.get('tokens_recomputed', 0)} cached tokens recomputed."]
    by_setting = {v.setting: v for v in verdicts}
    v0 = verdicts[0] if verdicts else None
    lines += ["", f"Quality and TTFT per recompute ratio: the verdicts of `lmc quality --feature "
              f"blend` on this model ({v0.workload.get('questions') if v0 else 0} bundled "
              f"questions, {v0.workload.get('answer_tokens') if v0 else 0}-token answers, "
              f"text {v0.workload.get('text') if v0 else '-'}; thresholds KL <= "
              f"{v0.thresholds.kl_mean_max if v0 else '-'}, top-1 >= "
              f"{v0.thresholds.top1_min if v0 else '-'}, perplexity <= "
              f"+{v0.thresholds.ppl_change_max if v0 else 0:.0%}, QA agreement >= "
              f"{v0.thresholds.qa_agreement_min if v0 else '-'}) beside this replay's TTFT.",
              "", "| ratio | KL mean | top-1 | perplexity change | QA agreement | verdict | "
              "TTFT p50 | TTFT vs prefix-only | TTFT vs no cache |",
              "|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for mode in modes:
        if mode.blend is None:
            continue
        r = mode.blend["ratio"]
        lines.append(f"| {r:g} {_verdict_row(by_setting.get(f'{r:g}'))} "
                     f"{mode.p(0.5) * 1e3:.1f} ms | {ratio(prefix, mode)} | "
                     f"{ratio(alone, mode)} |")
    lines += ["", f"The gate on this model, blending asked with no ratio (the connector's "
              f"default, `blend=True`): **{'on at ratio ' + decision.setting if decision.on else 'off'}"
              f"** ({decision.why}). Asked at the blender's default ratio "
              f"{DEFAULT_RATIO:g} (what `override: true` runs with no ratio): **"
              f"{'on' if default_decision.on else 'off'}** ({default_decision.why}).",
              "", *markdown_table(verdicts)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
