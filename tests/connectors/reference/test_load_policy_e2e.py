"""Load or recompute on the reference engine with real tiers: a disk tier behind a real
``rate_limit`` link (2 MiB/s, far slower than the tiny model computes), its speed measured
from its own reads, and the split the policy then chooses -- with tokens and logits
identical to no cache every time.

Nothing here depends on how fast this machine is at the moment: a decision made from
measured speeds is checked against the rule evaluated on the very speeds the policy read
(:class:`Decisions`), never against the split a quiet machine would choose (a loaded 2-core
machine computes slowly enough that loading through the link wins, and that is the right
answer there). Where a test needs a split to happen, the link is observed once as stalled
(:func:`stall`), as a read that timed out reports it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lmc.connectors.core.load_policy import Costs, LoadPolicy, Split, choose_split
from lmc.connectors.reference import LMCReferenceConnector
from lmc.reference import LLM
from lmc.storage.backends.disk.backend import DiskBackend
from lmc.storage.wrappers import WrapperTier
from tests.connectors.reference.helpers import BLOCK, assert_same, plain_llm, prompt, run
from tests.deadlines import HANG_S

CS = 32
P = prompt(23, 150)  # chunks 0-3 full, chunk 4 partial (22 tokens)
LINK = 2 << 20  # bytes per second of the slow tier's link


def slow_disk_llm(tiny_dir: Path, path: Path, policy: str = "auto"
                  ) -> tuple[LLM, LMCReferenceConnector]:
    # the lookup always hears the disk (a loaded host may deschedule its answer past the
    # default 20 ms, a miss): the split is the subject here, not the lookup's deadline
    # (tests/connectors/reference/test_slow_tier_lookup_e2e.py)
    cfg = {"chunk_size": CS, "local_cpu_size": "32MiB", "load_policy": policy,
           "lookup_min_wait": HANG_S,
           "tiers": ["memory", {"wrap": "rate_limit", "bytes_per_second": LINK,
                                "tier": {"backend": "disk", "path": str(path)}}]}
    conn = LMCReferenceConnector(cfg, model_dir=tiny_dir)
    return LLM(tiny_dir, kv_connector=conn, num_blocks=128, block_size=BLOCK), conn


def stat(conn: LMCReferenceConnector, key: str) -> float:
    """A counter that must exist (a misspelt key would make a comparison vacuous)."""
    return conn.stats()[key]


def drop_from_l1(conn: LMCReferenceConnector, tokens: list[int], first_chunk: int) -> None:
    """Leave chunks from ``first_chunk`` on in the disk tier only (as L1's eviction would);
    first, pieces a stopped load abandoned have landed (else they would promote their chunks
    into L1 after this)."""
    eng = conn.cache
    assert eng.flush(HANG_S) and eng.wait_reads(HANG_S)
    keys = [k for _, _, k in eng.db.process_tokens(tokens)][first_chunk:]
    eng.storage.l1.delete(keys)
    assert eng.lookup_result(tokens).sources[first_chunk:] == bytes([1] * len(keys))


class Decisions:
    """Records each decision the connector's policy makes with the costs it read for it
    (the policy itself runs unchanged), so a test can evaluate the rule on the same
    figures."""

    def __init__(self, policy: LoadPolicy) -> None:
        self.policy = policy
        self.seen: list[tuple[Costs | None, tuple, int]] = []
        costs, decide = policy._costs, policy.decide
        read: list[Costs | None] = []

        def recording_costs() -> Costs | None:
            read.append(costs())
            return read[-1]

        def recording_decide(request_id, found, start, hit_end, total, align=1) -> int:
            read.clear()
            end = decide(request_id, found, start, hit_end, total, align)
            self.seen.append((read[-1] if read else None,
                              (found, start, hit_end, total, align), end))
            return end

        policy._costs = recording_costs  # type: ignore[method-assign]
        policy.decide = recording_decide  # type: ignore[method-assign]

    def rule(self, step_tokens: int | None = None, i: int = -1) -> Split:
        """The rule on decision ``i``'s own costs (``step_tokens``: the policy's budget)."""
        costs, (found, start, hit_end, total, align), _ = self.seen[i]
        assert costs is not None, "the decision was taken before the speeds were known"
        return choose_split(costs, found.sources, found.chunk_size, start, hit_end, total,
                            align=align, margin=self.policy.margin, slack_s=self.policy.slack_s,
                            step_tokens=(self.policy.step_tokens if step_tokens is None
                                         else step_tokens))

    def check_last(self) -> Split:
        """The last decision was the rule's on the speeds it read; that split."""
        split = self.rule()
        assert self.seen[-1][2] == split.end, (self.seen[-1][2], split)
        return split


def stall(conn: LMCReferenceConnector, seconds: float = 30.0) -> None:
    """The slow tier's link observed stalled once (a read that timed out after ``seconds``):
    every decision after it recomputes the tier's chunks, whatever this machine computes at
    (its tiny model takes milliseconds, a loaded machine's forward far under a second)."""
    conn.cache.speeds.tiers[1].observe_failure(seconds)


