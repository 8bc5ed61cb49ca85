"""A failing backend: dead (``TierSpec.kill``) or hung (``TierSpec.hang``), every call returns
misses within ``TierSpec.deadline``, never an exception or a hang, and the tier serves again
once the backend is back (``revive``/``unhang``); ``close()`` never waits for a hung backend."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from lmc.storage.tier import Key, StorageBackend
from lmc.testing.harness import (
    TierHarness,
    TierSpec,
    Timed,
    check_hit,
    key_of,
    release,
)


class FailureContract(TierHarness):
    """A dead or hung backend is a miss within the deadline: tiers over a process or a device."""

    def _misses_within_deadline(self, tier: StorageBackend, spec: TierSpec,
                                keys: Sequence[Key]) -> None:
        """Every call on a dead backend returns, in time, without raising; reads are
        misses. Several rounds: the first calls meet the failure, later ones a breaker."""
        timed = Timed()
        for i in range(4):
            assert timed("get", tier.get, keys) == [None] * len(keys)
            assert len(timed("contains", tier.contains, keys)) == len(keys)
            assert timed("prefix_hits", tier.prefix_hits, keys) in range(len(keys) + 1)
            objs = self.chunks(tier, spec, [key_of(f"dead-put{i}")])
            try:
                n = timed("put", tier.put, [key_of(f"dead-put{i}")], objs)
                assert n in (0, 1)
            finally:
                release(objs)
            assert timed("delete", tier.delete, keys[:1]) in (0, 1)
        took, what = timed.slowest
        assert took <= spec.deadline, \
            f"{what} on a dead backend took {took:.2f} s (deadline {spec.deadline} s)"

    def _serves_again(self, tier: StorageBackend, spec: TierSpec, within: float = 20.0) -> None:
        key = key_of("back")
        deadline = time.monotonic() + within
        while True:
            objs = self.chunks(tier, spec, [key])
            try:
                tier.put([key], objs)
            finally:
                release(objs)
            got = tier.get([key])
            if got[0] is not None:
                try:
                    check_hit(got[0], key)
                finally:
                    release(got)
                return
            assert time.monotonic() < deadline, f"the tier did not come back in {within} s"
            time.sleep(0.1)

    def _fault(self, tier, tier_spec, name, cause, undo) -> None:
        """Store, break the backend with ``cause``, and expect misses within the deadline;
        ``undo`` (if any) repairs it whatever happened."""
        keys = [key_of(f"{name}{i}") for i in range(8)]
        self.store(tier, tier_spec, keys)
        cause(tier)
        try:
            self._misses_within_deadline(tier, tier_spec, keys)
        finally:
            if undo is not None:
                undo(tier)

    def test_dead_backend_answers_misses_within_a_deadline(self, tier, tier_spec):
        if tier_spec.kill is None:
            pytest.skip(f"{tier_spec.spec}: the spec has no way to kill its backend")
        self._fault(tier, tier_spec, "dead", tier_spec.kill, tier_spec.revive)
        if tier_spec.revive is not None:
            self._serves_again(tier, tier_spec)

    def test_hung_backend_answers_misses_within_a_deadline(self, tier, tier_spec):
        if tier_spec.hang is None:
            pytest.skip(f"{tier_spec.spec}: the spec has no way to make its backend stop answering")
        self._fault(tier, tier_spec, "hung", tier_spec.hang, tier_spec.unhang)
        self._serves_again(tier, tier_spec)

    def test_close_while_the_backend_hangs(self, tier, tier_spec):
        """``close()`` with a read stuck on a backend that stopped answering: both return
        within the deadline (the read with misses), neither waits for the backend."""
        if tier_spec.hang is None:
            pytest.skip(f"{tier_spec.spec}: the spec has no way to make its backend stop "
                        f"answering")
        keys = [key_of(f"hang-close{i}") for i in range(8)]
        self.store(tier, tier_spec, keys)
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.append(tier.get(keys)), daemon=True)
        tier_spec.hang(tier)
        try:
            reader.start()
            time.sleep(0.2)  # the read is waiting on the backend
            t0 = time.monotonic()
            tier.close()
            took = time.monotonic() - t0
            reader.join(tier_spec.deadline)
            assert not reader.is_alive(), "a read stuck on a hung backend outlived close()"
        finally:
            if tier_spec.unhang is not None:
                tier_spec.unhang(tier)
        assert took <= tier_spec.deadline, f"close() took {took:.2f} s on a hung backend"
        assert got and got[0] == [None] * len(keys)
