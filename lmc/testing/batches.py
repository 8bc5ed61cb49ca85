"""Batches: each key of a call answered in its place, hits beside misses, a key repeated in one
batch, empty batches, a long prompt's batch with holes."""

from __future__ import annotations

from lmc.testing.harness import (
    TierHarness,
    check_hit,
    key_of,
    release,
)


class BatchContract(TierHarness):
    """Batched calls answer key by key: every tier passes these."""

    def test_missing_keys_and_empty_batches(self, tier):
        missing = [key_of(f"never{i}") for i in range(3)]
        assert tier.get(missing) == [None] * 3
        assert tier.contains(missing) == [False] * 3
        assert tier.prefix_hits(missing) == 0
        assert tier.delete(missing) == 0
        assert tier.get([]) == [] and tier.contains([]) == []
        assert tier.put([], []) == 0 and tier.delete([]) == 0 and tier.prefix_hits([]) == 0
        assert self.used(tier) == 0, "a miss left pool memory allocated"

    def test_partial_batches_answer_each_key_in_place(self, tier, tier_spec):
        present = [key_of(f"part{i}") for i in range(4)]
        absent = [key_of(f"hole{i}") for i in range(3)]
        self.store(tier, tier_spec, present)
        ask = [present[0], absent[0], present[1], present[2], absent[1], present[3], absent[2]]
        want = [k in present for k in ask]
        assert tier.contains(ask) == want
        assert tier.prefix_hits(ask) == 1
        assert tier.prefix_hits(present[:2] + absent[:1] + present[2:]) == 2
        got = tier.get(ask)
        try:
            for k, o, hit in zip(ask, got, want):
                if hit:
                    check_hit(o, k)
                else:
                    assert o is None, f"{k.hex()} was never stored but got {o!r}"
        finally:
            release(got)
        assert tier.delete([present[1], absent[0]]) == 1
        assert tier.contains(present) == [True, False, True, True]
        assert tier.get([present[1]]) == [None]
        assert tier.delete([absent[1], present[0], present[3]]) == 2
        assert tier.contains(present) == [False, False, True, False]

    def test_duplicate_keys_in_one_batch(self, tier, tier_spec):
        """One key twice in a batch (two reads of one chunk promoted together): stored once,
        counted as stored each time, read as two references, deleted once."""
        k, j = key_of("dup-k"), key_of("dup-j")
        objs = self.chunks(tier, tier_spec, [k, k, j])
        try:
            assert tier.put([k, k, j], objs) == 3
        finally:
            release(objs)
        assert tier.contains([k, j, k]) == [True, True, True]
        got = tier.get([k, k, j, k])
        try:
            for key, o in zip([k, k, j, k], got):
                check_hit(o, key)
        finally:
            release(got)
        baseline = self.used(tier)
        again = self.chunks(tier, tier_spec, [j, j])
        try:  # present keys count as stored, and the tier takes nothing of these objects
            assert tier.put([j, j], again) == 2
        finally:
            release(again)
        assert self.used(tier) == baseline, "a put of present keys kept pool memory"
        assert tier.delete([k, k]) == 1
        assert tier.contains([k, j]) == [False, True]

    def test_large_batch_with_holes(self, tier, tier_spec):
        """One call for a whole long prompt (tiers split such batches over connections or
        threads): each of 48 keys answered in its place, 36 hits bit-exact, 12 misses."""
        keys = [key_of(f"large{i}") for i in range(48)]
        present = [k for i, k in enumerate(keys) if i % 4 != 3]
        self.store(tier, tier_spec, present)
        assert tier.contains(keys) == [k in present for k in keys]
        got = tier.get(keys)
        try:
            for k, o in zip(keys, got):
                if k in present:
                    check_hit(o, k)
                else:
                    assert o is None, f"{k.hex()} was never stored but got {o!r}"
        finally:
            release(got)
