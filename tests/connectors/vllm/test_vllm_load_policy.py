"""vLLM's hit count under load or recompute (vLLM-free: the scheduler half on fake vLLM
requests): the answer is the part of the hit worth loading when the worker's speeds are in
this process (vLLM's uni-process executor), the whole hit when they are not."""

from __future__ import annotations

import pytest

from lmc.connectors.core.load_policy import Costs, LoadPolicy, local_costs, register_local
from lmc.connectors.core.scheduler import ConnectorConfig
from lmc.connectors.vllm.scheduler import SchedulerSide
from lmc.storage.speeds import PrefillRate, TierRate
from tests.connectors.vllm.test_vllm_parts import FakeClient, FakeRequest

SLOW = Costs((TierRate("cpu", 8e9), TierRate("disk", 1e6, overlaps=False)),
             PrefillRate(0.0, 1e-4), 4096, 8)


@pytest.fixture
def path():
    p = "/tmp/lmc-test-lookup-rank0.sock"
    yield p
    register_local(p, None)


def side(path: str, enabled: bool = True) -> SchedulerSide:
    policy = LoadPolicy(local_costs([path]), enabled=enabled)
    return SchedulerSide(ConnectorConfig(chunk_size=256), FakeClient(hit=1024, l1=256), policy)


def test_worker_in_this_process_cuts_the_hit(path: str) -> None:
    register_local(path, lambda: SLOW)
    s = side(path)
    req = FakeRequest("r", list(range(2, 1026)))
    assert s.get_num_new_matched_tokens(req, 0) == (256, False)  # L1's chunk only
    st = s.stats()
    assert st["policy.recomputed_by_choice"] == 1023 - 256
    assert st["policy.loaded_from_cpu"] == 256


def test_worker_elsewhere_or_policy_off_loads_all(path: str) -> None:
    req = FakeRequest("r", list(range(2, 1026)))
    assert side(path).get_num_new_matched_tokens(req, 0) == (1023, False)  # not registered
    register_local(path, lambda: SLOW)
    assert side(path, enabled=False).get_num_new_matched_tokens(req, 0) == (1023, False)
    assert local_costs([path, "/elsewhere.sock"])() is None  # a rank in another process


def test_worker_in_another_process_sends_its_speeds() -> None:
    """vLLM with tensor-parallel workers in their own processes: the scheduler asks rank 0's
    speeds over the lookup socket (a real LookupServer and LookupClient) and cuts the hit
    as in-process; a rank that cannot say (no costs yet) leaves the whole hit loaded."""
    import os
    import time

    from lmc.connectors.core.lookup_service import LookupClient, LookupServer
    from lmc.storage.lookup import LookupResult

    d = f"/tmp/lmc-t-{os.getpid()}-{time.monotonic_ns()}"
    os.mkdir(d)
    known = {"costs": None}

    def lookup(tokens):
        n = min(1024, len(tokens))
        return LookupResult(n, 256, ("cpu", "disk"), tuple(0 if i == 0 else 1
                                                            for i in range(-(-n // 256))))

    server = LookupServer(f"{d}/rank0.sock", lookup, costs=lambda: known["costs"])
    client = LookupClient([server.path], 2.0, use_local=False)
    client.speeds_max_age = 0.0
    try:
        policy = LoadPolicy(local_costs([server.path], remote=client.costs))
        s = SchedulerSide(ConnectorConfig(chunk_size=256), client, policy)
        req = FakeRequest("a", list(range(2, 1026)))
        assert s.get_num_new_matched_tokens(req, 0) == (1023, False)  # not measured yet
        known["costs"] = SLOW
        req = FakeRequest("b", list(range(2, 1026)))
        assert s.get_num_new_matched_tokens(req, 0) == (256, False)  # L1's chunk only
    finally:
        client.close()
        server.close()
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)


def test_a_waiting_request_prefetches_over_the_socket_and_is_decided_again() -> None:
    """What rank 0 would recompute by choice is prefetched into every rank's L1 over the
    lookup socket; once a lookup sees it there, the waiting request is decided again and
    loads the whole hit."""
    import os
    import time
    from concurrent.futures import Future

    from lmc.connectors.core.lookup_service import LookupClient, LookupServer
    from lmc.storage.lookup import LookupResult

    d = f"/tmp/lmc-t-{os.getpid()}-{time.monotonic_ns()}"
    os.mkdir(d)
    state = {"l1_chunks": 1}
    asked: list[tuple[int, int]] = []

    def lookup(tokens):
        n = min(1024, len(tokens))
        return LookupResult(n, 256, ("cpu", "disk"),
                            tuple(0 if i < state["l1_chunks"] else 1
                                  for i in range(-(-n // 256))))

    def prefetch(tokens, start):
        asked.append((len(tokens), start))
        f: Future = Future()
        f.set_result(len(tokens))
        return f

    servers = [LookupServer(f"{d}/rank{r}.sock", lookup, costs=lambda: SLOW,
                            prefetch=prefetch) for r in range(2)]
    client = LookupClient([s.path for s in servers], 2.0, use_local=False)
    try:
        policy = LoadPolicy(local_costs([s.path for s in servers], remote=client.costs))
        side_ = SchedulerSide(ConnectorConfig(chunk_size=256), client, policy)
        req = FakeRequest("w", list(range(2, 1026)))
        assert side_.get_num_new_matched_tokens(req, 0) == (256, False)
        assert asked == [(1024, 256), (1024, 256)]  # both ranks, from the cut on
        assert side_.get_num_new_matched_tokens(req, 0) == (256, False)  # not landed yet
        state["l1_chunks"] = 4  # the prefetch has landed on every rank
        time.sleep(0.05)
        assert side_.get_num_new_matched_tokens(req, 0) == (1023, False)
        assert side_.core.stats.redecisions == 1 and side_.core.stats.prefetches == 1
    finally:
        client.close()
        for s in servers:
            s.close()
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)
