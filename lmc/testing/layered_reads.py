"""Reads layer by layer (``get_layers``), for tiers declaring them
(``TierCapabilities.layered_reads``): every layer lands in order, each hit is one reference,
a damaged value never verifies, a read outlives its callers and the tier's ``close()``. For a
tier declaring none these tests skip, saying so (``BasicContract`` checks that such a tier
answers ``get_layers`` with ``None``)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import pytest

from lmc.storage.layered_read import LayerReadError
from lmc.storage.serde import CorruptValue
from lmc.storage.tier import Key, StorageBackend, tier_capabilities
from lmc.testing.harness import (
    ROUND_TRIPS,
    TierHarness,
    check_hit,
    key_of,
    release,
)


class LayeredReadContract(TierHarness):
    """``get_layers``: tiers that read layer by layer."""

    @staticmethod
    def layered(tier: StorageBackend, keys: Sequence[Key]):
        """``tier.get_layers(keys)``; the test skips for a tier declaring no layered reads.
        A tier declaring them may answer ``None`` when busy, but not here: an idle tier, its
        values just stored, room in its pool."""
        if not tier_capabilities(tier).layered_reads:
            pytest.skip(f"{tier.name}: declares no layered_reads (whole chunks only)")
        read = tier.get_layers(keys)
        assert read is not None, \
            f"{tier.name} declares layered_reads, yet get_layers answered None on an idle tier"
        assert len(read.objs) == len(keys), "one slot per key"
        return read

    def test_layered_read_is_bit_exact_and_one_reference_per_hit(self, tier, tier_spec):
        """Every layer lands in order, each hit holds one reference for the caller, a miss
        is ``None``; once verified the bytes are the stored ones (every round-trip shape)."""
        for shape, dtype in ROUND_TRIPS:
            case = f"{tuple(shape)} {dtype}"
            keys = [key_of(f"lay{i}{case}") for i in range(3)]
            self.store(tier, tier_spec, keys, shape, dtype)
            asked = [keys[0], key_of(f"lay-missing{case}"), keys[1], keys[2]]
            read = self.layered(tier, asked)
            try:
                assert read.objs[1] is None, case
                for layer in range(shape[0]):
                    read.wait_layer(layer, timeout=tier_spec.deadline + 10)
                read.wait_verified(timeout=tier_spec.deadline + 10)
                assert read.ok == [True, False, True, True], case
                read.wait_ended(timeout=tier_spec.deadline + 10)  # its own references gone
                for k, o in zip(asked[::2] + asked[3:], read.objs[::2] + read.objs[3:]):
                    check_hit(o, k, shape, dtype)
                    assert o.ref_count == 1, f"{case}: a hit holds {o.ref_count} references"
                # progress for a load watch (lmc.storage.layered_watch): every byte of every
                # hit was noted as it landed (a disk's aligned reads count what they moved:
                # more), a miss none; a read that notes nothing leaves the watch blind (no
                # rate, no landing: only its stall rule)
                sizes = [o.nbytes if o is not None else 0 for o in read.objs]
                noted = list(read.landed_bytes)
                assert all(n >= s and (n == 0) == (s == 0) for n, s in zip(noted, sizes)), \
                    f"{case}: progress noted {noted} bytes of {sizes}"
            finally:
                release(read.objs)
        assert self.used(tier) == 0, "the read kept pool memory after it ended"

    def test_layered_read_of_a_corrupted_value_never_verifies(self, tier, tier_spec):
        """A damaged value is a miss when opened or a read that does not verify; either way
        it is deleted, and the other values of the call verify."""
        if tier_spec.corrupt is None:
            pytest.skip(f"{tier_spec.spec}: the spec has no way to damage a stored value")
        bad, good = key_of("lay-corrupt-bad"), key_of("lay-corrupt-good")
        self.store(tier, tier_spec, [bad, good])
        tier_spec.corrupt(tier, bad)
        read = self.layered(tier, [bad, good])
        try:
            read.wait_verified([1], timeout=tier_spec.deadline + 10)
            check_hit(read.objs[1], good)
            if read.objs[0] is not None:
                with pytest.raises(CorruptValue):
                    read.wait_verified([0])
            assert read.ok is not None and not read.ok[0], "a damaged value verified"
        finally:
            release(read.objs)
        assert tier.contains([bad, good]) == [False, True], "the damaged value was not deleted"

    def test_layered_read_outlives_its_callers_and_a_close(self, make_tier, tier_spec):
        """The caller drops its objects at once and the tier closes while the read may still
        be filling them: nothing leaks (make_tier checks the pool after close), no error."""
        tier = make_tier()
        keys = [key_of(f"lay-close{i}") for i in range(16)]
        self.store(tier, tier_spec, keys)
        read = self.layered(tier, keys)
        release(read.objs)
        tier.close()
        with contextlib.suppress(LayerReadError, CorruptValue):
            read.wait_verified(timeout=tier_spec.deadline + 10)
        assert read.done, "a read still running after close()"
