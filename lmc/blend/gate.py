"""Check, for one model, whether reusing cached segments (blending) keeps its outputs.

``lmc blend-check --model DIR`` runs the model on RAG-shaped prompts (``--prompts FILE``: the
user's own, one ``{"pieces": [segment, ..., question]}`` or ``{"prompt": "a # # b # # q"}``
per line; by default generated ones) with full prefill and blended at each recompute ratio,
and prints per ratio: each layer's KV deviation from full prefill, the KL divergence of the
next-token distribution, and how many of the first N greedy tokens agree. A ratio passes
when the mean KL is at most ``--kl-max`` and the agreement at least ``--min-agreement``; the
verdict passes at the smallest passing ratio below 1 (at 1 blending saves nothing) and is
written next to the model's config.json (``lmc_blend_verdict.json``, or ``--verdict``), signed
when an integrity secret is configured (``--config``, ``LMC_INTEGRITY_SECRET``). The blend
connector blends a model only with a passing verdict for its weights and KV dtype (and, with
a secret, only a verdict that secret signed).
Exit status: 0 passed, 1 failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmc.blend.quality import Capture, compare, run_prompt
from lmc.blend.rag_workload import make_rag_workload, read_jsonl
from lmc.blend.verdict import RatioResult, Verdict, default_verdict_path
from lmc.config import CacheConfig
from lmc.connectors.reference.blend import BlendConnector, BlendSettings, dtype_name
from lmc.reference.segments import encode_pieces
from lmc.storage.integrity import Integrity
from lmc.units import size

DEFAULT_RATIOS = (0.0, 0.05, 0.15, 0.3, 0.5, 1.0)
DEFAULT_KL_MAX = 0.05
DEFAULT_MIN_AGREEMENT = 0.9
MAX_RATIOS = 16
CHUNK_SIZE = 256

Prompt = tuple[list[int], list[tuple[int, int]]]


def default_prompts(num: int, encode: Callable[[str, bool], list[int]]) -> list[Prompt]:
    """RAG-shaped prompts: a system prompt, 3 of 8 documents in random order, a question."""
    wl = make_rag_workload(num_docs=8, doc_words=80, k=3, num_queries=num, seed=0)
    return [wl.prompt_tokens(q, encode) for q in wl.queries]


def run_check(model_dir: str | Path, prompts: Sequence[Prompt], ratios: Sequence[float], *,
              dtype: str = "float32", device: str = "cpu", gen_tokens: int = 16,
              kl_max: float = DEFAULT_KL_MAX, min_agreement: float = DEFAULT_MIN_AGREEMENT,
              say: Callable[[str], None] = lambda _line: None) -> Verdict:
    """Measure every ratio on every prompt and judge (see the module docstring)."""
    from lmc.reference.engine import LLM

    model_dir = Path(model_dir)
    longest = max(len(ids) for ids, _ in prompts) + gen_tokens
    engine_kw: dict[str, Any] = dict(dtype=dtype, device=device, max_num_seqs=1,
                                     max_num_batched_tokens=longest, max_model_len=longest,
                                     kv_cache_memory=1 << 40)
    full_llm = LLM(model_dir, **engine_kw)
    if longest > full_llm.max_model_len:
        raise ValueError(f"a prompt of {longest - gen_tokens} tokens plus {gen_tokens} generated "
                         f"does not fit the model's {full_llm.max_model_len} positions")
    seg_tokens = sum(e - s for _, spans in prompts for s, e in spans)
    per_token = full_llm.kv_caches[0][0, 0, 0].numel() * 2 * len(full_llm.kv_caches) \
        * full_llm.kv_caches[0].element_size()
    pool = max(64 << 20, 2 * seg_tokens * per_token + CHUNK_SIZE * per_token * 4)
    fulls = [run_prompt(full_llm, ids, None, gen_tokens) for ids, _ in prompts]
    say(f"full prefill of {len(prompts)} prompts done; lmc pool {size(pool)}")
    quiet = logging.getLogger("lmc.connectors.reference.blend")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the check itself runs forced on: not news to the user
    try:
        conn = BlendConnector({"chunk_size": CHUNK_SIZE, "local_cpu_size": pool},
                              model_dir=model_dir, blend=BlendSettings(override=True))
        blend_llm = LLM(model_dir, kv_connector=conn, **engine_kw)
    finally:
        quiet.setLevel(level)
    results = []
    try:
        assert conn.blender is not None
        for ratio in ratios:
            conn.blender.ratio = ratio
            blended: list[Capture] = [run_prompt(blend_llm, ids, spans, gen_tokens)
                                      for ids, spans in prompts]
            cmps = [compare(f, b) for f, b in zip(fulls, blended, strict=True)]
            layers = len(cmps[0].kv_deviation)
            dev = [sum(c.kv_deviation[i] for c in cmps) / len(cmps) for i in range(layers)]
            kl_mean = sum(c.kl for c in cmps) / len(cmps)
            agree = sum(c.agreement for c in cmps) / len(cmps)
            ok = kl_mean <= kl_max and agree >= min_agreement
            results.append(RatioResult(ratio, dev, kl_mean, max(c.kl for c in cmps), agree, ok))
            say(format_row(results[-1]))
    finally:
        blend_llm.close()
    passing = [r.ratio for r in results if r.passed and r.ratio < 1.0]
    return Verdict(model_id=conn.model_id, dtype=dtype_name(full_llm.dtype),
                   passed=bool(passing), ratio=min(passing) if passing else None,
                   thresholds={"kl_mean_max": kl_max, "min_agreement": min_agreement},
                   results=results, prompts=len(prompts), generated_tokens=gen_tokens)


HEADER = "ratio   KL mean   KL max   agree   KV dev (per layer, first..last)   pass"


def format_row(r: RatioResult) -> str:
    dev = " ".join(f"{d:.3f}" for d in _sample(r.kv_deviation))
    return (f"{r.ratio:5.2f}  {r.kl_mean:8.4f} {r.kl_max:8.4f}  {r.agreement:5.2f}   "
            f"{dev:32s}  {'yes' if r.passed else 'no'}")


def _sample(values: list[float], most: int = 6) -> list[float]:
    if len(values) <= most:
        return values
    step = (len(values) - 1) / (most - 1)
    return [values[round(i * step)] for i in range(most)]


# ----------------------------------------------------------------------- CLI

def _ratios(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        try:
            x = float(part)
        except ValueError:
            x = math.nan
        if not 0.0 <= x <= 1.0:
            raise argparse.ArgumentTypeError(f"ratios are numbers in [0, 1], got {part!r}")
        out.append(x)
    if not 1 <= len(out) <= MAX_RATIOS:
        raise argparse.ArgumentTypeError(f"give 1 to {MAX_RATIOS} ratios, got {len(out)}")
    return sorted(set(out))


def register_cli(sub: Any) -> None:
    from lmc.cli import add_command, float_in, int_in

    p = add_command(sub, "blend-check", "measure blending's quality for a model; write its "
                    "verdict", __doc__)
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--prompts", metavar="FILE", help="JSONL prompts (default: generated)")
    p.add_argument("--num-prompts", type=int_in(1, 1000), default=8,
                   help="generated prompts (default %(default)s)")
    p.add_argument("--ratios", type=_ratios, default=list(DEFAULT_RATIOS),
                   help="comma-separated recompute ratios (default 0,0.05,0.15,0.3,0.5,1)")
    p.add_argument("--tokens", type=int_in(1, 1024), default=16,
                   help="greedy tokens compared per prompt (default %(default)s)")
    p.add_argument("--kl-max", type=float_in(0, 100), default=DEFAULT_KL_MAX,
                   help="largest passing mean KL, nats (default %(default)s)")
    p.add_argument("--min-agreement", type=float_in(0, 1), default=DEFAULT_MIN_AGREEMENT,
                   help="smallest passing greedy agreement (default %(default)s)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--verdict", metavar="PATH",
                   help="where to write the verdict (default: next to DIR/config.json)")
    p.add_argument("--config", metavar="FILE",
                   help="lmc config whose integrity_secret (or _file) signs the verdict, as the "
                   "engines that read it must have (LMC_INTEGRITY_SECRET works too)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        integrity = Integrity.from_config(CacheConfig.load(args.config))  # before minutes of work
        model_dir = Path(args.model)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"{model_dir} is not a checkpoint directory: no config.json")
        from lmc.reference.tokenizer import Tokenizer

        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json: blend-check needs one to "
                             "tokenize its prompts")
        tok = Tokenizer(tok_path)
        if args.prompts:
            prompts = [encode_pieces(p, tok.encode) for p in read_jsonl(args.prompts)]
            if not prompts:
                raise ValueError(f"{args.prompts}: no prompts")
        else:
            prompts = default_prompts(args.num_prompts, tok.encode)
        path = Path(args.verdict) if args.verdict else default_verdict_path(model_dir)
        print(f"lmc blend-check: {model_dir} ({len(prompts)} prompts, {args.tokens} greedy "
              f"tokens each)")
        print(HEADER)
        verdict = run_check(model_dir, prompts, args.ratios, dtype=args.dtype,
                            device=args.device, gen_tokens=args.tokens, kl_max=args.kl_max,
                            min_agreement=args.min_agreement,
                            say=lambda line: print(line) if not line.startswith("full") else None)
        verdict.write(path, integrity)
    except (ValueError, OSError, ImportError) as e:
        print(f"lmc blend-check: {e}", file=sys.stderr)
        return 2
    signed = " (signed with the integrity secret)" if integrity is not None else ""
    if verdict.passed:
        print(f"verdict: PASS at recompute ratio {verdict.ratio:.2f}; written to {path}{signed}")
        return 0
    print(f"verdict: FAIL (no ratio below 1 within KL <= {args.kl_max} and agreement >= "
          f"{args.min_agreement}); written to {path}{signed}: blending stays off for this model")
    return 1