@pytest.fixture(scope="module")
def want(tiny_dir: Path) -> list:
    return run(plain_llm(tiny_dir), [P])


def test_slow_tier_measured_then_recomputed_by_choice(tiny_dir: Path, tmp_path: Path,
                                                      want: list) -> None:
    llm, conn = slow_disk_llm(tiny_dir, tmp_path / "disk")
    run(llm, [P[:64]])  # chunks 0-1 in L1 and on disk; the forward timed
    assert_same(run(llm, [P]), want)  # loads chunks 0-1, stores 2-4
    assert stat(conn, "worker.steps_timed") > 0
    drop_from_l1(conn, P, 2)
    # the disk tier has never been read: its prior says fast, so the whole hit is to be
    # loaded; through the 2 MiB/s link the load watches itself against recomputing: on a
    # quiet machine (the tiny model computes in milliseconds) it stops, on one loaded
    # enough recomputing is the slower and it reads on -- either way its pieces measured the
    # link, and what it answered is whole chunks (tests/storage/test_load_watch.py checks
    # the stop against known rates)
    got = run(llm, [P])
    if stat(conn, "worker.loads_stopped") == 1:
        assert 2 * CS <= got[0].num_cached_tokens < len(P) - 1
        assert got[0].num_cached_tokens % CS == 0
    else:
        assert stat(conn, "worker.loads_stopped") == 0
        assert got[0].num_cached_tokens == len(P) - 1
    assert_same(got, want)
    # a piece abandoned in flight tells its speed when it lands, after the load returned
    assert conn.cache.wait_reads(HANG_S)
    rate = conn.cache.speeds.snapshot().tiers[1]
    assert rate.observed >= 1 and not rate.overlaps
    assert rate.bytes_per_s < LINK * 1.5  # the link never went faster than it allows

    drop_from_l1(conn, P, 2)
    written = (stat(conn, "cache.disk.write_bytes"), stat(conn, "cache.disk.put_chunks"))
    stored = stat(conn, "worker.saved_tokens")
    before = stat(conn, "policy.recomputed_by_choice")
    decisions = Decisions(conn.policy)
    got = run(llm, [P])
    # the rule on the measured speeds: on a quiet machine the split (chunks 0-1 from L1,
    # 2-4 recomputed: reading 3 chunks takes ~190 ms through the link, the tiny model
    # computes them in a few); on a machine loaded enough, loading them all
    split = decisions.check_last()
    assert split.end >= 2 * CS  # the L1 chunks are never recomputed
    assert got[0].num_cached_tokens == split.end
    assert_same(got, want)
    assert stat(conn, "policy.recomputed_by_choice") - before == len(P) - 1 - split.end
    l1 = conn.cache.tier_names[0]
    assert stat(conn, f"policy.loaded_from_{l1}") >= 2 * CS
    assert conn.cache.flush(30)
    # never double work: the chunks are on disk already, not written again
    assert (stat(conn, "cache.disk.write_bytes"), stat(conn, "cache.disk.put_chunks")) == written
    assert stat(conn, "worker.saved_tokens") == stored
    # what was recomputed by choice was to be prefetched while the request waited; it was
    # admitted at once, so the prefetch was cancelled (whatever it pulled was read, never
    # written); a whole load prefetches nothing
    assert stat(conn, "scheduler.prefetches") == (1 if split.recomputed_by_choice else 0)
    wait_until(lambda: conn.cache.prefetches_pending() == 0, "the prefetch's end")
    assert stat(conn, "cache.disk.write_bytes") == written[0]
    assert stat(conn, "cache.speed.prefill.observed") > 0
    llm.close()


def wait_until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.01)


def test_a_waiting_request_is_decided_again_once_its_prefetch_lands(
        tiny_dir: Path, tmp_path: Path, want: list) -> None:
    """Chunks recomputed by choice are prefetched while the request waits for admission;
    the next time the engine asks, the decision is made again and loads them from L1. Bounded:
    at most ``max_redecisions`` re-decisions; admission ends it."""
    llm, conn = slow_disk_llm(tiny_dir, tmp_path / "disk")
    run(llm, [P[:64]])
    run(llm, [P])
    drop_from_l1(conn, P, 2)
    run(llm, [P])  # the slow tier measured
    stall(conn)
    drop_from_l1(conn, P, 2)
    sched = conn.scheduler
    before = sched.stats.prefetches
    decisions = Decisions(conn.policy)
    n = sched.get_num_new_matched_tokens("waiting", P, 0)
    assert n == decisions.check_last().end == 2 * CS, "chunks 2-4 recomputed by choice"
    assert sched.stats.prefetches == before + 1
    fut = sched._prefetching["waiting"][0]
    assert fut.result(timeout=30) == len(P)  # every chunk in L1 now
    # the request still waits: asked again, it is decided afresh and loads all from L1
    decisions = stat(conn, "policy.decisions")
    n = sched.get_num_new_matched_tokens("waiting", P, 0)
    assert n == len(P) - 1
    assert stat(conn, "policy.decisions") == decisions + 1
    assert stat(conn, "policy.redecisions") == 1
    assert sched.get_num_new_matched_tokens("waiting", P, 0) == len(P) - 1  # decided
    sched.request_finished("waiting")
    assert "waiting" not in sched._prefetching and "waiting" not in sched._redone
    got = run(llm, [P])
    assert got[0].num_cached_tokens == len(P) - 1
    assert_same(got, want)
    llm.close()


