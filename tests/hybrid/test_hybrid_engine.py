"""A CacheEngine over a hybrid model's KV groups (lmc.hybrid): per-group parts stored as
their kinds require, hits only where every group can be served, bit-exact loads of exactly
what a continuation needs, and never one group's KV without the others'."""

from __future__ import annotations

import dataclasses

import torch

from lmc import CacheConfig, CacheEngine
from lmc.hybrid.rules import part_key
from lmc.token_database import key_hex
from lmc.transfer.kv_groups import FULL, SLIDING, STATE, KVGroup
from lmc.transfer.kv_spec import KVSpec
from tests.kvutil import make_caches, random_tokens

CS = 16
BS = 4
W = 40
SENTINEL = -7.0  # what an untouched destination element holds


def _spec(caches, groups) -> KVSpec:
    attn = [c for c in caches if c.dim() == 5]
    base = KVSpec.from_tensors(attn, "vllm_flash")
    return dataclasses.replace(base, num_layers=len(caches), groups=tuple(groups), num_blocks=0)


SW_GROUPS = (KVGroup(FULL, (0, 2)), KVGroup(SLIDING, (1, 3), window=W))


def _cfg(tmp_path=None, **kw) -> CacheConfig:
    base = {"chunk_size": CS, "local_cpu_size": "16MiB", "hybrid_checkpoint_interval": 64}
    if tmp_path is not None:
        base |= {"local_disk": str(tmp_path / "disk"), "local_disk_size": "64MiB"}
    return CacheConfig(**{**base, **kw})


