"""An engine process for the cross-process tests: ``python -m tests.server.engine_proc
(store|load) URL SEED TOKENS`` builds a CacheEngine whose remote tier is ``URL``, stores or
loads a prompt's KV, and prints one JSON line with what happened.

The KV is regenerated from ``SEED`` on both sides, so the loader checks bit-exactness against
what the storer had without any side channel."""

from __future__ import annotations

import json
import sys

import torch

from lmc import CacheConfig, CacheEngine
from tests.kvutil import make_caches, spec_for, token_kv

LAYOUT = "vllm_flash"


def _slots(spec, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bs = spec.block_size
    blocks = torch.randperm(spec.num_blocks, generator=g)[: -(-n // bs)]
    return (blocks[:, None] * bs + torch.arange(bs)).flatten()[:n]


def main(argv: list[str]) -> dict:
    mode, url, seed, n = argv[0], argv[1], int(argv[2]), int(argv[3])
    cfg = CacheConfig(chunk_size=16, local_cpu_size="16MiB", pin_memory="false",
                      remote_url=url, remote_timeout=5.0)
    src = make_caches(LAYOUT, dtype=torch.bfloat16, blocks=32, block_size=4, layers=4, seed=seed)
    spec = spec_for(LAYOUT, src)
    tokens = torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    s_src = _slots(spec, n, seed + 1)
    with CacheEngine(cfg, spec, model_id="tiny-test") as eng:
        if mode == "store":
            stored = eng.store(tokens, src, s_src)
            flushed = eng.flush(30)
            return {"stored": stored, "flushed": flushed,
                    "remote_stored": eng.stats().get("server.stored", 0)}
        dst = make_caches(LAYOUT, dtype=torch.bfloat16, blocks=32, block_size=4, layers=4,
                          seed=seed + 99, zeros=True)
        s_dst = _slots(spec, n, seed + 2)
        hit = eng.lookup(tokens)
        got = eng.retrieve(tokens, dst, s_dst)
        want = token_kv(spec, src, s_src)
        have = token_kv(spec, dst, s_dst)
        exact = bool(torch.equal(want.view(torch.int16), have.view(torch.int16)))
        return {"lookup": hit, "retrieved": got, "bit_exact": exact,
                "remote_hits": eng.stats().get("server.hits", 0)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
