"""The scheduler half on its own: lookups, clamping, alignment, load plans, and the stateless
save plan across chunked prefill. No engine, no tensors: a fake lookup stands in for the
cache."""

from __future__ import annotations

import pickle

import pytest

from lmc.connectors.core.metadata import ConnectorMetadata, LoadSpec, SaveSpec, StepRequest
from lmc.connectors.core.scheduler import ConnectorConfig, SchedulerConnector
from lmc.storage.lookup import LookupResult

CS = 16


class FakeLookup:
    def __init__(self, hit: int | None) -> None:
        self.hit = hit
        self.calls = 0

    def __call__(self, tokens) -> int | None:
        self.calls += 1
        if isinstance(self.hit, Exception):
            raise self.hit
        return None if self.hit is None else min(self.hit, len(tokens))


def make(hit: int | None = 0, **kw) -> tuple[SchedulerConnector, FakeLookup]:
    look = FakeLookup(hit)
    return SchedulerConnector(ConnectorConfig(chunk_size=CS, **kw), look), look


def step(rid: str, tokens: list[int], computed: int, scheduled: int, prompt: int | None = None,
         blocks: int = 64) -> StepRequest:
    return StepRequest(rid, tokens, len(tokens) if prompt is None else prompt,
                       list(range(blocks)), computed, scheduled)


TOKENS = list(range(100, 200))  # 100 tokens: 6 full chunks + 4


def test_one_lookup_per_admission_and_last_token_left() -> None:
    sc, look = make(hit=100)
    assert sc.get_num_new_matched_tokens("a", TOKENS, 0) == 99
    assert sc.get_num_new_matched_tokens("a", TOKENS, 0) == 99  # asked again while waiting
    assert look.calls == 1
    sc.update_state_after_alloc("a", TOKENS, 0, 99)
    assert sc.get_num_new_matched_tokens("a", TOKENS, 0) == 99  # a new admission looks again
    assert look.calls == 2


def test_full_hit_loads_the_last_chunk_with_the_last_position_left_out() -> None:
    sc, _ = make(hit=100)
    n = sc.get_num_new_matched_tokens("a", TOKENS, 0)
    sc.update_state_after_alloc("a", TOKENS, 0, n)
    meta = sc.build_metadata([step("a", TOKENS, 99, 1)])
    (load,) = meta.loads
    assert (load.start, load.end, load.mask_start) == (0, 99, 0)
    assert load.token_ids == tuple(TOKENS)  # the whole last (partial) chunk is fetched
    assert load.block_ids == tuple(range(64))


@pytest.mark.parametrize("hit, align, want", [(64, 1, 64), (100, 8, 96), (70, 1, 70),
                                              (100, 1, 99), (5, 8, 0)])
def test_clamp_and_alignment(hit: int, align: int, want: int) -> None:
    sc, _ = make(hit=hit, align=align)
    assert sc.get_num_new_matched_tokens("a", TOKENS, 0) == want


def test_answer_is_relative_to_local_prefix() -> None:
    sc, _ = make(hit=64)
    assert sc.get_num_new_matched_tokens("a", TOKENS, 20) == 44
    sc.update_state_after_alloc("a", TOKENS, 20, 44)
    (load,) = sc.build_metadata([step("a", TOKENS, 64, 36)]).loads
    assert (load.start, load.end, load.mask_start) == (20, 64, 16)
    assert len(load.token_ids) == 64


def test_partial_load_cuts_tokens_at_chunk_end() -> None:
    sc, _ = make(hit=96)
    sc.update_state_after_alloc("a", TOKENS, 0, 40)  # the engine took less than offered
    (load,) = sc.build_metadata([step("a", TOKENS, 40, 60)]).loads
    assert load.end == 40 and len(load.token_ids) == 48


def test_lookup_errors_and_not_yet() -> None:
    sc, _ = make(hit=RuntimeError("remote down"))
    assert sc.get_num_new_matched_tokens("a", TOKENS, 0) == 0
    assert sc.stats.lookup_errors == 1
    sc, look = make(hit=None)
    assert sc.get_num_new_matched_tokens("a", TOKENS, 0) is None
    look.hit = 32
    assert sc.get_num_new_matched_tokens("a", TOKENS, 0) == 32


def test_roles() -> None:
    sc, look = make(hit=100, load=False)
    assert sc.get_num_new_matched_tokens("a", TOKENS, 0) == 0 and look.calls == 0
    assert sc.build_metadata([step("a", TOKENS, 0, 100)]).saves
    sc, _ = make(hit=0, save=False)
    assert not sc.build_metadata([step("a", TOKENS, 0, 100)]).saves


def test_chunked_prefill_saves_each_chunk_once() -> None:
    sc, _ = make()
    saved: list[tuple[int, int]] = []
    computed = 0
    for budget in (20, 20, 7, 30, 23):  # 100 tokens over five steps, chunk ends mid-step
        (save,) = sc.build_metadata([step("a", TOKENS, computed, budget)]).saves or [None]
        if save is not None:
            assert save.start % CS == 0
            saved.append((save.start, save.end))
        computed += budget
    assert saved == [(0, 16), (16, 32), (32, 64), (64, 100)]
    # the chunks of all saves tile the prompt exactly, the partial tail at prefill's end
    starts = [s for s, _ in saved]
    assert starts == sorted(set(starts))


