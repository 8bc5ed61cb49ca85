"""References and leaks: ``get`` hands the caller one reference per hit, ``put`` keeps none of
the caller's, a chunk a reader holds is never freed or reused whatever the tier evicts, and a
read into a full pool is a miss. Every test also ends with the harness's leak checks: each
tier closed must have given all its pool memory back, and no pool invariant broke."""

from __future__ import annotations

import torch

from lmc.memory.pool import MemoryObj
from lmc.storage.tier import MemoryTier
from lmc.testing.harness import (
    CHUNK_BYTES,
    SHAPE,
    SMALL_POOL_BYTES,
    TierHarness,
    check_hit,
    get_checked,
    key_of,
    release,
)


class ReferenceContract(TierHarness):
    """Pool references balance, under eviction and a full pool: every tier passes these."""

    def test_each_hit_is_one_reference_for_the_caller(self, tier, tier_spec):
        """Releasing what ``get`` returned gives the pool back exactly its memory: no
        reference is kept for the caller, none is missing."""
        keys = [key_of(f"ref{i}") for i in range(3)]
        self.store(tier, tier_spec, keys)
        baseline = self.used(tier)
        for _ in range(3):
            got = tier.get(keys)
            assert all(o is not None and o.ref_count >= 1 for o in got)
            release(got)
            assert self.used(tier) == baseline, "get leaked or lost a pool reference"

    def test_eviction_never_reuses_a_chunk_a_reader_holds(self, make_tier, tier_spec):
        """A reader holds one chunk while a flood four times the pool (and any tier capacity)
        goes through: every read of the flood is right, and the held chunk keeps its bytes.
        A memory tier also keeps the held chunk itself (referenced chunks are never evicted)."""
        tier = make_tier(SMALL_POOL_BYTES)
        held_key = key_of("held")
        self.store(tier, tier_spec, [held_key, key_of("held-neighbour")])
        held = tier.get([held_key])[0]
        check_hit(held, held_key)
        try:
            flood = [key_of(f"flood{i}") for i in range(4 * SMALL_POOL_BYTES // CHUNK_BYTES)]
            for at in range(0, len(flood), 6):
                batch = flood[at: at + 6]
                objs = self.chunks(tier, tier_spec, batch)
                try:
                    tier.put(batch[: len(objs)], objs)
                finally:
                    release(objs)
                got = tier.get(flood[max(0, at - 6): at + 6])
                try:
                    for k, o in zip(flood[max(0, at - 6): at + 6], got):
                        if o is not None:
                            check_hit(o, k)
                finally:
                    release(got)
                check_hit(held, held_key)
            if isinstance(tier, MemoryTier):
                again = tier.get([held_key])
                try:
                    check_hit(again[0], held_key)
                finally:
                    release(again)
        finally:
            held.release()

    def test_reads_into_a_full_pool_are_misses_then_hits(self, tier, tier_spec):
        """With every byte of the pool held by the caller, a read that needs memory is a
        miss, never an error or a partial object; once memory is back the same reads hit
        (a tier that could not place a value must leave its connection or file clean)."""
        keys = [key_of(f"full{i}") for i in range(6)]
        self.store(tier, tier_spec, keys)
        filler: list[MemoryObj] = []
        while True:
            more = tier.pool.allocate_many(SHAPE, torch.float16, 64, SHAPE[2])
            if not more:
                break
            filler += more
        try:
            for _ in range(2):
                got = tier.get(keys)
                try:
                    for k, o in zip(keys, got):
                        if isinstance(tier, MemoryTier):  # hands out the objects it holds
                            check_hit(o, k)
                        else:
                            assert o is None, f"{o!r} read into a pool with no room"
                finally:
                    release(got)
        finally:
            release(filler)
        get_checked(tier, keys)
