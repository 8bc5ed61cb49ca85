"""Blending vs prefix caching on a RAG-shaped workload, on the reference engine.

A pool of documents; each query puts ``k`` of them, in a random order, between one system
prompt and a new question (``lmc.blend.rag_workload``). The same queries run twice through
lmc, each time on a fresh engine and cache: with prefix caching only (the plain reference
connector) and with blending (the blend connector at the ratio the quality gate chose, run
first on the same model). Printed: TTFT p50/p95 over the queries after the warm-up (the
first ``docs`` queries, by which time most documents have been seen), prompt tokens reused
(from lmc's prefix hits, plus, blended, from segments), what the blender recomputed, and the
gate's quality figures per ratio. ``--record`` appends the table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from lmc.blend.gate import HEADER, default_prompts, format_row, run_check
from lmc.blend.rag_workload import make_rag_workload
from lmc.reference import LLM, make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


class Mode:
    """One engine and cache, and the figures of the queries it ran after the warm-up."""

    def __init__(self, model: Path, lmc: dict, blend: dict | None) -> None:
        kw = dict(num_blocks=512, max_num_batched_tokens=4096, max_num_seqs=1)
        self.llm = LLM(model, lmc_config=lmc, blend=blend, **kw)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=48)
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--doc-words", type=int, default=120)
    ap.add_argument("--gate-prompts", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--also-ratios", type=lambda t: [float(x) for x in t.split(",")],
                    default=[0.5], help="blended ratios run besides the gate's (default 0.5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lmc" / "bench"
    model = make_tiny_checkpoint(cache / f"blend-h{args.hidden}-l{args.layers}", seed=7,
                                 hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                                 vocab=2048, max_position_embeddings=4096)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    llm = LLM(model, num_blocks=8)
    assert llm.tokenizer is not None
    encode = llm.tokenizer.encode
    gate_rows: list[str] = []
    verdict = run_check(model, default_prompts(args.gate_prompts, encode),
                        [0.0, 0.05, 0.15, 0.3, 0.5, 1.0], gen_tokens=8,
                        say=lambda line: gate_rows.append(line) if not line.startswith("full")
                        else None)
    verdict.write(model / "lmc_blend_verdict.json")
    ratio = verdict.ratio if verdict.passed else 0.15
    wl = make_rag_workload(num_docs=args.docs, doc_words=args.doc_words, k=args.k,
                           num_queries=args.queries, seed=11)
    queries = [wl.prompt_tokens(q, encode) for q in wl.queries]
    lmc = {"chunk_size": 256, "local_cpu_size": "512MiB"}
    ratios = sorted({ratio, *args.also_ratios})
    prefix = Mode(model, lmc, None)
    modes = [prefix] + [Mode(model, lmc, {"ratio": r, "override": not (verdict.passed
                                                                        and r >= ratio)})
                        for r in ratios]
    for i, (ids, spans) in enumerate(queries):  # interleaved: every mode sees the same load
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            mode.run(ids, spans, i >= args.docs)
    for mode in modes:
        mode.llm.close()
    elapsed = time.perf_counter() - t0
    mean_len = statistics.fmean(len(ids) for ids, _ in queries)
    lines = [
        "",
        f"### Blending vs prefix caching, RAG workload (`python benchmarks/bench_blend.py "
        f"--hidden {args.hidden} --layers {args.layers}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Reference engine on CPU, random-weight model (hidden {args.hidden}, {args.layers} "
        f"layers, fp32, {args.threads} torch thread(s)), {args.queries} queries: {args.k} of "
        f"{args.docs} documents ({args.doc_words} words each) in random order + a new question, "
        f"{mean_len:.0f} prompt tokens on average; figures over the {len(prefix.ttfts)} queries "
        f"after the first {args.docs}, the engines taking turns query by query; lmc L1 512 MiB, "
        f"chunk 256; load average {load0:.1f} at start; {elapsed:.0f} s in all. CPU is this "
        f"process's CPU time per query (blind to the machine's other load); the ratios are "
        f"medians of per-query ratios to prefix-only.",
        "",
        "| mode | TTFT p50 | TTFT p95 | prompt tokens reused | CPU per query p50 | TTFT vs "
        "prefix-only | CPU vs prefix-only |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in modes:
        if mode is prefix:
            name = "prefix caching only"
        else:
            r = mode.blend["ratio"]
            if verdict.passed and r >= ratio:
                gate = "the gate's ratio" if r == ratio else "above the gate's ratio"
            else:
                gate = "override: the gate passed no ratio up to it"
            name = f"blended, ratio {r:.2f} ({gate})"
        t = statistics.median(b / a for a, b in zip(prefix.ttfts, mode.ttfts, strict=True))
        c = statistics.median(b / a for a, b in zip(prefix.cpu, mode.cpu, strict=True))
        lines.append(f"| {name} | {mode.p(0.5) * 1e3:.1f} ms | {mode.p(0.95) * 1e3:.1f} ms | "
                     f"{mode.reused / mode.total:.1%} | {percentile(mode.cpu, 0.5) * 1e3:.0f} ms "
                     f"| **{t:.2f}** | **{c:.2f}** |")
    for mode in modes[1:]:
        s = mode.blender.stats.as_dict() if mode.blender else {}
        lines.append("")
        lines.append(
            f"Blender at {mode.blend['ratio']:.2f}, all {args.queries} queries: "
            f"{s.get('segments_hit', 0)} segments loaded ({s.get('tokens_reused', 0)} tokens), "
            f"{s.get('segments_computed', 0)} computed alone and stored "
            f"({s.get('tokens_computed_alone', 0)} tokens), {s.get('tokens_recomputed', 0)} "
            f"cached tokens recomputed.")
    lines += [
        "",
        f"Quality gate on the same model ({verdict.prompts} generated RAG prompts, "
        f"{verdict.generated_tokens} greedy tokens; pass: mean KL <= "
        f"{verdict.thresholds['kl_mean_max']}, agreement >= "
        f"{verdict.thresholds['min_agreement']}):",
        "",
        "```",
        HEADER,
        *[format_row(r) for r in verdict.results],
        "```",
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
