"""``python -m lmc.reference [MODEL_DIR] [-p PROMPT ...]``: generate with the reference
engine, by default on the tiny offline checkpoint (made on first use)."""

from __future__ import annotations

import argparse

from lmc.reference.engine import LLM
from lmc.reference.tiny import default_model_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lmc.reference", description=__doc__)
    parser.add_argument("model_dir", nargs="?", help="local HF checkpoint (default: tiny)")
    parser.add_argument("-p", "--prompt", action="append", help="prompt text (repeatable)")
    parser.add_argument("-n", "--max-tokens", type=int, default=32)
    parser.add_argument("-t", "--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    llm = LLM(args.model_dir or default_model_dir(), dtype=args.dtype, device=args.device)
    prompts = args.prompt or ["The cache keeps every prefix", "A river runs under the bridge"]
    outputs = llm.generate(
        prompts, max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, seed=args.seed,
    )
    for out in outputs:
        print(f"{out.prompt!r} -> {out.text!r}")
        ttft = "-" if out.ttft_s is None else f"{out.ttft_s * 1e3:.1f} ms"
        print(f"    {len(out.token_ids)} tokens, finish={out.finish_reason}, ttft={ttft}")


if __name__ == "__main__":
    main()
