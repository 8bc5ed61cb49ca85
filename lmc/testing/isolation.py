"""Tenants: tiers of other tenants over the same backend (``TierSpec.other_tenants``: another
namespace or key prefix, another token) neither see a tier's values nor change them."""

from __future__ import annotations

import pytest
import torch

from lmc.testing.harness import (
    SHAPE,
    TierHarness,
    check_hit,
    fill,
    key_of,
    release,
)


class IsolationContract(TierHarness):
    """Other tenants neither see nor change a tier's values: shared backends."""

    def test_another_tenant_never_sees_or_changes_the_values(self, make_tier, tier_spec):
        """Tiers of other tenants over the same backend: each misses every value of this
        tier (get, contains, prefix_hits), deletes none, and what it stores under the same
        keys (other bytes) is never what this tier reads back."""
        if tier_spec.other_tenants is None:
            pytest.skip(f"{tier_spec.spec}: the spec names no other tenant")
        mine = make_tier()
        keys = [key_of(f"tenant{i}") for i in range(4)]
        self.store(mine, tier_spec, keys[:3])
        for n, settings in enumerate(tier_spec.other_tenants(mine)):
            theirs = make_tier(fresh_pool=True, **settings)
            assert theirs.contains(keys) == [False] * 4, f"tenant {n} sees the values"
            assert theirs.prefix_hits(keys) == 0, f"tenant {n} counts the values"
            got = theirs.get(keys)
            try:
                assert got == [None] * 4, f"tenant {n} read the values"
            finally:
                release(got)
            assert theirs.delete(keys) == 0, f"tenant {n} deleted the values"
            other = key_of(f"tenant-bytes{n}")
            objs = [fill(o, other) for o in theirs.pool.allocate_many(
                SHAPE, torch.float16, 1, SHAPE[2])]
            try:
                theirs.put(keys[:1], objs)
            finally:
                release(objs)
            got = theirs.get(keys[:1])
            try:  # their own value, or a miss (a token granting nothing): never ours
                if got[0] is not None:
                    check_hit(got[0], other)
            finally:
                release(got)
        got = mine.get(keys)
        try:
            missed = [k.hex()[:12] for k, o in zip(keys[:3], got) if o is None]
            assert not missed, (f"this tier missed its own values {missed} after the other "
                                f"tenants ran; its stats: {_stats(mine)}")
            for k, o in zip(keys[:3], got):
                check_hit(o, k)
            assert got[3] is None
        finally:
            release(got)


def _stats(tier: object) -> dict:
    """The tier's counters, for a failure message (a tier without them says so)."""
    try:
        return tier.stats()  # type: ignore[attr-defined]
    except Exception as e:  # the message must not fail
        return {"stats": repr(e)}