def _slots(n: int, seed: int, blocks: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    b = torch.randperm(blocks, generator=g)[: -(-n // BS)]
    return (b[:, None] * BS + torch.arange(BS)).flatten()[:n]


def _rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[planes, positions, heads, dim] of one vllm_flash layer at ``slots``."""
    flat = cache.view(2, -1, cache.shape[3], cache.shape[4])
    return flat[:, slots]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (random bits include NaNs)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _fresh(n_layers=4):
    caches = make_caches("vllm_flash", layers=n_layers, blocks=64, block_size=BS, zeros=True)
    for c in caches:
        c.fill_(SENTINEL)
    return caches


def test_store_keeps_sliding_parts_only_near_checkpoints_and_loads_bit_exact():
    n = 150
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=BS, seed=1)
    spec = _spec(src, SW_GROUPS)
    toks, s1 = random_tokens(n, seed=3), _slots(n, 1)
    with CacheEngine(_cfg(hybrid_checkpoint_interval=256), spec, "m") as eng:
        assert eng.store(toks, src, s1) == n
        keys = eng.db.keys(toks)
        held = [eng.storage.l1_contains([part_key(k, g) for k in keys]) for g in (0, 1)]
        assert held[0] == [True] * 10
        assert held[1] == [False] * 5 + [True] * 5  # chunks before 128 - 16 - 39 never kept
        found = eng.lookup_result(toks)
        assert (found.tokens, found.points, found.slack) == (150, (144, 150), CS)
        # a full-prompt load, as connectors make one: the last token is the engine's
        dst, s2 = _fresh(), _slots(n, 2)
        end = n - 1
        s2_load = s2.clone()
        s2_load[end:] = -1
        assert eng.retrieve(toks, dst, [s2_load, s2_load], end=end) == end
    for layer in (0, 2):  # full attention: every position
        assert _same(_rows(dst[layer], s2[:end]), _rows(src[layer], s1[:end]))
    first = (end - W + 1) // CS * CS  # sliding: the chunks of the window, nothing before
    for layer in (1, 3):
        assert _same(_rows(dst[layer], s2[first:end]), _rows(src[layer], s1[first:end]))
        assert bool((_rows(dst[layer], s2[:first]) == SENTINEL).all())
    for layer in range(4):
        assert bool((_rows(dst[layer], s2[end:]) == SENTINEL).all())


def test_a_shared_prefix_hits_at_a_checkpoint_and_not_between():
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=BS, seed=1)
    spec = _spec(src, SW_GROUPS)
    toks = random_tokens(150, seed=4)
    with CacheEngine(_cfg(hybrid_checkpoint_interval=64), spec, "m") as eng:
        eng.store(toks, src, _slots(150, 1))
        other = toks[:100] + random_tokens(60, seed=5)
        got = eng.lookup_result(other)
        # chunks 0..5 (96 tokens) are shared; 64 is a checkpoint, 96 lies in 128's margin
        assert got.tokens == 96 and 64 in got.points
    with CacheEngine(_cfg(hybrid_checkpoint_interval=256), spec, "m") as eng:
        eng.store(toks, src, _slots(150, 1))
        assert eng.lookup(toks[:100] + random_tokens(60, seed=5)) == 0  # windows not kept


def test_a_missing_part_is_never_served_halfway():
    """The attacker's case: one group's part of one chunk gone (evicted, deleted, never
    written). The hit drops to an end every group can serve; a load asked for the old end
    serves only that end, and writes no group past it."""
    n = 150
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=BS, seed=1)
    spec = _spec(src, SW_GROUPS)
    toks, s1 = random_tokens(n, seed=6), _slots(n, 1)
    with CacheEngine(_cfg(hybrid_checkpoint_interval=64), spec, "m") as eng:
        eng.store(toks, src, s1)
        keys = eng.db.keys(toks)
        assert eng.lookup(toks) == 150
        eng.storage.delete([part_key(keys[7], 1)])  # the sliding part of chunk 7
        found = eng.lookup_result(toks)
        # every chunk kept its sliding part (checkpoints every 64): 112's window and slack
        # margin [57, 112) does not need chunk 7; 128, 144 and 150 do
        assert found.tokens == 112 and found.points[-1] == 112
        dst, s2 = _fresh(), _slots(n, 2)
        s2_load = s2.clone()
        s2_load[n - 1:] = -1
        served = eng.retrieve(toks, dst, [s2_load, s2_load], end=n - 1)
        assert served == 112
    for layer in range(4):  # nothing of any group past the served end
        assert bool((_rows(dst[layer], s2[112:]) == SENTINEL).all())
    assert _same(_rows(dst[0], s2[:112]), _rows(src[0], s1[:112]))
    lo = (112 - W + 1) // CS * CS
    assert _same(_rows(dst[1], s2[lo:112]), _rows(src[1], s1[lo:112]))


def test_full_part_missing_is_a_miss_at_and_after_it():
    n = 150
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=BS, seed=1)
    spec = _spec(src, SW_GROUPS)
    toks = random_tokens(n, seed=7)
    with CacheEngine(_cfg(), spec, "m") as eng:
        eng.store(toks, src, _slots(n, 1))
        eng.storage.delete([part_key(eng.db.keys(toks)[2], 0)])
        assert eng.lookup(toks) == 32  # the full group's chunk 2 is gone: nothing past it
        dst, s2 = _fresh(), _slots(n, 2)
        assert eng.retrieve(toks, dst, s2, end=n - 1) == 32
        assert all(bool((_rows(c, s2[32:]) == SENTINEL).all()) for c in dst)
    with CacheEngine(_cfg(hybrid_checkpoint_interval=256), spec, "m") as eng:
        eng.store(toks, src, _slots(n, 1))
        eng.storage.delete([part_key(eng.db.keys(toks)[2], 0)])
        assert eng.lookup(toks) == 0  # before chunk 2 no window was kept: a miss
        dst = _fresh()
        assert eng.retrieve(toks, dst, _slots(n, 2), end=n - 1) == 0
        assert all(bool((c == SENTINEL).all()) for c in dst)


def test_namespaces_of_plain_and_hybrid_never_meet(tmp_path):
    n = 64
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=BS, seed=1)
    hybrid = _spec(src, SW_GROUPS)
    plain = dataclasses.replace(hybrid, groups=())
    toks = random_tokens(n, seed=8)
    with CacheEngine(_cfg(tmp_path), plain, "m") as eng:
        eng.store(toks, src, _slots(n, 1))
        eng.flush(30)
        plain_keys = eng.db.keys(toks)
    with CacheEngine(_cfg(tmp_path), hybrid, "m") as eng:
        assert eng.db.keys(toks) != plain_keys
        assert eng.lookup(toks) == 0
        eng.store(toks, src, _slots(n, 1))
        eng.flush(30)
        assert eng.lookup(toks) == n
    with CacheEngine(_cfg(tmp_path), plain, "m") as eng:  # the hybrid parts: not its chunks
        eng.storage.clear_l1()
        assert eng.lookup(toks) == n  # its own chunks from disk
        other = random_tokens(n, seed=9)
    with CacheEngine(_cfg(tmp_path), hybrid, "m") as eng:
        assert eng.lookup(other) == 0
    other_window = (KVGroup(FULL, (0, 2)), KVGroup(SLIDING, (1, 3), window=W + 1))
    assert _spec(src, other_window).namespace_fields() != hybrid.namespace_fields()


def test_a_part_missing_on_disk_after_a_restart_is_a_miss(tmp_path):
    """Across a restart from disk: the hit is served whole; with one group's part file of
    one chunk removed from the directory, only the ends that do not need it."""
    n = 150
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=BS, seed=1)
    spec = _spec(src, SW_GROUPS)
    toks, s1 = random_tokens(n, seed=10), _slots(n, 1)
    with CacheEngine(_cfg(tmp_path), spec, "m") as eng:
        eng.store(toks, src, s1)
        assert eng.flush(30)
        keys = eng.db.keys(toks)
    with CacheEngine(_cfg(tmp_path), spec, "m") as eng:
        dst, s2 = _fresh(), _slots(n, 2)
        assert eng.retrieve(toks, dst, s2, end=128) == 128
        assert _same(_rows(dst[2], s2[:128]), _rows(src[2], s1[:128]))
        assert _same(_rows(dst[3], s2[80:128]), _rows(src[3], s1[80:128]))
    victim = key_hex(part_key(keys[8], 1))
    files = [p for p in (tmp_path / "disk").rglob("*.kv") if p.name.startswith(victim)]
    assert len(files) == 1
    files[0].unlink()
    with CacheEngine(_cfg(tmp_path), spec, "m") as eng:
        assert eng.lookup(toks) == 128  # 144 and 150 need chunk 8's window part


def test_a_part_file_overwritten_with_another_parts_bytes_is_a_miss(tmp_path):
    """A writer of the disk directory copies the full group's part file over the sliding
    group's of the same chunk (same size: the file name still fits): the header's key is
    another's, so the read is a bad value: a miss, deleted, never loaded."""
    n = 64
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=BS, seed=1)
    spec = _spec(src, SW_GROUPS)
    toks = random_tokens(n, seed=11)
    with CacheEngine(_cfg(tmp_path), spec, "m") as eng:
        eng.store(toks, src, _slots(n, 1))
        assert eng.flush(30)
        keys = eng.db.keys(toks)

    def path(key: bytes):
        return next(p for p in (tmp_path / "disk").rglob("*.kv")
                    if p.name.startswith(key_hex(key)))

    path(part_key(keys[3], 1)).write_bytes(path(part_key(keys[3], 0)).read_bytes())
    with CacheEngine(_cfg(tmp_path), spec, "m") as eng:
        assert eng.lookup(toks) == n  # the file exists: lookups do not read values
        dst = _fresh()
        assert eng.retrieve(toks, dst, _slots(n, 2), end=n - 1) == 48
        assert eng.lookup(toks) == 48  # deleted as a bad value


def test_a_part_of_another_groups_shape_is_a_miss():
    """A value under a sliding part's key holding the full group's shape (a forged header a
    shared store's writer could produce: it passes the tiers' geometry check, which accepts
    any of the engine's part shapes) is refused by the engine's check: deleted, a miss."""
    n = 64
    src = make_caches("vllm_flash", layers=5, blocks=64, block_size=BS, seed=1)
    groups = (KVGroup(FULL, (0, 2, 4)), KVGroup(SLIDING, (1, 3), window=W))
    spec = _spec(src, groups)
    toks = random_tokens(n, seed=15)
    with CacheEngine(_cfg(), spec, "m") as eng:
        eng.store(toks, src, _slots(n, 1))
        keys = eng.db.keys(toks)
        victim = part_key(keys[3], 1)
        eng.storage.delete([victim])
        forged = eng.storage.allocate(spec.group_chunk_shape(0, CS), spec.dtype, CS)
        forged.tensor.zero_()
        eng.storage.put([victim], [forged])
        forged.release()
        assert eng.lookup(toks) == n
        assert eng.retrieve(toks, _fresh(5), _slots(n, 2), end=n - 1) == 48
        assert not eng.storage.l1_contains([victim])[0]


def test_layerwise_retrieve_and_store_by_engine_layer():
    n = 96
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=BS, seed=1)
    spec = _spec(src, SW_GROUPS)
    toks, s1 = random_tokens(n, seed=12), _slots(n, 1)
    with CacheEngine(_cfg(), spec, "m") as eng:
        st = eng.store_layer(toks, src, s1)
        for layer in (3, 0, 2, 1):  # any order, by engine layer index
            st.save(layer, sync=True)
        assert st.commit() == n
        dst, s2 = _fresh(), _slots(n, 2)
        rt = eng.retrieve_layer(toks, dst, s2, end=n)
        assert rt.num_tokens == n
        rt.start()
        for layer in range(4):
            rt.wait(layer)
        assert rt.close() == n
    assert _same(_rows(dst[0], s2), _rows(src[0], s1))
    assert _same(_rows(dst[1], s2[48:]), _rows(src[1], s1[48:]))


def test_per_group_slot_mappings():
    """Each group has its own block table: a group's part is read from and written to its
    own slots."""
    n = 64
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=BS, seed=1)
    spec = _spec(src, SW_GROUPS)
    toks = random_tokens(n, seed=13)
    a1, b1, a2, b2 = _slots(n, 1), _slots(n, 5), _slots(n, 2), _slots(n, 6)
    with CacheEngine(_cfg(), spec, "m") as eng:
        eng.store(toks, src, [a1, b1])
        dst = _fresh()
        assert eng.retrieve(toks, dst, [a2, b2]) == n
    assert _same(_rows(dst[2], a2), _rows(src[2], a1))
    assert _same(_rows(dst[3], b2[16:]), _rows(src[3], b1[16:]))


