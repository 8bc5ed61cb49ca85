"""Damaged values: a value failing a check is a miss and is deleted (``TierSpec.corrupt``
damages one out of band), and a keyed tier (``integrity_secret``) refuses what a writer
without the secret stored where it reads."""

from __future__ import annotations

import pytest

from lmc.testing.harness import (
    TierHarness,
    check_hit,
    key_of,
    release,
)


class IntegrityContract(TierHarness):
    """Damaged and unkeyed values are misses: tiers whose values leave the process."""

    def test_corrupted_value_is_a_miss_and_deleted(self, tier, tier_spec):
        if tier_spec.corrupt is None:
            pytest.skip(f"{tier_spec.spec}: the spec has no way to damage a stored value")
        bad, good = key_of("corrupt-bad"), key_of("corrupt-good")
        self.store(tier, tier_spec, [bad, good])
        tier_spec.corrupt(tier, bad)
        got = tier.get([bad, good])
        try:
            assert got[0] is None, "a damaged value was served"
            check_hit(got[1], good)
        finally:
            release(got)
        assert tier.contains([bad, good]) == [False, True], "the damaged value was not deleted"
        assert tier.get([bad]) == [None]
        self.store(tier, tier_spec, [bad])  # stored again: served again
        got = tier.get([bad])
        try:
            check_hit(got[0], bad)
        finally:
            release(got)

    def test_a_value_written_without_the_secret_is_a_miss(self, make_tier, tier_spec):
        """A keyed tier reads values a writer without the secret stored where it reads (an
        engine misconfigured, or anyone able to write there): misses, deleted or dropped so
        that a lookup no longer counts them; its own keyed stores are served as before."""
        if not tier_spec.settings().get("integrity_secret"):
            pytest.skip(f"{tier_spec.spec}: the spec sets no integrity_secret")
        keyed = make_tier()
        settings = tier_spec.writer_without_secret(keyed)
        if settings is None:
            pytest.skip(f"{tier_spec.spec}: no second writer over the same store")
        writer = make_tier(fresh_pool=True, **settings)
        keys = [key_of(f"unkeyed{i}") for i in range(3)]
        self.store(writer, tier_spec, keys)
        for _ in range(2):
            got = keyed.get(keys)
            try:
                assert got == [None] * 3, "a value written without the secret was served"
            finally:
                release(got)
        assert keyed.contains(keys) == [False] * 3, "the unkeyed values are still counted"
        self.store(keyed, tier_spec, keys[:1])
        got = keyed.get(keys[:1])
        try:
            check_hit(got[0], keys[0])
        finally:
            release(got)
