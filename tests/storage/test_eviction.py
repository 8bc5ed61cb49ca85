"""Eviction policy objects (lmc/storage/eviction.py) against a plain list-based reference model.

The model keeps the held keys in one Python list, first victim first: an insert appends, an
LRU access moves the key to the end, a FIFO access does nothing, a removal or an eviction
takes the key out. A hypothesis state machine runs random insert / access / touch / remove /
evict / pop sequences (absent and repeated keys included) on a policy and the model side by
side and, after every step, compares the victims' order, the values, ``entries``, ``len``
and membership.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmc.storage.eviction import (
    EvictionPolicy,
    FIFOPolicy,
    LRUPolicy,
    make_policy,
    policy_names,
    register_policy,
)

KEYS = st.integers(0, 11)  # a small key space: hits, repeats and absent keys all happen


class Model:
    """The reference: a list of keys in the policy's own order (recency or arrival), their
    values and retention priorities; victims are the list sorted by priority, stably."""

    def __init__(self, lru: bool) -> None:
        self.lru = lru
        self.stamps: list[int] = []
        self.values: dict[int, int] = {}
        self.prio: dict[int, int] = {}

    @property
    def order(self) -> list[int]:
        return sorted(self.stamps, key=lambda k: self.prio.get(k, 0))

    def set_priority(self, keys: list[int], priority: int) -> int:
        n = 0
        for k in keys:
            if k not in self.values:
                continue
            n += 1
            if self.prio.get(k, 0) != priority:  # a change starts the key afresh
                self.stamps.remove(k)
                self.stamps.append(k)
                self.prio[k] = priority
        return n

    def insert(self, key: int, value: int) -> None:
        self.stamps.append(key)
        self.values[key] = value

    def access(self, key: int) -> None:
        if self.lru:
            self.stamps.remove(key)
            self.stamps.append(key)

    def remove(self, key: int) -> int | None:
        if key not in self.values:
            return None
        self.stamps.remove(key)
        self.prio.pop(key, None)
        return self.values.pop(key)


def _machine(name: str) -> type[RuleBasedStateMachine]:
    class PolicyMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.policy = make_policy(name)
            self.model = Model(lru=name == "lru")
            self.seq = 0

        def _value(self) -> int:
            self.seq += 1
            return self.seq

        @rule(key=KEYS)
        def insert(self, key: int) -> None:
            if key in self.model.values:  # the contract: only new keys are inserted
                return
            v = self._value()
            self.policy.insert(key, v)
            self.model.insert(key, v)

        @rule(keys=st.lists(KEYS, max_size=6, unique=True))
        def insert_many(self, keys: list[int]) -> None:
            new = {k: self._value() for k in keys if k not in self.model.values}
            self.policy.insert_many(new)
            for k, v in new.items():
                self.model.insert(k, v)

        @precondition(lambda self: self.model.order)
        @rule(data=st.data())
        def access(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(self.model.order))
            self.policy.access(key)
            self.model.access(key)

        @rule(key=KEYS)
        def access_absent_is_refused(self, key: int) -> None:
            if key not in self.model.values:
                with pytest.raises(KeyError):
                    self.policy.access(key)

        @rule(keys=st.lists(KEYS, max_size=8))
        def touch_many(self, keys: list[int]) -> None:
            self.policy.touch_many(iter(keys))  # any iterable, consumed once
            for k in keys:
                if k in self.model.values:
                    self.model.access(k)

        @precondition(lambda self: self.model.order)
        @rule(data=st.data())
        def touch_held(self, data: st.DataObject) -> None:
            keys = data.draw(st.lists(st.sampled_from(self.model.order), max_size=8))
            self.policy.touch_held(keys)
            for k in keys:
                self.model.access(k)

        @rule(key=KEYS)
        def remove(self, key: int) -> None:
            assert self.policy.remove(key) == self.model.remove(key)

        @precondition(lambda self: self.model.order)
        @rule(data=st.data())
        def evict(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(self.model.order))
            assert self.policy.evict(key) == self.model.remove(key)

        @rule()
        def pop_victim(self) -> None:
            if not self.model.order:
                with pytest.raises(KeyError):
                    self.policy.pop_victim()
                return
            first = self.model.order[0]
            assert self.policy.pop_victim() == (first, self.model.remove(first))

        @rule(keys=st.lists(KEYS, max_size=5), priority=st.integers(-2, 2))
        def set_priority(self, keys: list[int], priority: int) -> None:
            assert self.policy.set_priority(keys, priority) == self.model.set_priority(
                keys, priority)

        @rule()
        def clear(self) -> None:
            entries = self.policy.entries
            self.policy.clear()
            assert self.policy.entries is entries  # tiers keep a reference to it
            self.model = Model(self.model.lru)

        @invariant()
        def same_as_the_model(self) -> None:
            m = self.model
            assert list(self.policy.victims()) == [(k, m.values[k]) for k in m.order]
            assert self.policy.keys_in_order() == m.order
            assert dict(self.policy.entries) == m.values
            assert len(self.policy) == len(m.order)
            for k in range(12):
                assert (k in self.policy) == (k in m.values)
                assert self.policy.priority_of(k) == m.prio.get(k, 0)

    PolicyMachine.__name__ = f"{name.upper()}Machine"
    return PolicyMachine


TestLRUAgainstTheModel = _machine("lru").TestCase
TestFIFOAgainstTheModel = _machine("fifo").TestCase
for _case in (TestLRUAgainstTheModel, TestFIFOAgainstTheModel):
    _case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_names_make_their_classes_and_an_unknown_name_is_refused_with_the_choices():
    assert policy_names()[:2] == ("lru", "fifo")
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("fifo"), FIFOPolicy)
    assert make_policy("lru") is not make_policy("lru")  # one fresh index per tier
    for bad in ("LRU", "arc", "", None, 3):
        with pytest.raises(ValueError, match=r"eviction_policy: .* choose one of lru, fifo"):
            make_policy(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already registered"):
        register_policy("lru", FIFOPolicy)
    assert isinstance(make_policy("lru"), LRUPolicy)  # the refused registration changed nothing


class CountingLFU(EvictionPolicy[int, int]):
    """A policy of another shape (least frequently used, oldest first among equals) built on
    the ABC's defaults (``evict``, ``pop_victim``, ``keys_in_order``): the interface is
    enough for a policy whose order is not an insertion list."""

    name = "lfu-test"

    def __init__(self) -> None:
        self._d: dict[int, int] = {}
        self._uses: dict[int, tuple[int, int]] = {}
        self._seq = 0

    @property
    def entries(self) -> Mapping[int, int]:
        return self._d

    def insert(self, key: int, value: int) -> None:
        self._seq += 1
        self._d[key] = value
        self._uses[key] = (0, self._seq)

    def insert_many(self, items: Mapping[int, int]) -> None:
        for k, v in items.items():
            self.insert(k, v)

    def access(self, key: int) -> None:
        n, seq = self._uses[key]
        self._uses[key] = (n + 1, seq)

    def touch_many(self, keys: Iterable[int]) -> None:
        for k in keys:
            if k in self._d:
                self.access(k)

    def remove(self, key: int) -> int | None:
        self._uses.pop(key, None)
        return self._d.pop(key, None)

    def victims(self) -> Iterator[tuple[int, int]]:
        for k in sorted(self._d, key=self._uses.__getitem__):
            yield k, self._d[k]

    def clear(self) -> None:
        self._d.clear()
        self._uses.clear()


def test_a_policy_of_another_shape_works_through_the_abc_defaults():
    p = CountingLFU()
    p.insert_many({1: 10, 2: 20, 3: 30})
    p.touch_many([3, 3, 1, 9])
    assert p.keys_in_order() == [2, 1, 3]
    assert p.pop_victim() == (2, 20)
    assert p.evict(1) == 10 and p.evict(1) is None
    assert (len(p), 3 in p, 2 in p) == (1, True, False)
    p.clear()
    with pytest.raises(KeyError):
        p.pop_victim()


@pytest.mark.parametrize("name", ["lru", "fifo"])
def test_a_new_key_takes_its_rank_from_arrival_before_it_can_be_a_victim(name):
    """``arrival`` (the storage manager's remembered priorities) ranks a key as it is
    inserted, one at a time or in a batch; keys it says nothing of start at 0."""
    p = make_policy(name)
    ranks = {"b": 5, "c": -1}
    p.arrival = ranks.get
    p.insert("a", 1)
    p.insert("b", 2)
    p.insert_many({"c": 3, "d": 4, "e": 5})
    assert p.keys_in_order() == ["c", "a", "d", "e", "b"]
    assert [p.priority_of(k) for k in "abcde"] == [0, 5, -1, 0, 0]
    p.arrival = None  # off again: a plain insert
    p.insert("f", 6)
    assert p.priority_of("f") == 0 and p.keys_in_order()[-2:] == ["f", "b"]


@pytest.mark.parametrize("name", ["lru", "fifo"])
def test_demote_makes_keys_the_first_victims_of_their_priority(name):
    """A lower tier's copy of a chunk promoted into L1 goes first among its equals."""
    p = make_policy(name)
    p.insert_many({k: 0 for k in "abcde"})
    p.set_priority(["d", "e"], 5)
    p.demote(["c", "e", "absent"])
    assert p.keys_in_order() == ["c", "a", "b", "e", "d"]
    assert p.priority_of("e") == 5 and len(p) == 5