def test_no_partial_tail_without_save_unfull_chunk() -> None:
    sc, _ = make(save_unfull_chunk=False)
    (save,) = sc.build_metadata([step("a", TOKENS, 0, 100)]).saves
    assert save.end == 96


def test_decode_saves_only_when_asked() -> None:
    toks = TOKENS + [7] * 28  # 128 tokens: 100 prompt + 28 generated
    sc, _ = make()
    assert not sc.build_metadata([step("a", toks, 127, 1, prompt=100)]).saves
    sc, _ = make(save_decode=True)
    (save,) = sc.build_metadata([step("a", toks, 127, 1, prompt=100)]).saves
    assert (save.start, save.end) == (112, 128)
    assert not sc.build_metadata([step("a", toks[:127], 126, 1, prompt=100)]).saves


def test_rollback_saves_recomputed_chunks_again() -> None:
    sc, _ = make()
    first = sc.build_metadata([step("a", TOKENS, 0, 64)]).saves
    again = sc.build_metadata([step("a", TOKENS, 16, 48)]).saves  # rolled back to 16
    assert (first[0].start, first[0].end) == (0, 64)
    assert (again[0].start, again[0].end) == (16, 64)


def test_finish_and_preemption_forget_state() -> None:
    sc, _ = make(hit=64)
    sc.get_num_new_matched_tokens("a", TOKENS, 0)
    sc.get_num_new_matched_tokens("b", TOKENS, 0)
    sc.update_state_after_alloc("b", TOKENS, 0, 64)
    assert sc.num_tracked_requests == 2
    sc.request_finished("a")
    sc.build_metadata([], preempted_ids=["b"])
    assert sc.num_tracked_requests == 0


def test_metadata_pickles() -> None:
    sc, _ = make(hit=100)
    sc.update_state_after_alloc("a", TOKENS, 0, 99)
    meta = sc.build_metadata([step("a", TOKENS, 99, 1)])
    back = pickle.loads(pickle.dumps(meta))
    assert back == meta and isinstance(back, ConnectorMetadata)
    assert isinstance(back.loads[0], LoadSpec) and isinstance(back.saves[0], SaveSpec)


def test_load_sources_come_from_the_requests_own_lookup() -> None:
    """The tiers of an admitted load are cut from the result kept with the request: no
    second lookup, no state shared between requests."""
    answers = {
        "a": LookupResult(48, CS, ("cpu", "disk"), (0, 1, 1)),
        "b": LookupResult(32, CS, ("cpu", "disk"), (0, 0)),
    }
    calls: list[str] = []

    def lookup(tokens):
        rid = "a" if tokens[0] == 100 else "b"
        calls.append(rid)
        return answers[rid]

    sched = SchedulerConnector(ConnectorConfig(chunk_size=CS), lookup)
    other = list(range(300, 400))
    assert sched.get_num_new_matched_tokens("a", TOKENS, 0) == 48
    assert sched.get_num_new_matched_tokens("b", other, 0) == 32  # interleaved
    sched.update_state_after_alloc("b", other, 0, 32)
    sched.update_state_after_alloc("a", TOKENS, 8, 40)  # 8 tokens were the engine's own
    assert sched.load_sources("a") == {"cpu": 8, "disk": 32}
    assert sched.load_sources("b") == {"cpu": 32, "disk": 0}
    assert calls == ["a", "b"]
    meta = sched.build_metadata([step("a", TOKENS, 48, 52), step("b", other, 32, 68)])
    assert len(meta.loads) == 2 and sched.load_sources("a") == {}


def test_a_plain_count_or_a_foreign_chunk_size_is_handled() -> None:
    sched, _ = make(40)  # an int answer: usable, not attributed
    assert sched.get_num_new_matched_tokens("r", TOKENS, 0) == 40
    sched.update_state_after_alloc("r", TOKENS, 0, 40)
    assert sched.load_sources("r") == {}
    wrong = SchedulerConnector(ConnectorConfig(chunk_size=CS),
                               lambda t: LookupResult(64, 32, ("cpu",), (0, 0)))
    assert wrong.get_num_new_matched_tokens("r", TOKENS, 0) == 0
    assert wrong.stats.lookup_errors == 1


def test_finished_requests_reach_the_worker_with_the_next_step_that_has_work() -> None:
    sched, _ = make(0)
    empty = sched.build_metadata([], finished_ids=["a"])
    assert empty.is_empty and empty.forget == ["a"]  # an adapter may never bind this one
    meta = sched.build_metadata([step("b", TOKENS, 0, 16)], finished_ids=["c"],
                                preempted_ids=["d"])
    assert meta.forget == ["a", "c"] and meta.saves  # preempted requests keep their tokens
    assert sched.build_metadata([step("b", TOKENS, 16, 16)]).forget == []
