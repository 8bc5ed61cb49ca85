"""The hybrid rule (lmc.hybrid.rules): what each KV group keeps and where a hit is served."""

from __future__ import annotations

import pytest

from lmc.hybrid.rules import HitRule, chunk_ends, default_interval, part_key
from lmc.storage.lookup import LookupResult, minimum
from lmc.transfer.kv_groups import FULL, SLIDING, STATE, KVGroup

CS = 16
FULL_G = KVGroup(FULL, (0, 2))
SW = KVGroup(SLIDING, (1, 3), window=40)
ST = KVGroup(STATE, (4,), state_width=8)


def test_part_keys_differ_per_group_and_from_the_chunk_key():
    k = bytes(range(16))
    keys = {part_key(k, g) for g in range(4)}
    assert len(keys) == 4 and k not in keys and all(len(x) == 16 for x in keys)


def test_checkpoints_are_interval_multiples_the_last_whole_chunk_and_the_end():
    rule = HitRule((FULL_G, SW), CS, 64)
    assert rule.checkpoints(150) == [64, 128, 144, 150]
    assert rule.checkpoints(128) == [64, 128]
    assert rule.checkpoints(10) == [10]


def test_sliding_parts_are_kept_only_near_checkpoints():
    rule = HitRule((FULL_G, SW), CS, 256)
    cps = rule.checkpoints(150)  # [144, 150]
    kept = [k for k in range(10) if rule.keeps(SW, k * CS, min((k + 1) * CS, 150), cps)]
    # a load ending anywhere in [144 - 16, 150] needs positions from 128 - 39 = 89 on
    assert kept == [5, 6, 7, 8, 9]
    assert all(rule.keeps(FULL_G, k * CS, (k + 1) * CS, cps) for k in range(10))


def test_state_parts_only_at_checkpoints():
    rule = HitRule((FULL_G, ST), CS, 64)
    cps = rule.checkpoints(150)
    assert [e for e in range(CS, 161, CS) if rule.keeps(ST, e - CS, e, cps)] == [64, 128, 144]
    assert rule.keeps(ST, 144, 150, cps) and rule.slack == 0


def test_points_need_every_group_all_or_nothing():
    rule = HitRule((FULL_G, SW), CS, 64)
    n = 150
    ends = chunk_ends(n, CS, 10)
    full = [True] * 10
    sw = [False] * 5 + [True] * 5
    assert rule.points([full, sw], ends) == [144, 150]
    sw[6] = False  # one chunk's sliding part gone: the points whose window it is in go
    assert rule.points([full, sw], ends) == []
    full[9] = False  # and the full group's last chunk: only points before it
    sw[6] = True
    assert rule.points([full, sw], ends) == [144]


def test_a_state_point_is_the_chunk_end_whose_state_is_held():
    rule = HitRule((FULL_G, ST), CS, 64)
    ends = chunk_ends(150, CS, 10)
    state = [False] * 10
    state[3] = state[8] = True  # states after 64 and 144
    assert rule.points([[True] * 10, state], ends) == [64, 144]


def test_servable_ends_within_the_slack():
    r = LookupResult(150, CS, (), b"", (144, 150), slack=CS)
    assert r.servable_end(149) == 149
    assert r.servable_end(140) == 140  # 150 - 16 <= 140: the margin covers it
    assert r.servable_end(133) == 133  # within 144's slack
    assert r.servable_end(127) == 0
    exact = LookupResult(144, CS, (), b"", (64, 144), slack=0)
    assert exact.servable_end(143) == 64
    assert LookupResult(100, CS).servable_end(60) == 60  # plain: any end


def test_lookup_result_refuses_an_unservable_hit():
    with pytest.raises(ValueError, match="no servable end"):
        LookupResult(100, CS, (), b"", (64,), slack=0)


def test_minimum_keeps_the_points_every_rank_serves():
    a = LookupResult(150, CS, (), b"", (64, 144, 150), slack=0)
    b = LookupResult(150, CS, (), b"", (144, 150), slack=0)
    m = minimum([a, b])
    assert (m.tokens, m.points) == (150, (144, 150))
    c = LookupResult(64, CS, (), b"", (64,), slack=0)
    assert minimum([b, c]).tokens == 0  # no end both can serve


def test_default_interval_covers_two_windows():
    assert default_interval(256, (FULL_G, SW)) == 2048
    wide = KVGroup(SLIDING, (1,), window=4096)
    assert default_interval(256, (FULL_G, wide)) == 8704


def test_groups_are_checked():
    with pytest.raises(ValueError, match="window"):
        KVGroup(SLIDING, (1,))
    with pytest.raises(ValueError, match="not one lmc knows"):
        KVGroup("mamba", (1,))
    from lmc.transfer.kv_groups import check_groups
    with pytest.raises(ValueError, match="in KV groups 0 and 1"):
        check_groups([KVGroup(FULL, (0, 1)), KVGroup(SLIDING, (1,), window=4)], 2)
    with pytest.raises(ValueError, match="in no KV group"):
        check_groups([KVGroup(FULL, (0,))], 2)
