"""A random store / lookup / retrieve workload over one engine, every hit checked bit for bit.

Run in threads (``run_workload``) or as a process (``python -m tests.core.model_proc
'<engine config JSON>' SEED OPS``, printing one JSON line): the KV is a function of the token
prefix (``model_kv.token_rows``), so any thread or process verifies any hit, whoever stored it.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from lmc import CacheEngine
from tests.core.model_kv import (
    CHUNK,
    GEOMETRIES,
    NUM_BASES,
    PagedCache,
    fresh_prompt,
    make_engine,
    mask_for,
    prompt,
    slots_for,
)


def run_workload(eng: CacheEngine, cache: PagedCache, seed: int, ops: int,
                 owner: Any = None) -> dict[str, int]:
    """``ops`` random steps; raises AssertionError naming the step on any wrong byte."""
    r = random.Random(seed)
    out = {"stores": 0, "stored_tokens": 0, "retrieves": 0, "retrieved_tokens": 0,
           "lookups": 0, "hit_tokens": 0}
    for step in range(ops):
        if r.random() < 0.1:
            tokens = fresh_prompt(seed * 100003 + step, r.randint(CHUNK, 4 * CHUNK))
        else:
            tokens = prompt(r.randrange(NUM_BASES), r.randint(1, 6 * CHUNK),
                            None if r.random() < 0.8 else r.randrange(6 * CHUNK))
        n = len(tokens)
        slots = slots_for(n, r.randrange(1 << 30), r.random() < 0.5, r.choice([0, 0, 1]))
        x = r.random()
        what = f"seed {seed} step {step}"
        if x < 0.4:
            cache.write(tokens, slots)
            out["stored_tokens"] += eng.store(tokens, cache.caches, slots)
            out["stores"] += 1
            continue
        rid = (owner, step)
        if x < 0.6:
            hit = eng.lookup(tokens, pin=True, request_id=rid)
            out["lookups"] += 1
            out["hit_tokens"] += hit
            assert hit == n or hit % CHUNK == 0, f"{what}: lookup {hit} of {n}"
            if r.random() < 0.3:
                eng.unpin(tokens, request_id=rid)
                continue
        masked = min(r.choice([0, 0, 1]), (n - 1) // CHUNK)
        snap = cache.snapshot()
        got = eng.retrieve(tokens, cache.caches, slots, mask_for(n, masked), request_id=rid)
        start = masked * CHUNK
        assert start + got == n or (start + got) % CHUNK == 0, f"{what}: retrieve {got}"
        cache.check_retrieved(snap, tokens, slots, start, start + got, what)
        out["retrieves"] += 1
        out["retrieved_tokens"] += got
    return out


def main(argv: list[str]) -> dict[str, Any]:
    cfg, seed, ops = json.loads(argv[0]), int(argv[1]), int(argv[2])
    cache = PagedCache(GEOMETRIES[cfg.pop("geom")], seed)
    pool_bytes, tenant = cfg.pop("pool_bytes"), cfg.pop("tenant")
    eng = make_engine(cache, pool_bytes, cfg, tenant)
    try:
        res: dict[str, Any] = run_workload(eng, cache, seed, ops, owner=seed)
        res["flushed"] = eng.flush(30)
        stats = eng.stats()
        res["pinned_left"] = stats["pinned_chunks"]
        res["disk_hits"] = stats.get("disk.get_hits", 0)
        res["remote_hits"] = sum(v for k, v in stats.items()
                                 if k.endswith(".get_hits") and not k.startswith("disk."))
    finally:
        eng.close()
    return res


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
