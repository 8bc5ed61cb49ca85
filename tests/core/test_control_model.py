"""Cache control against a plain model (hypothesis stateful): random stores, uses, pins with
TTLs, priorities, unpins, deletes, clears and a clock moved by hand, over an L1 of a few
chunks so every store past the first few evicts. The model is a dict of chunks with their
priority and recency and a dict of pins with their deadlines; after every step the engine
must hold exactly the model's chunks and pins:

* a pinned chunk is never evicted before its TTL, and after it is an ordinary chunk;
* eviction takes the lowest priority first, the least recently used first within one;
* a pin past the bound is refused (``PinLimitError``) and changes nothing;
* a priority is remembered for the prompt (held or not, evicted or not: the storage
  manager's ``Sticky``) until set to 0, deleted or cleared; a chunk stored takes it;
* delete removes a chunk and its pins; clear removes everything and every pin."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lmc import CacheConfig, CacheEngine
from lmc.storage.control import PinLimitError
from tests.kvutil import make_caches, random_tokens, spec_for

CHUNK = 16
LAYOUT = "vllm_flash"
GEOM = dict(layers=2, heads=2, dim=64, blocks=64, block_size=4)
SLOTS_IN_POOL = 4
MAX_PINS = 2
PROMPTS = [random_tokens(CHUNK, 1000 + i) for i in range(7)]  # one chunk each
P = st.integers(0, len(PROMPTS) - 1)


class ControlMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.src = make_caches(LAYOUT, **GEOM)
        self.dst = make_caches(LAYOUT, **GEOM, zeros=True)
        spec = spec_for(LAYOUT, self.src)
        cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size=SLOTS_IN_POOL * spec.chunk_nbytes(CHUNK),
                          local_cpu_prefault="off", pin_memory="false", max_ttl_pins=MAX_PINS,
                          max_pin_ttl="100s")
        self.eng = CacheEngine(cfg, spec, model_id="control-model")
        self.now = 0.0
        self.eng.control.pins.clock = lambda: self.now
        self.stamp = 0
        self.held: dict[int, list[int]] = {}  # prompt -> [priority, recency stamp]
        self.pins: dict[int, float] = {}  # prompt -> deadline
        self.remembered: dict[int, int] = {}  # prompt -> priority set (not 0)

    def teardown(self) -> None:
        self.eng.close()

    # ------------------------------------------------------------ the model
    def _use(self, p: int) -> None:
        self.stamp += 1
        self.held[p][1] = self.stamp

    def _expire(self) -> None:
        """What the engine's next call does first: pins past their deadline go."""
        for p in [p for p, d in self.pins.items() if d <= self.now]:
            del self.pins[p]

    def _victim(self) -> int | None:
        free = [p for p in self.held if p not in self.pins]
        return min(free, key=lambda p: tuple(self.held[p])) if free else None

    # ------------------------------------------------------------ rules
    @rule(p=P)
    def store(self, p: int) -> None:
        self._expire()
        n = self.eng.store(PROMPTS[p], self.src, torch.arange(CHUNK))
        if p in self.held:
            assert n == 0
            self._use(p)
            return
        if len(self.held) >= SLOTS_IN_POOL:
            v = self._victim()
            if v is None:
                assert n == 0, "stored with every slot pinned"
                return
            del self.held[v]
        assert n == CHUNK
        self.held[p] = [self.remembered.get(p, 0), 0]
        self._use(p)

    @rule(p=P)
    def retrieve(self, p: int) -> None:
        self._expire()
        got = self.eng.retrieve(PROMPTS[p], self.dst, torch.arange(CHUNK, 2 * CHUNK))
        assert got == (CHUNK if p in self.held else 0)
        if p in self.held:
            self._use(p)

    @rule(p=P, ttl=st.sampled_from([1.0, 5.0, 20.0]))
    def pin(self, p: int, ttl: float) -> None:
        self._expire()
        others = sum(1 for q in self.pins if q != p)
        if p in self.held and others + 1 > MAX_PINS:
            with pytest.raises(PinLimitError):
                self.eng.pin(PROMPTS[p], ttl)
            self._use(p)  # the read of the chunk happened before the refusal
            return
        got = self.eng.pin(PROMPTS[p], ttl)
        if p in self.held:
            assert got == CHUNK
            self._use(p)
            self.pins[p] = self.now + ttl
        else:
            assert got == 0
            self.pins.pop(p, None)

    @rule(p=P, priority=st.integers(-2, 2))
    def set_priority(self, p: int, priority: int) -> None:
        self._expire()
        assert self.eng.set_priority(PROMPTS[p], priority) == (p in self.held)
        if priority:
            self.remembered[p] = priority
        else:
            self.remembered.pop(p, None)
        if p in self.held and self.held[p][0] != priority:
            self.held[p][0] = priority
            self._use(p)  # a change of priority is a fresh start in its level

    @rule(p=P)
    def unpin(self, p: int) -> None:
        self._expire()
        assert self.eng.unpin(PROMPTS[p]) == (1 if p in self.pins else 0)
        self.pins.pop(p, None)

    @rule(p=P)
    def delete(self, p: int) -> None:
        self._expire()
        assert self.eng.delete(PROMPTS[p]) == (1 if p in self.held else 0)
        self.held.pop(p, None)
        self.pins.pop(p, None)
        self.remembered.pop(p, None)

    @rule()
    def clear(self) -> None:
        self._expire()
        assert self.eng.clear() == {"cpu": len(self.held)}
        self.held.clear()
        self.pins.clear()
        self.remembered.clear()

    @rule(dt=st.sampled_from([0.5, 2.0, 10.0]))
    def wait(self, dt: float) -> None:
        self.now += dt

    # ------------------------------------------------------------ checks
    @invariant()
    def same_as_the_model(self) -> None:
        present = {p for p in range(len(PROMPTS))
                   if self.eng.storage.l1.contains(self.eng.db.keys(PROMPTS[p]))[0]}
        assert present == set(self.held)
        l1 = self.eng.storage.l1
        for p in self.held:
            assert l1.priority_of(self.eng.db.keys(PROMPTS[p])[0]) == self.held[p][0]
        live = {p for p, d in self.pins.items() if d > self.now}
        assert self.eng.stats()["ttl_pinned_chunks"] >= len(live)  # expired: released lazily
        assert self.eng.stats()["ttl_pinned_chunks"] <= len(self.pins)


TestControlAgainstTheModel = ControlMachine.TestCase
TestControlAgainstTheModel.settings = settings(max_examples=80, stateful_step_count=40,
                                               deadline=None)
