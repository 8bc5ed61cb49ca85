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
engine matched that exactly on a quiet machine; the hit rate must agree within
``TOLERANCE`` of the prompt tokens (issue 16's 2 points), each tier's share within twice that
(under load one run moved 2 chunks from L1 to disk). With 6 chunks (a queue of one)
the outcome is timing: the same trace gave 256, 1024 and 3328 disk-hit tokens of 19765 in
three runs against the planner's 0, so that size is not asserted (docs/planner.md).
"""

from __future__ import annotations

import pytest

from lmc.config import CacheConfig
from lmc.connectors.reference import LMCReferenceConnector
from lmc.planner.keys import key_trace
from lmc.planner.sim import GridPoint, simulate
from lmc.planner.validate import mixed_trace
from lmc.reference import LLM
from lmc.reference.tiny import cached_checkpoint
from lmc.storage.backends.disk.backend import DiskBackend
from lmc.workloads.trace import TraceRequest

BPT = 2 * 2 * 1 * 32 * 4  # layers x K/V x kv heads x head size x fp32: 512 B per token
TOLERANCE = 0.02
SEED = 7


def _model():
    return cached_checkpoint("plan-validate-h64-l2-kv1", hidden=64, layers=2, heads=2,
                             kv_heads=1, max_position_embeddings=2048)


def _trace() -> list[TraceRequest]:
    return mixed_trace(36, SEED)


def _replay(reqs: list[TraceRequest], l1: int, disk: int, policy: str, tmp,
            step_tokens: int = 0) -> list[dict]:
    # load_all: the planner predicts where chunks are; the load policy's choice depends on
    # the machine's speeds of the moment (tested in tests/connectors/reference/test_load_policy_e2e.py)
    cfg = CacheConfig(local_cpu_size=l1, write_policy=policy, local_cpu_prefault="off",
                      load_policy="load_all")
    model = _model()
    conn = LMCReferenceConnector(
        cfg, model_dir=model,
        tiers=[lambda c, pool: DiskBackend(config=c, pool=pool, path=tmp, capacity=disk,
                                           io_threads=1)])
    llm = LLM(model, block_size=16, max_num_batched_tokens=step_tokens or 2048, max_num_seqs=1,
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


@pytest.mark.parametrize(("policy", "l1_chunks", "step_tokens"),
                         [("write_through", 6, 0), ("write_through", 14, 0),
                          ("write_on_evict", 14, 0), ("write_through", 4, 256)])
def test_planner_predicts_the_engines_hits(tmp_path, policy, l1_chunks, step_tokens):
    """With ``step_tokens`` the engine chunks prefills at that budget and saves a step at a
    time; at an L1 of 4 chunks the disk tier's write queue (half the pool: 2 chunks) fills
    and drops, and which chunk it drops depends on what each step offers."""
    reqs = _trace()
    chunk = 256 * BPT
    l1, disk = l1_chunks * chunk, 12 * (chunk + 4096 + 4096)
    real = _replay(reqs, l1, disk, policy, tmp_path / "disk", step_tokens)
    point = GridPoint(l1, disk, 0, policy)
    sim = simulate(key_trace(reqs), point, bytes_per_token=BPT, step_tokens=step_tokens)
    pred = [{t: sim.per_request[t][i] for t in ("L1", "disk")} for i in range(len(reqs))]
    total = sum(len(r.prompt_tokens) for r in reqs)
    got = {t: sum(p[t] for p in real) for t in ("L1", "disk")}
    want = {t: sum(p[t] for p in pred) for t in ("L1", "disk")}
    print(f"{policy} L1 {l1_chunks} chunks, budget {step_tokens}: engine {got}, planner "
          f"{want}, of {total} tokens")
    assert got["L1"] + got["disk"] > 0.2 * total  # the trace does exercise the cache
    if step_tokens:
        # the case discriminates: offering each prompt at once would miss by > 2 points
        whole = simulate(key_trace(reqs), point, bytes_per_token=BPT)
        off = abs(sum(whole.hit_tokens.values()) - sum(got.values()))
        print(f"  offering each prompt at once: {whole.hit_tokens} ({off / total:.1%} off)")
        assert off > TOLERANCE * total
    if policy == "write_through":
        assert real == pred
    else:
        # issue 16's bar is the hit rate (L1 + disk) within 2 points. Which tier serves a
        # chunk depends on whether the writer thread freed a victim's memory before the next
        # allocation gave up on it (timing): under load the L1 total once moved by 2 chunks
        # (512 tokens, 2.6 points) while the sum stayed put, so each tier gets twice the room
        assert abs(sum(got.values()) - sum(want.values())) <= TOLERANCE * total, (got, want)
        for t in ("L1", "disk"):
            assert abs(got[t] - want[t]) <= 2 * TOLERANCE * total, (t, got, want)


# ---------------------------------------------------------------------------- TTFT

HIT_TOLERANCE = 0.02  # issue 16: hit rate within 2 percentage points


def _ttft_points(chunk: int) -> list[GridPoint]:
    """Two tier sizes over a disk tier with different hit rates and L1/disk splits."""
    def disk(n: int) -> int:
        return n * (chunk + 4096 + 4096)

    return [GridPoint(4 * chunk, disk(6), 0, "write_through"),
            GridPoint(12 * chunk, disk(16), 0, "write_through")]


def _disk_tier(path: str, capacity: int):
    return lambda c, pool: DiskBackend(config=c, pool=pool, path=path, capacity=capacity,
                                       io_threads=1)


@pytest.mark.parametrize("step_tokens", [0, 256])
def test_planner_predicts_the_engines_hit_rate_on_the_ttft_path(step_tokens):
    """The TTFT validation path end to end (``lmc.planner.validate.validate``, as
    ``benchmarks/bench_plan.py --ttft`` runs it): calibrate a profile for a small
    random-weight model, replay the trace on the reference engine with lmc at two tier sizes,
    and compare the planner's hit rate with the engine's (within 2 points).

    The TTFT *accuracy* (issue 16: within 20% of measured) is a speed figure: it depends on
    the load of the moment (CI, with other tests beside it, once measured 80 ms where the
    profile, calibrated minutes earlier in the same process, predicted 63), so it is measured
    and printed against its bar by ``benchmarks/bench_plan.py --ttft [--step-tokens 256]``,
    not asserted here. What is asserted of the TTFT side holds on any machine: every figure is
    a positive time, the prediction falls as the predicted hits grow, and a cache that hits
    is predicted faster than the profile's full prefill of every prompt.

    With ``step_tokens`` the replay engine chunks prefills at that budget (its scheduler
    hands it to lmc's connector) and the planner predicts for it (``lmc plan
    --step-tokens``): prompts of up to ~1,000 tokens take up to four steps. The simulation
    saves a step at a time too (the writer draining between steps), so at the L1 of 4
    chunks, where the disk tier's write queue fills and drops, the hit rate is checked as
    at the larger point (``test_steps_change_what_the_queue_drops``).
    """
    import torch

    from lmc.planner.validate import validate, warmup_request

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = cached_checkpoint("plan-bench-h256-l4-kv2", hidden=256, layers=4, heads=4,
                                  kv_heads=2, max_position_embeddings=2048)
        reqs = [warmup_request(1024, 2000), *_trace()]
        points = _ttft_points(256 * 4096)  # this model's KV: 4 KiB per token
        prof, res = validate(model, reqs, points, passes=2, lengths=(128, 256, 512, 1024),
                             load_tokens=768, disk_tier=_disk_tier, max_model_len=1100,
                             step_tokens=step_tokens)
    finally:
        torch.set_num_threads(threads)
    no_cache = float(prof.compute_s(0, [len(r.prompt_tokens) for r in reqs[1:]],
                                    step_tokens).mean())
    for point, c in zip(points, res):
        print(f"budget {step_tokens}, L1 {point.l1 >> 20} MiB, disk {point.disk / 2**20:.1f} "
              f"MiB: {c}; ignoring the cache: {no_cache * 1e3:.1f} ms")
    hit_rates = [c.hit_measured for c in res]
    assert min(hit_rates) > 0.2 and hit_rates[0] != hit_rates[1]  # the tiers matter
    for c in res:
        assert abs(c.hit_measured - c.hit_predicted) <= HIT_TOLERANCE, str(c)
        assert c.ttft_measured_s > 0 and c.ttft_predicted_s > 0, str(c)
        assert c.ttft_predicted_s < no_cache, str(c)
    lo, hi = sorted(res, key=lambda c: c.hit_predicted)
    assert hi.ttft_predicted_s < lo.ttft_predicted_s, [str(c) for c in res]
