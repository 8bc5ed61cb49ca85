"""The vLLM connector's hybrid-model parts without vLLM: the scheduler half's per-group block
tables (vLLM's null block read as "not held"), asynchronous hybrid loads, and the layout's
tolerance of vLLM's overlaid KV cache groups. (Against real vLLM: ``test_vllm_hybrid.py``.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from lmc.connectors.core.scheduler import ConnectorConfig
from lmc.connectors.vllm.groups import group_tables
from lmc.connectors.vllm.layout import UnsupportedLayout, resolve_gpu
from lmc.connectors.vllm.scheduler import SchedulerSide
from lmc.storage.lookup import LookupResult
from tests.connectors.vllm.test_vllm_parts import Cached, FakeRequest, NewReq, Output


class HybridClient:
    """Answers a hybrid hit of ``hit`` tokens servable at ``points`` (slack one chunk)."""

    def __init__(self, hit: int, points: tuple[int, ...]) -> None:
        self.hit, self.points = hit, points
        from lmc.connectors.core.lookup_service import LookupClientStats
        self.stats = LookupClientStats()

    def lookup(self, tokens, tag=None):
        return LookupResult(self.hit, 256, ("cpu",), bytes(-(-self.hit // 256)), self.points,
                            256)

    def close(self) -> None:
        pass


@dataclass
class Blocks:
    ids: tuple[list[int], ...]

    def get_block_ids(self):
        return self.ids


@dataclass
class BlockState:
    tables: dict[str, tuple[list[int], ...]]

    def get_block_ids(self, rid):
        return self.tables.get(rid)


def hybrid_side(hit: int, points: tuple[int, ...]) -> SchedulerSide:
    return SchedulerSide(ConnectorConfig(chunk_size=256, async_loads=True),
                         HybridClient(hit, points), groups=2)


def test_null_blocks_are_not_held():
    assert group_tables(([0, 0, 7, 8], [1, 2, 3, 4])) == ((-1, -1, 7, 8), (1, 2, 3, 4))
    assert group_tables(None) == ()


def test_a_hybrid_hit_is_asynchronous_with_every_groups_blocks():
    """vLLM refuses block-level load errors with several KV cache groups, so a hybrid hit
    loads before the request is scheduled, into every group's blocks."""
    s = hybrid_side(1500, (1280, 1500))
    req = FakeRequest("r", list(range(2, 1502)))
    n, is_async = s.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (1499, True)
    sliding = [0] * 8 + [9, 10, 11, 12]  # the window's blocks; the rest vLLM's null block
    full = list(range(20, 32))
    s.update_state_after_alloc(req, 1499, Blocks((sliding, full)))
    meta = s.build_meta(Output())
    (load,) = meta.async_loads
    assert (load.start, load.end) == (0, 1499)
    assert load.group_block_ids == (tuple([-1] * 8 + [9, 10, 11, 12]), tuple(full))
    assert not meta.loads


def test_a_hit_between_points_is_cut_to_a_servable_end():
    s = hybrid_side(1500, (512, 1500))
    req = FakeRequest("r", list(range(2, 1502)) + [])
    # vLLM's own prefix cache already holds 1280 tokens: lmc can add up to 1499
    assert s.get_num_new_matched_tokens(req, 1280) == (219, True)
    s2 = hybrid_side(1024, (512, 1024))
    req2 = FakeRequest("q", list(range(2, 1002)) + list(range(5000, 5100)))
    assert s2.get_num_new_matched_tokens(req2, 0) == (1024, True)
    s3 = hybrid_side(1100, (512, 1100))
    req3 = FakeRequest("p", list(range(2, 1102)))  # 1100 tokens: ends at 1099, within slack
    assert s3.get_num_new_matched_tokens(req3, 0) == (1099, True)


def test_saves_carry_the_schedulers_current_tables_and_their_horizon():
    """The step's tables come from vLLM's scheduler (``kv_connector_block_state``: a
    sliding window's freed blocks are the null block there, never a reused block id)."""
    s = hybrid_side(0, ())
    req = FakeRequest("r", list(range(2, 1302)))
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, 0, Blocks(([], [])))
    step1 = s.build_meta(Output([NewReq("r", ([1, 2, 3, 4], [11, 12, 13, 14]), 0)],
                                num_scheduled_tokens={"r": 512}))
    (sv,) = step1.saves
    assert sv.group_block_ids == ((1, 2, 3, 4), (11, 12, 13, 14)) and sv.horizon == 1300
    so = Output(scheduled_cached_reqs=Cached(["r"], set(), [([5, 6, 7, 8], [15, 16, 17, 18])],
                                             [512]), num_scheduled_tokens={"r": 512})
    so.kv_connector_block_state = BlockState({"r": ([0, 0, 0, 4, 5, 6, 7, 8],
                                                    list(range(11, 19)))})
    (sv2,) = s.build_meta(so).saves
    assert sv2.group_block_ids[0] == (-1, -1, -1, 4, 5, 6, 7, 8)
    so2 = Output(scheduled_cached_reqs=Cached(["r"], set(), [([9, 10], [19, 20])], [1024]),
                 num_scheduled_tokens={"r": 276})
    (sv3,) = s.build_meta(so2).saves  # no block state offered: the appended tables
    assert sv3.group_block_ids[1] == tuple(range(11, 21))


def test_overlaid_groups_may_share_memory_one_group_may_not():
    """vLLM's hybrid allocator overlays its groups' tensors (a block id is one group's at a
    time); layers of one group sharing memory would still lose KV."""
    t = torch.zeros(8, 2, 16, 128)
    kv = {"model.layers.0.self_attn.attn": t, "model.layers.1.self_attn.attn": t}
    with pytest.raises(UnsupportedLayout, match="share one KV cache"):
        resolve_gpu(kv, "FLASH_ATTN", False)
    choice = resolve_gpu(kv, "FLASH_ATTN", False,
                         group_of={"model.layers.0.self_attn.attn": 0,
                                   "model.layers.1.self_attn.attn": 1})
    assert choice.layout == "vllm_gpu" and len(choice.names) == 2
