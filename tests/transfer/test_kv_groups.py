"""KVSpec.groups: a hybrid model's KV groups, their shapes and their place in the key
namespace; the plain case unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmc.transfer.kv_groups import FULL, SLIDING, STATE, KVGroup
from lmc.transfer.kv_spec import KVSpec

BASE = KVSpec(num_layers=4, num_kv_heads=2, head_size=8, dtype=torch.float16, block_size=4,
              layout="vllm_flash")


def test_one_full_group_over_every_layer_is_the_plain_case():
    same = dataclasses.replace(BASE, groups=(KVGroup(FULL, (0, 1, 2, 3)),))
    assert same.groups == () and not same.is_hybrid
    assert same.namespace_fields() == BASE.namespace_fields()
    assert "groups" not in BASE.namespace_fields()  # plain keys never moved


def test_group_geometry_is_in_the_namespace_and_shapes_follow_the_kind():
    hybrid = dataclasses.replace(BASE, groups=(
        KVGroup(FULL, (1, 3)), KVGroup(SLIDING, (0,), window=64),
        KVGroup(STATE, (2,), state_width=24, state_dtype=torch.float32)))
    ns = hybrid.namespace_fields()
    assert ns["groups"][1] == {"kind": "sliding", "layers": [0], "window": 64}
    assert ns["groups"][2]["dtype"] == "float32"
    other = dataclasses.replace(hybrid, groups=(
        KVGroup(FULL, (1, 3)), KVGroup(SLIDING, (0,), window=32),
        KVGroup(STATE, (2,), state_width=24, state_dtype=torch.float32)))
    assert other.namespace_fields() != ns
    assert hybrid.group_chunk_shape(0, 16) == (2, 2, 16, 16)
    assert hybrid.group_chunk_shape(1, 16) == (1, 2, 16, 16)
    assert hybrid.group_chunk_shape(2, 16) == (1, 1, 1, 24)
    assert hybrid.group_dtype(2) == torch.float32 and hybrid.group_dtype(0) == torch.float16
    assert hybrid.group_spec(0).num_layers == 2 and not hybrid.group_spec(0).groups
    assert hybrid.geometry_only().groups == hybrid.groups


def test_groups_must_cover_every_layer_once():
    with pytest.raises(ValueError, match="in no KV group"):
        dataclasses.replace(BASE, groups=(KVGroup(FULL, (0, 1)),
                                          KVGroup(SLIDING, (2,), window=4)))
    with pytest.raises(ValueError, match="names layer 7"):
        dataclasses.replace(BASE, groups=(KVGroup(FULL, (0, 1, 2, 7)),))
    with pytest.raises(ValueError, match="state layers only"):
        dataclasses.replace(BASE, groups=(KVGroup(STATE, (0, 1, 2, 3), state_width=4),))
