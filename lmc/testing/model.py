"""A tier against a model: random sequences of batched calls (hypothesis draws and shrinks
them), each answer checked against what a set of stored keys allows.

A tier may drop any value at any time (eviction, a full disk), so the model is not "what was
stored is there" but its safe half: a key never stored, or deleted since, is a miss
everywhere (``get``, ``contains``, ``prefix_hits``, ``delete`` counts none); a hit is always
the exact bytes, shape and dtype stored (values are a function of the key, so any hit can be
checked); ``put`` counts at most its batch. Batches repeat keys and mix shapes and dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmc.storage.tier import StorageBackend
from lmc.testing.harness import ROUND_TRIPS, TierHarness, TierSpec, check_hit, key_of, release

KEYS = 8       # names per example: small, so batches collide and repeat
EXAMPLES = 30  # sequences per tier (a few seconds on a remote tier)
OPS = ("put", "get", "contains", "prefix_hits", "delete")

_ops = st.lists(st.tuples(st.sampled_from(OPS),
                          st.lists(st.integers(0, KEYS - 1), min_size=0, max_size=6)),
                min_size=1, max_size=16)


def _shape(i: int) -> tuple[Sequence[int], Any]:
    return ROUND_TRIPS[i % len(ROUND_TRIPS)]


class _Run:
    """One sequence over keys of its own (so examples share a tier, never a key)."""

    def __init__(self, harness: TierHarness, tier: StorageBackend, spec: TierSpec,
                 example: int) -> None:
        self.h, self.tier, self.spec = harness, tier, spec
        self.keys = [key_of(f"model{example}-{i}") for i in range(KEYS)]
        self.maybe: set[int] = set()  # stored and not deleted since: a hit is allowed

    def put(self, idx: list[int]) -> None:
        stored = 0
        for i in idx:  # one call per shape: a batch of one geometry, as an engine stores
            objs = self.h.chunks(self.tier, self.spec, [self.keys[i]], *_shape(i))
            try:
                stored += self.tier.put([self.keys[i]][: len(objs)], objs)
            finally:
                release(objs)
            self.maybe.add(i)
        assert 0 <= stored <= len(idx), f"put of {len(idx)} counted {stored}"

    def get(self, idx: list[int]) -> None:
        got = self.tier.get([self.keys[i] for i in idx])
        try:
            assert len(got) == len(idx), f"get of {len(idx)} keys answered {len(got)}"
            for i, o in zip(idx, got):
                if o is not None:
                    assert i in self.maybe, f"key {i} hit, but it was never stored or deleted"
                    check_hit(o, self.keys[i], *_shape(i))
        finally:
            release(got)

    def contains(self, idx: list[int]) -> None:
        present = self.tier.contains([self.keys[i] for i in idx])
        assert len(present) == len(idx)
        for i, here in zip(idx, present):
            assert not here or i in self.maybe, f"contains says key {i} is present: it is not"

    def prefix_hits(self, idx: list[int]) -> None:
        n = self.tier.prefix_hits([self.keys[i] for i in idx])
        allowed = next((at for at, i in enumerate(idx) if i not in self.maybe), len(idx))
        assert 0 <= n <= allowed, f"prefix_hits {n} of {idx}; at most {allowed} may be present"

    def delete(self, idx: list[int]) -> None:
        n = self.tier.delete([self.keys[i] for i in idx])
        allowed = len(set(idx) & self.maybe)
        assert 0 <= n <= allowed, f"delete of {idx} counted {n}; at most {allowed} were present"
        self.maybe -= set(idx)


class ModelContract(TierHarness):
    """Random call sequences answered as the model allows: every tier passes these."""

    def test_call_sequences_match_the_model(self, tier, tier_spec):
        examples = iter(range(1 << 30))

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_ops)
        def run(ops: list[tuple[str, list[int]]]) -> None:
            model = _Run(self, tier, tier_spec, next(examples))
            for op, idx in ops:
                getattr(model, op)(idx)

        run()  # the harness then checks the tier gives all its pool memory back at close()
