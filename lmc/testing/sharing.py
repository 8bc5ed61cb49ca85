"""A second tier over the same stored values (a restarted engine, another engine on the same
server) reads them back: for tiers whose values outlive the tier object (``TierSpec.reopen``)."""

from __future__ import annotations

import pytest
import torch

from lmc.testing.harness import (
    TierHarness,
    check_hit,
    key_of,
    release,
)


class SharedStoreContract(TierHarness):
    """Stored values outlive the tier object: tiers over a directory or a server."""

    def test_another_tier_over_the_same_store_serves_its_values(self, make_tier, tier_spec):
        """What one tier stored, a second one over the same backend (a restarted engine, or
        another engine sharing the server) reads back bit for bit."""
        if tier_spec.reopen is None:
            pytest.skip(f"{tier_spec.spec}: values live in the tier object itself")
        first = make_tier()
        keys = [key_of(f"reopen{i}") for i in range(4)]
        self.store(first, tier_spec, keys[:3], (2, 2, 5, 64), torch.bfloat16)
        settings = tier_spec.reopen(first)
        first.close()
        second = make_tier(fresh_pool=True, **settings)
        assert first.delete(keys[:1]) == 0, "a closed tier deleted from the store"
        assert second.contains(keys) == [True, True, True, False]
        got = second.get(keys)
        try:
            for k, o in zip(keys[:3], got):
                check_hit(o, k, (2, 2, 5, 64), torch.bfloat16)
            assert got[3] is None
        finally:
            release(got)
