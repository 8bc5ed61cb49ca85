"""vLLM's hit count under load or recompute (vLLM-free: the scheduler half on fake vLLM
requests): the answer is the part of the hit worth loading when the worker's speeds are in
this process (vLLM's uni-process executor), the whole hit when they are not."""

from __future__ import annotations

import pytest

from lmc.connectors.core.load_policy import Costs, LoadPolicy, local_costs, register_local
from lmc.connectors.core.scheduler import ConnectorConfig
from lmc.connectors.vllm.scheduler import SchedulerSide
from lmc.storage.speeds import PrefillRate, TierRate
from tests.connectors.test_vllm_parts import FakeClient, FakeRequest

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
