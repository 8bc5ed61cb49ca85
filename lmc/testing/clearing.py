"""Clearing a namespace (``StorageBackend.clear_namespace``): every value of the tier's own
namespace goes, or only those under a key prefix, and nothing of another tenant's; a dead
backend clears nothing within the deadline, never raising. A tier that cannot clear
(``NotImplementedError``) skips these tests, saying so."""

from __future__ import annotations

import time

import pytest

from lmc.storage.tier import StorageBackend
from lmc.testing.harness import TierHarness, get_checked, key_of


def _clear(tier: StorageBackend, prefix: bytes = b"") -> list[bytes] | None:
    try:
        return tier.clear_namespace(prefix)
    except NotImplementedError as e:
        pytest.skip(f"{tier.name}: {e}")


class ClearContract(TierHarness):
    """``clear_namespace``: all of the namespace, a prefix of it, never another tenant's."""

    def test_clear_removes_every_value_of_the_namespace(self, make_tier, tier_spec):
        """After a clear, every key stored before misses; the answer lists them (or is
        ``None``: the tier cannot list); storing again works; no pool memory is kept."""
        tier = make_tier()
        keys = [key_of(f"clear{i}") for i in range(6)]
        self.store(tier, tier_spec, keys)
        got = _clear(tier)
        if got is not None:
            assert sorted(got) == sorted(keys), "the clear listed other keys than it held"
        assert tier.contains(keys) == [False] * 6, "a value outlived the clear"
        assert get_checked(tier, keys, misses=True) == 0
        self.store(tier, tier_spec, keys[:2])
        assert get_checked(tier, keys[:2]) == 2

    def test_a_prefix_clears_only_its_keys(self, make_tier, tier_spec):
        """``clear_namespace(prefix)``: keys starting with it go, the rest stay (a tier that
        clears only whole namespaces raises ``NotImplementedError`` for a prefix)."""
        tier = make_tier()
        doomed = [b"\x01\x02" + key_of(f"p{i}")[2:] for i in range(3)]
        kept = [b"\x01\x03" + key_of(f"q{i}")[2:] for i in range(3)]
        self.store(tier, tier_spec, doomed + kept)
        got = _clear(tier, b"\x01\x02")
        if got is not None:
            assert sorted(got) == sorted(doomed)
        assert tier.contains(doomed + kept) == [False] * 3 + [True] * 3
        assert get_checked(tier, kept) == 3

    def test_a_clear_leaves_other_tenants_values(self, make_tier, tier_spec):
        """Another tenant's values over the same backend survive this tier's clear."""
        if tier_spec.other_tenants is None:
            pytest.skip(f"{tier_spec.spec}: the spec names no other tenant")
        mine = make_tier()
        keys = [key_of(f"ctenant{i}") for i in range(3)]
        theirs = [make_tier(fresh_pool=True, **s) for s in tier_spec.other_tenants(mine)]
        for t in theirs:
            self.store(t, tier_spec, keys)
        self.store(mine, tier_spec, keys)
        _clear(mine)
        assert mine.contains(keys) == [False] * 3
        for n, t in enumerate(theirs):
            assert get_checked(t, keys, misses=True) in (0, 3)
            present = t.contains(keys)
            if any(present):  # a token granting nothing stores nothing: no claim then
                assert present == [True] * 3, f"tenant {n} lost values to another's clear"

    def test_a_dead_backend_clears_nothing_within_the_deadline(self, make_tier, tier_spec):
        """Killed: the clear answers within a few ``TierSpec.deadline``s, never raising, and
        lists nothing it did not have (a removed directory's index may still be dropped)."""
        if tier_spec.kill is None:
            pytest.skip(f"{tier_spec.spec}: the spec cannot kill its backend")
        tier = make_tier()
        self.store(tier, tier_spec, [key_of("dead-clear")])
        tier_spec.kill(tier)
        try:
            t0 = time.monotonic()
            got = _clear(tier)
            took = time.monotonic() - t0
            assert took <= 3 * tier_spec.deadline, \
                f"clear_namespace() on a dead backend took {took:.1f} s"
            assert not got or got == [key_of("dead-clear")], got
        finally:
            if tier_spec.revive is not None:
                tier_spec.revive(tier)