def test_load_all_turns_the_policy_off(tiny_dir: Path, tmp_path: Path, want: list) -> None:
    llm, conn = slow_disk_llm(tiny_dir, tmp_path / "disk", policy="load_all")
    run(llm, [P[:64]])
    run(llm, [P])
    for _ in range(2):  # measured slow or not, the whole hit is loaded
        drop_from_l1(conn, P, 2)
        got = run(llm, [P])
        assert got[0].num_cached_tokens == len(P) - 1
        assert_same(got, want)
    assert stat(conn, "policy.recomputed_by_choice") == 0
    assert stat(conn, "policy.enabled") == 0
    llm.close()


class FailingReads(WrapperTier):
    """A real disk tier whose reads start failing when told (a breaker opening, a
    timeout) -- after the policy decided to load from it."""

    failing = False

    def get(self, keys):
        if self.failing:
            raise TimeoutError("the tier timed out")
        return self.inner.get(keys)

    def get_layers(self, keys):
        if self.failing:
            raise TimeoutError("the tier timed out")
        return self.inner.get_layers(keys)


def test_tier_failing_after_the_decision_is_a_miss_recomputed(tiny_dir: Path, tmp_path: Path,
                                                              want: list) -> None:
    made: list[FailingReads] = []

    def factory(config, pool):
        disk = DiskBackend(config=config, pool=pool, path=str(tmp_path / "disk"))
        made.append(FailingReads(config=config, pool=pool, inner=disk))
        return made[0]

    cfg = {"chunk_size": CS, "local_cpu_size": "32MiB"}
    conn = LMCReferenceConnector(cfg, model_dir=tiny_dir, tiers=[factory])
    llm = LLM(tiny_dir, kv_connector=conn, num_blocks=128, block_size=BLOCK)
    run(llm, [P])
    drop_from_l1(conn, P, 0)
    eng = conn.cache
    # decided from the lookup (the disk tier fast by its prior), then the tier fails
    orig = eng.lookup_result

    def lookup_then_fail(tokens, *a, **kw):
        out = orig(tokens, *a, **kw)
        made[0].failing = True
        return out

    eng.lookup_result = lookup_then_fail  # type: ignore[method-assign]
    got = run(llm, [P])
    assert_same(got, want)  # the engine recomputed what the load could not supply
    assert stat(conn, "worker.recomputed_after_failure") == len(P) - 1
    assert stat(conn, "worker.load_failures") == 1
    rate = eng.speeds.snapshot().tiers[1]
    assert rate.observed >= 1 and made[0].inner is not None
    llm.close()


def test_chunked_prefill_budget_reaches_the_rule(tiny_dir: Path, tmp_path: Path,
                                                 want: list) -> None:
    """The engine's per-step budget is the policy's (only the first chunk hides a load),
    and a prompt prefilled over several steps after a split decision is still the same."""
    cfg = {"chunk_size": CS, "local_cpu_size": "32MiB", "lookup_min_wait": HANG_S,
           "tiers": ["memory", {"wrap": "rate_limit", "bytes_per_second": LINK,
                                "tier": {"backend": "disk", "path": str(tmp_path / "d")}}]}
    conn = LMCReferenceConnector(cfg, model_dir=tiny_dir)
    llm = LLM(tiny_dir, kv_connector=conn, num_blocks=128, block_size=BLOCK,
              max_num_batched_tokens=48)
    assert conn.policy.step_tokens == 48
    run(llm, [P[:64]])
    assert_same(run(llm, [P]), want)  # prefilled in 48-token steps, chunks stored
    drop_from_l1(conn, P, 2)
    assert_same(run(llm, [P]), want)  # the slow tier read once (its speed measured)
    stall(conn)
    drop_from_l1(conn, P, 2)
    decisions = Decisions(conn.policy)
    got = run(llm, [P])
    # the rule was told the budget: the decision is the rule's with 48-token steps on the
    # very costs it read (check_last; policy.step_tokens is 48, asserted above). Whether that
    # prediction differs from one long step's depends on the measured fit: each later step
    # pays its fixed cost c0, which a loaded machine's fit may put at 0 -- then chunking
    # costs nothing more and the two agree; with c0 > 0 they must differ
    split = decisions.check_last()
    costs = decisions.seen[-1][0]
    assert costs is not None
    if costs.prefill.c0 > 0:
        assert split.ttft_s != decisions.rule(step_tokens=0).ttft_s
    assert got[0].num_cached_tokens == split.end == 2 * CS  # the rest recomputed, in steps
    assert_same(got, want)
    llm.close()
