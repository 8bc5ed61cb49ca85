"""The real model's costs on this machine: ``lmc model get`` (SmolLM2-135M-Instruct from its
GGUF) and the reference engine's prefill and decode on it, on one torch thread.

* **conversion**: a fresh ``get_model`` into a temporary cache folder per dtype (verify,
  parse, dequantize, write), next to the parts it cannot beat measured in the same run:
  hashing the 98 MB source and ``gguf``'s own parse of it (``GGUFReader``);
* **prefill**: the engine alone (no lmc), one request of N tokens of the bundled texts,
  ``max_tokens=1``, after one unmeasured run of the same length; tokens/s next to the model's
  linear-layer arithmetic (2 x 106 M multiply-adds a token) at the bare matmul rate measured
  here for the same shapes (the limit a forward approaches when attention is small);
* **decode**: ms per generated token over a 512-token prompt (32 tokens, EOS ignored).

``python benchmarks/bench_real_model.py [--lengths 512,1024,2048] [--dtypes fp32,bf16]``.
bf16 matmuls on a CPU without AVX-512 BF16 run far below fp32: bf16 prefill is measured at the
shortest length only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmc.models import DEFAULT_MODEL, get_model, known_model  # noqa: E402
from lmc.models.source import locate, sha256_file  # noqa: E402
from lmc.models.texts import bundled_text  # noqa: E402
from lmc.reference import LLM  # noqa: E402

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def conversion(dtypes: list[str]) -> None:
    source = locate(known_model(DEFAULT_MODEL))
    t0 = time.perf_counter()
    sha256_file(source)
    hashing = time.perf_counter() - t0
    import gguf

    t0 = time.perf_counter()
    gguf.GGUFReader(str(source))
    parse = time.perf_counter() - t0
    print(f"source {source.stat().st_size / 1e6:.1f} MB: SHA-256 {hashing:.2f} s, "
          f"GGUFReader parse {parse:.1f} s")
    for dtype in dtypes:
        with tempfile.TemporaryDirectory() as root:
            ckpt = get_model(DEFAULT_MODEL, dtype, root=root)
            size = sum(p.stat().st_size for p in ckpt.path.iterdir())
        print(f"lmc model get --dtype {dtype}: {ckpt.seconds:.1f} s ({size / 1e6:.0f} MB "
              f"written; {ckpt.seconds / max(parse, 1e-9):.1f}x the parse alone)")


def matmul_rate(tokens: int, dtype: torch.dtype) -> float:
    """Multiply-adds per second of the model's linear shapes (q/k/v/o, gate/up/down) on
    ``tokens`` rows: the limit of a forward whose attention is small."""
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
              (576, 1536)]
    ws = [torch.randn(o, i, dtype=dtype) for o, i in shapes]
    xs = {i: torch.randn(tokens, i, dtype=dtype) for _, i in shapes}
    for w in ws:
        xs[w.shape[1]] @ w.T
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        for w in ws:
            xs[w.shape[1]] @ w.T
        reps += 1
    macs = reps * tokens * sum(o * i for o, i in shapes)
    return macs / (time.perf_counter() - t0)


def prompt_ids(llm: LLM, n: int) -> list[int]:
    assert llm.tokenizer is not None
    ids: list[int] = []
    text = bundled_text("harbour") + "\n\n" + bundled_text("workshop")
    while len(ids) < n:
        ids += llm.tokenizer.encode(text)
    return ids[:n]


def engine(dtype: str, lengths: list[int]) -> None:
    path = get_model(DEFAULT_MODEL, "fp32").path
    llm = LLM(path, dtype=TORCH_DTYPES[dtype], max_model_len=max(lengths) + 64,
              max_num_batched_tokens=max(lengths))
    per_token = 30 * 3_538_944  # linear multiply-adds a token (the LM head: last token only)
    for n in lengths:
        ids = prompt_ids(llm, n)
        llm.generate([ids], max_tokens=1)  # unmeasured: first-use costs of this length
        t0 = time.perf_counter()
        llm.generate([ids], max_tokens=1)
        seconds = time.perf_counter() - t0
        limit = matmul_rate(n, TORCH_DTYPES[dtype]) / per_token
        print(f"prefill {dtype} {n:>5} tokens: {seconds:6.2f} s, {n / seconds:7.0f} tok/s "
              f"(linear-layer limit {limit:7.0f} tok/s: {n / seconds / limit:.2f})")
    ids = prompt_ids(llm, 512)
    t0 = time.perf_counter()
    out = llm.generate([ids], max_tokens=33, ignore_eos=True)[0]
    total = time.perf_counter() - t0
    assert out.ttft_s is not None
    print(f"decode {dtype} after 512 tokens: {(total - out.ttft_s) / 32 * 1e3:.0f} ms a token")
    llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    dtypes = args.dtypes.split(",")
    print(f"torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f}")
    conversion(dtypes)
    for dtype in dtypes:
        engine(dtype, lengths if dtype == "fp32" else lengths[:1])
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
