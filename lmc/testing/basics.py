"""Round trips: what a tier stores it gives back bit for bit, for every dtype a ``lmc.storage.serde``
header describes (``ROUND_TRIPS``: float16, bfloat16, float32, uint8, the float8 kinds torch
has) and a partial chunk; its I/O stays inside each object; a caller's bug (keys and objects
of different lengths) is a clear error, and a chunk the tier cannot represent is skipped; what
the tier declares (medium, capabilities) is what it is."""

from __future__ import annotations

import pytest
import torch

from lmc.storage.tier import Medium, MemoryTier, TierCapabilities, tier_medium
from lmc.testing.harness import (
    ROUND_TRIPS,
    SHAPE,
    TierHarness,
    check_hit,
    get_checked,
    key_of,
    raw,
    release,
    stored_bytes,
)


class BasicContract(TierHarness):
    """The basic promises of ``StorageBackend``: every tier passes these."""

    def test_round_trip_is_bit_exact(self, tier, tier_spec):
        """Every dtype and a partial chunk come back with their shape, dtype, token count
        and every bit, as often as asked."""
        for shape, dtype in ROUND_TRIPS:
            case = f"{tuple(shape)} {dtype}"
            keys = [key_of(f"rt{i}{case}") for i in range(3)]
            self.store(tier, tier_spec, keys, shape, dtype)
            assert tier.contains(keys) == [True] * 3, case
            assert tier.prefix_hits(keys) == 3, case
            for _ in range(2):
                get_checked(tier, keys, shape=shape, dtype=dtype)

    def test_stored_values_outlive_the_callers_objects(self, tier, tier_spec):
        """After ``put`` the caller releases its objects and the pool reuses that memory for
        other data: the values stored are unchanged."""
        keys = [key_of(f"outlive{i}") for i in range(4)]
        self.store(tier, tier_spec, keys)
        others = self.chunks(tier, tier_spec, [key_of(f"other{i}") for i in range(8)])
        try:
            get_checked(tier, keys)
        finally:
            release(others)

    def test_put_with_mismatched_lengths_is_refused(self, tier, tier_spec):
        """A caller's bug is a clear error before anything is stored, not a half-stored batch."""
        keys = [key_of("len0"), key_of("len1")]
        objs = self.chunks(tier, tier_spec, keys[:1])
        try:
            with pytest.raises(ValueError):
                tier.put(keys, objs)
        finally:
            release(objs)
        assert tier.contains(keys) == [False, False]

    def test_io_stays_inside_each_object(self, tier, tier_spec):
        """Writing a value out and reading it back into pool memory touches only that
        object's bytes: its neighbours in the pool (other chunks, other requests' data)
        keep theirs. Partial chunks (2560 B in 4 KiB blocks) are where padding could spill."""
        shape, dtype = (2, 2, 5, 64), torch.bfloat16
        key = key_of("inside")
        objs = self.chunks(tier, tier_spec, [key_of("left"), key, key_of("right")], shape, dtype)
        assert len(objs) == 3
        left, mid, right = objs
        try:
            assert tier.put([key], [mid]) == 1
            mid.release()
            got = tier.get([key])  # lands in the freed block where the pool reuses it
            try:
                check_hit(got[0], key, shape, dtype)
            finally:
                release(got)
            check_hit(left, key_of("left"), shape, dtype, read=False)
            check_hit(right, key_of("right"), shape, dtype, read=False)
        finally:
            release([left, right])

    def test_a_chunk_the_tier_cannot_represent_is_skipped(self, tier, tier_spec):
        """The one rule for shapes and dtypes (``lmc.storage.tier``: a chunk a tier cannot
        represent is skipped): a batch mixing chunks no ``lmc.storage.serde`` header describes (3-D,
        float64) with good ones raises nothing and stores the good ones; each odd one is
        either kept whole (L1 keeps any object) or a miss, and ``put`` counts only what it
        stored."""
        good = [key_of("odd-good0"), key_of("odd-good1")]
        odd = [(key_of("odd-3d"), (4, 16, 64), torch.float16),
               (key_of("odd-f64"), SHAPE, torch.float64)]
        objs = self.chunks(tier, tier_spec, good[:1])
        for k, shape, dtype in odd:
            objs += self.chunks(tier, tier_spec, [k], shape, dtype)
        objs += self.chunks(tier, tier_spec, good[1:])
        keys = [good[0], *(k for k, _, _ in odd), good[1]]
        assert len(objs) == len(keys), "the pool is too small for the test's chunks"
        try:
            stored = tier.put(keys, objs)
        finally:
            release(objs)
        present = tier.contains(keys)
        assert present[0] and present[-1], "a good chunk beside odd ones was not stored"
        assert stored == sum(present), f"put() said {stored}, {sum(present)} are present"
        got = tier.get(keys)
        try:
            check_hit(got[0], good[0])
            check_hit(got[-1], good[1])
            for (k, shape, dtype), o, here in zip(odd, got[1:-1], present[1:-1]):
                if not here:
                    assert o is None, f"{tuple(shape)} {dtype}: a miss in contains, a hit in get"
                    continue
                assert o is not None and (tuple(o.shape), o.dtype) == (shape, dtype)
                assert torch.equal(raw(o), stored_bytes(o, k)), f"{shape} {dtype}"
        finally:
            release(got)

    def test_declarations_match_the_tier(self, tier, tier_spec):
        """What a tier class declares (``lmc.storage.tier``) is well formed and true: a
        ``Medium`` and ``TierCapabilities``; memory is declared by the L1 tier alone (it keeps
        the caller's objects), and a tier declaring no layered reads never answers
        ``get_layers`` (callers trust the declaration to choose how to read)."""
        declared = getattr(tier, "medium", None)
        assert declared in set(Medium), f"{tier.name}: medium {declared!r} is not a Medium"
        caps = getattr(tier, "capabilities", None)
        assert isinstance(caps, TierCapabilities), \
            f"{tier.name}: capabilities {caps!r} is not a TierCapabilities"
        assert (tier_medium(tier) is Medium.MEMORY) == isinstance(tier, MemoryTier), \
            f"{tier.name}: declares {tier_medium(tier).value}, MemoryTier: " \
            f"{isinstance(tier, MemoryTier)}"
        if caps.layered_reads:
            return  # LayeredReadContract reads them
        key = key_of("declared")
        self.store(tier, tier_spec, [key])
        read = tier.get_layers([key])
        if read is not None:
            release(read.objs)
        assert read is None, f"{tier.name} declares no layered_reads, yet get_layers answered"
