"""The planner against reality: a trace replayed on the reference engine with lmc (real L1
pool, real disk tier, tiny KV) and the planner's prediction for the same configuration.

Requests run one at a time and each ends with the write-behind queues flushed, which is the
planner's model of the writer threads (they catch up between requests). With the disk
tier's I/O on one thread (its four threads insert a batch in any order, so the LRU order of
chunks written together is not defined), the planner must predict every request's hit
tokens per tier exactly under write-through.

Under write-on-evict an L1 victim keeps its memory while it waits in the write queue, so an
allocation under pressure goes on evicting until the queue's bound refuses a victim (lost,
not written) unless the writer thread frees memory first; the planner models a writer that
does not catch up within one allocation. With an L1 of 14 chunks (a queue of 3.5) the
engine matched that exactly in every run here; the per-tier totals must agree within
``TOLERANCE`` of the prompt tokens (issue 16's 2 points). With 6 chunks (a queue of one)
the outcome is timing: the same trace gave 256, 1024 and 3328 disk-hit tokens of 19765 in
three runs against the planner's 0, so that size is not asserted (docs/planner.md).
"""

from __future__ import annotations

import random

import pytest
from lmc.connectors.reference import LMCReferenceConnector
from lmc.storage_backends.disk import DiskBackend

from lmc.config import CacheConfig
from lmc.planner.keys import key_trace
from lmc.planner.sim import GridPoint, simulate
from lmc.reference import LLM
from lmc.reference.tiny import cached_checkpoint
from lmc.workloads.trace import TraceRequest

BPT = 2 * 2 * 1 * 32 * 4  # layers x K/V x kv heads x head size x fp32: 512 B per token
TOLERANCE = 0.02
SEED = 7


def _model():
    return cached_checkpoint("plan-validate-h64-l2-kv1", hidden=64, layers=2, heads=2,
                             kv_heads=1, max_position_embeddings=2048)


def _trace() -> list[TraceRequest]:
    """Shared system prompts, growing conversations and one-off prompts, interleaved."""
    rng = random.Random(SEED)

    def toks(n: int) -> list[int]:
        return [rng.randrange(2, 2000) for _ in range(n)]

    systems = [toks(300), toks(520)]
    convs: dict[str, list[int]] = {}
    out = []
    for i in range(36):
        kind = rng.random()
        if kind < 0.5:
            sid = f"c{rng.randrange(4)}"
            hist = convs.get(sid) or systems[int(sid[1:]) % 2][:]
            prompt = hist + toks(rng.randrange(40, 200))
            if len(prompt) > 1000:
                prompt = systems[0] + toks(100)
            convs[sid] = prompt + toks(30)
            out.append(TraceRequest(float(i), f"r{i}", sid, None, prompt, None, 1))
        elif kind < 0.85:
            g = rng.randrange(2)
            out.append(TraceRequest(float(i), f"r{i}", None, f"g{g}",
                                    systems[g] + toks(rng.randrange(10, 300)), None, 1))
        else:
            out.append(TraceRequest(float(i), f"r{i}", None, None, toks(rng.randrange(100, 700)),
                                    None, 1))
    return out


def _replay(reqs: list[TraceRequest], l1: int, disk: int, policy: str, tmp) -> list[dict]:
    cfg = CacheConfig(local_cpu_size=l1, write_policy=policy, local_cpu_prefault="off")
    model = _model()
    conn = LMCReferenceConnector(
        cfg, model_dir=model,
        tiers=[lambda c, pool: DiskBackend(config=c, pool=pool, path=tmp, capacity=disk,
                                           io_threads=1)])
    llm = LLM(model, block_size=16, max_num_batched_tokens=2048, max_num_seqs=1,
              max_model_len=1100, kv_connector=conn)
    per = []
    try:
        for r in reqs:
            before = conn.stats()
            llm.generate([r.prompt_tokens], max_tokens=1)
            assert conn.engine.storage.flush(timeout=60)
            after = conn.stats()
            per.append({t: after.get(f"worker.tokens_from_{name}", 0)
                        - before.get(f"worker.tokens_from_{name}", 0)
                        for t, name in (("L1", "cpu"), ("disk", "disk"))})
    finally:
        llm.close()
    return per


@pytest.mark.parametrize(("policy", "l1_chunks"), [("write_through", 6),
                                                   ("write_through", 14),
                                                   ("write_on_evict", 14)])
def test_planner_predicts_the_engines_hits(tmp_path, policy, l1_chunks):
    reqs = _trace()
    chunk = 256 * BPT
    l1, disk = l1_chunks * chunk, 12 * (chunk + 4096 + 4096)
    real = _replay(reqs, l1, disk, policy, tmp_path / "disk")
    sim = simulate(key_trace(reqs), GridPoint(l1, disk, 0, policy), bytes_per_token=BPT)
    pred = [{t: sim.per_request[t][i] for t in ("L1", "disk")} for i in range(len(reqs))]
    total = sum(len(r.prompt_tokens) for r in reqs)
    got = {t: sum(p[t] for p in real) for t in ("L1", "disk")}
    want = {t: sum(p[t] for p in pred) for t in ("L1", "disk")}
    print(f"{policy} L1 {l1_chunks} chunks: engine {got}, planner {want}, of {total} tokens")
    assert got["L1"] + got["disk"] > 0.2 * total  # the trace does exercise the cache
    if policy == "write_through":
        assert real == pred
    else:
        for t in ("L1", "disk"):
            assert abs(got[t] - want[t]) <= TOLERANCE * total, (t, got, want)