# ------------------------------------------------------------------------- state groups
def _state_caches(rows=8, width=6, seed=2):
    attn = make_caches("vllm_flash", layers=2, blocks=64, block_size=BS, seed=seed)
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(rows, 2, 1, generator=g)
    ssm = torch.randn(rows, 4, generator=g)
    return [attn[0], (conv, ssm), attn[1]], width


def test_state_parts_at_checkpoints_and_loaded_at_exact_ends():
    """A state-space layer beside attention: its state after a checkpoint is stored when the
    engine's state then was that position's (slot >= 0 only there), and a hit is reported
    only at an end whose state is held; the load writes the state into the request's row."""
    n = 150
    caches, width = _state_caches()
    groups = (KVGroup(FULL, (0, 2)), KVGroup(STATE, (1,), state_width=width))
    spec = dataclasses.replace(KVSpec.from_tensors([caches[0], caches[2]], "vllm_flash"),
                               num_layers=3, groups=groups, num_blocks=0)
    toks, s1 = random_tokens(n, seed=14), _slots(n, 1)
    with CacheEngine(_cfg(), spec, "m") as eng:
        state_slots = torch.full((n,), -1, dtype=torch.long)
        state_slots[63] = 3  # the engine's state after position 63 is in row 3
        eng.store(toks[:64], caches, [s1[:64], state_slots[:64]], horizon=n)
        found = eng.lookup_result(toks)
        assert (found.tokens, found.points, found.slack) == (64, (64,), 0)
        assert found.servable_end(149) == 64
        dst, _ = _state_caches(seed=9)
        row = torch.full((n,), -1, dtype=torch.long)
        row[:] = 5  # the request's state row in the destination engine
        want = torch.cat([caches[1][0][3].reshape(-1), caches[1][1][3].reshape(-1)])
        assert eng.retrieve(toks, dst, [_slots(n, 2), row], end=64) == 64
        got = torch.cat([dst[1][0][5].reshape(-1), dst[1][1][5].reshape(-1)])
        assert torch.equal(got, want)
        assert eng.retrieve(toks, dst, [_slots(n, 2), row], end=60) == 0  # no state at 60


def test_pins_and_prefetch_cover_every_groups_parts(tmp_path):
    """A pinned lookup holds the L1 parts its hit needs (every group's) until the owner's
    retrieve; a prefetch pulls every group's stored parts from disk into L1 and answers the
    end then servable from L1."""
    n = 150
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=BS, seed=1)
    spec = _spec(src, SW_GROUPS)
    toks = random_tokens(n, seed=16)
    with CacheEngine(_cfg(tmp_path), spec, "m") as eng:
        eng.store(toks, src, _slots(n, 1))
        assert eng.lookup(toks, pin=True, request_id="r") == n
        # the full parts of all 10 chunks, the sliding parts of 150's window and slack
        want = 10 + len(eng.hybrid.rule.margin(SW_GROUPS[1], n))
        assert eng.stats()["pinned_chunks"] == want
        eng.retrieve(toks, _fresh(), _slots(n, 2), request_id="r", end=n - 1)
        assert eng.stats()["pinned_chunks"] == 0
        assert eng.flush(30)
        eng.storage.clear_l1()
        assert not any(eng.contains_chunks(toks))
        assert eng.prefetch(toks).result(timeout=30) == n
        assert all(eng.contains_chunks(toks))
