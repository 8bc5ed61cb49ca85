"""The engine state machine the model-based tests run over each tier set-up.

Random store / lookup (with pins) / unpin / retrieve (masks, partial prompts, shared prefixes,
unmapped slots) / eviction pressure / close-reopen over a tiny pool, checked after every step:

* every retrieve wrote exactly the KV of the tokens it reports, at the slots asked, and not one
  other word of the cache (the KV is a function of the token prefix: see ``model_kv``);
* a hit only covers chunks that were stored (no phantom hits);
* a miss only where the engine reports a reason: a pinned chunk never misses; a stored chunk
  misses only after an eviction or a skipped store (L1 alone), or after a dropped write or a
  tier error (with a persistent lower tier, which keeps chunks across restarts);
* with L1 alone, lookup and retrieve answer exactly the longest present prefix, and ``store``
  returns exactly the tokens of the chunks it added;
* pins and pool memory balance: ``pinned_chunks`` equals the model's count and a closed engine
  leaves no pool memory referenced.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Hashable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmc.layerwise import LoadError
from tests.core.model_kv import (
    CHUNK,
    GEOMETRIES,
    NUM_BASES,
    Backend,
    PagedCache,
    chunk_ends,
    excuses,
    fresh_prompt,
    make_engine,
    mask_for,
    prompt,
    rmtree,
    slots_for,
    tempdir,
)
from tests.deadlines import HANG_S

Prefix = tuple[int, ...]

PROMPTS = st.tuples(st.integers(0, NUM_BASES - 1), st.integers(1, 6 * CHUNK),
                    st.none() | st.integers(0, 6 * CHUNK - 1))
RIDS = st.none() | st.integers(0, 2)  # pin owners: the prompt itself, or a request id
SLOTS = st.tuples(st.integers(0, 1 << 30), st.booleans(), st.sampled_from([0, 0, 0, 1, 3]))


def _keys(tokens: list[int]) -> list[Prefix]:
    """A chunk's identity is its whole token prefix (its key chains through all of it)."""
    return [tuple(tokens[:e]) for e in chunk_ends(len(tokens))]


def _lead(flags: list[bool], start: int = 0) -> int:
    n = start
    while n < len(flags) and flags[n]:
        n += 1
    return n - start


class EngineMachine(RuleBasedStateMachine):
    """One engine over ``backend``; see the module docstring for what is checked."""

    def __init__(self, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self.persistent = backend.persistent
        self.eng = None
        self.workdir = tempdir(backend.name)
        self.tenant = uuid.uuid4().hex[:12]
        self.known: set[Prefix] = set()
        self.guaranteed: dict[Prefix, float] = {}
        self.pins: dict[Hashable, list[Prefix]] = {}  # owner -> the chunks it pinned
        self.serial = 0
        self.steps = 0

    # ---------------------------------------------------------------- helpers
    def _open(self) -> None:
        self.eng = make_engine(self.cache, self.pool_bytes, self.backend.extra(self.workdir),
                               self.tenant, self.max_pins)

    def _present(self, tokens: list[int]) -> list[bool]:
        return [bool(x) for x in self.eng.contains_chunks(tokens)]

    def _stats(self) -> dict:
        return self.eng.stats()

    def _excuse(self, stats: dict | None = None) -> float:
        return excuses(stats if stats is not None else self._stats(), self.persistent)

    def _pinned(self) -> set[Prefix]:
        return {k for keys in self.pins.values() for k in keys}

    def _must_hit(self, key: Prefix, exc: float, l1: bool, pinned: set[Prefix]) -> bool:
        if l1 and key in pinned:
            return True
        return self.guaranteed.get(key) == exc

    @staticmethod
    def _owner(tokens: list[int], rid: int | None) -> Hashable:
        """Whose pins: the request id when one is given, else the exact prompt."""
        return ("request", rid) if rid is not None else ("prompt", tuple(tokens))

    def _check_hit(self, tokens: list[int], start: int, got: int, l1: list[bool],
                   what: str) -> None:
        """``got`` tokens from chunk ``start`` on: whole chunks (or the prompt's end), all
        stored before, and at least every chunk the model says must be there."""
        n = len(tokens)
        end = start * CHUNK + got
        assert got >= 0 and end <= n, f"{what}: {got} tokens from chunk {start} of {n}"
        assert end == n or end % CHUNK == 0, f"{what}: ends mid-chunk at {end} of {n}"
        keys = _keys(tokens)
        hit_chunks = -(-end // CHUNK) - start
        for j in range(start, start + hit_chunks):
            assert keys[j] in self.known, f"{what}: chunk {j} hit but was never stored"
        exc = self._excuse()
        pinned = self._pinned()
        must = 0
        for j in range(start, len(keys)):
            if not self._must_hit(keys[j], exc, l1[j], pinned):
                break
            must += 1
        assert hit_chunks >= must, (
            f"{what}: {hit_chunks} chunk(s) hit from chunk {start}, but {must} were stored "
            f"(or pinned) with no eviction, dropped write or error since")

    # ------------------------------------------------------------------ rules
    @initialize(geom=st.sampled_from(sorted(GEOMETRIES)), pool_units=st.integers(8, 40),
                seed=st.integers(0, 1 << 16), max_pins=st.sampled_from([2, 5, 4096]))
    def start(self, geom, pool_units, seed, max_pins):
        self.pool_bytes = pool_units * 4096
        self.max_pins = max_pins
        self.cache = PagedCache(GEOMETRIES[geom], seed)
        self._open()

    def _store(self, tokens: list[int], masked: int, slot_args) -> None:
        n = len(tokens)
        masked = min(masked, (n - 1) // CHUNK)
        mask = mask_for(n, masked)
        slots = slots_for(n, *slot_args)
        self.cache.write(tokens, slots)
        # a load that stopped itself left pieces in flight that put their chunks in L1 when
        # they land: let them land first, or they would count as this store's
        assert self.eng.wait_reads(HANG_S), "a stopped load's pieces never landed"
        before = self._present(tokens)
        stats0 = self._stats()
        l1_exc0 = excuses(stats0, False)
        got = self.eng.store(tokens, self.cache.caches, slots, mask)
        stats = self._stats()
        after = self._present(tokens)
        l1_exc1 = excuses(stats, False)
        # L1 alone: what the store itself evicted is not an excuse for its own new chunks. A
        # lower tier: a write dropped during this store may be one of these chunks' own.
        exc = self._excuse(stats0) if self.persistent else self._excuse(stats)
        keys = _keys(tokens)
        ends = chunk_ends(n)
        added = 0
        for j in range(masked, len(keys)):
            s, e = j * CHUNK, ends[j]
            if after[j] and not before[j]:
                added += e - s
                self.known.add(keys[j])
                self.guaranteed[keys[j]] = exc
            elif after[j]:
                self.known.add(keys[j])
            elif bool((slots[s:e] >= 0).all()):
                assert l1_exc1 > l1_exc0, (
                    f"store: chunk {j} of {n} tokens is absent after the store, with no "
                    f"eviction or pool-full skip reported")
        for j in range(masked):
            assert after[j] == before[j] or (before[j] and l1_exc1 > l1_exc0), (
                f"store under a mask changed masked chunk {j}")
        # wait_reads left nothing landing: a lower tier's promotion meanwhile is a bug (a
        # layered read's once was), named by its count
        promoted = sum(v - stats0.get(k, 0) for k, v in stats.items()
                       if k.endswith(".promoted") and isinstance(v, (int, float)))
        assert got == added, (
            f"store returned {got} tokens; chunks it added hold {added} (lower tiers promoted "
            f"{promoted} chunk(s) into L1 meanwhile)")

    @rule(p=PROMPTS, masked=st.sampled_from([0, 0, 1, 2]), slot_args=SLOTS)
    def store(self, p, masked, slot_args):
        self._store(prompt(*p), masked, slot_args)

    @rule(count=st.integers(1, 3), length=st.integers(CHUNK, 5 * CHUNK), seed=st.integers(0, 99))
    def pressure(self, count, length, seed):
        """Fresh prompts sharing nothing: the pool must evict to take them."""
        for _ in range(count):
            self.serial += 1
            self._store(fresh_prompt(self.serial, length), 0, (seed + self.serial, True, 0))

    @rule(p=PROMPTS, pin=st.booleans(), rid=RIDS)
    def lookup(self, p, pin, rid):
        tokens = prompt(*p)
        l1 = self._present(tokens)
        got = self.eng.lookup(tokens, pin=pin, request_id=rid)
        self._check_hit(tokens, 0, got, l1, "lookup")
        if not self.persistent:
            assert got == min(_lead(l1) * CHUNK, len(tokens)), "lookup != present prefix"
        if pin:  # replaces the owner's pins; past the bound, leading chunks that fit
            owner = self._owner(tokens, rid)
            self.pins.pop(owner, None)
            room = max(0, self.max_pins - sum(len(v) for v in self.pins.values()))
            keys = [k for j, k in enumerate(_keys(tokens)[: -(-got // CHUNK)]) if l1[j]]
            if keys[:room]:
                self.pins[owner] = keys[:room]

    @rule(p=PROMPTS, rid=RIDS)
    def unpin(self, p, rid):
        tokens = prompt(*p)
        want = len(self.pins.pop(self._owner(tokens, rid), []))
        got = self.eng.unpin(tokens, request_id=rid)
        assert got == want, f"unpin released {got} pins, the owner held {want}"

    def _retrieve_layerwise(self, tokens, slots, mask, rid) -> int:
        """``retrieve_layer``, every layer in order (lower-tier hits arrive layer by layer:
        :mod:`lmc.storage.layered_read`). A load that failed (``LoadError``: a chunk did not verify
        or its read failed) reports 0 tokens and must be one the tiers counted; the engine
        would recompute, so its partly written blocks are put back for the model."""
        snap = self.cache.snapshot()
        exc = self._excuse()
        rt = self.eng.retrieve_layer(tokens, self.cache.caches, slots, mask, request_id=rid)
        failed = None
        try:
            for layer in range(self.eng.spec.num_layers):
                rt.load(layer)
        except LoadError as e:
            failed = e
        finally:
            got = rt.close()
        if failed is not None:
            assert got == 0, f"a failed layer-wise load reported {got} tokens"
            assert self._excuse() > exc, f"layer-wise load failed uncounted: {failed}"
            self.cache.words.copy_(snap)  # (the cache tensors are views of these words)
        return got

    @rule(p=PROMPTS, masked=st.sampled_from([0, 0, 1, 2]), slot_args=SLOTS, rid=RIDS,
          layerwise=st.booleans())
    def retrieve(self, p, masked, slot_args, rid, layerwise=False):
        tokens = prompt(*p)
        n = len(tokens)
        masked = min(masked, (n - 1) // CHUNK)
        slots = slots_for(n, *slot_args)
        l1 = self._present(tokens)
        snap = self.cache.snapshot()
        if layerwise:
            got = self._retrieve_layerwise(tokens, slots, mask_for(n, masked), rid)
        else:
            got = self.eng.retrieve(tokens, self.cache.caches, slots, mask_for(n, masked),
                                    request_id=rid)
        start = masked * CHUNK
        self.cache.check_retrieved(snap, tokens, slots, start, start + got,
                                   f"retrieve (mask {masked} chunks)")
        self._check_hit(tokens, masked, got, l1, "retrieve")
        if not self.persistent:
            want = min(_lead(l1, masked) * CHUNK, n - start)
            assert got == want, f"retrieve wrote {got} tokens, {want} present"
        self.pins.pop(self._owner(tokens, rid), None)  # a retrieve ends its owner's pins

    @rule(seed=st.integers(0, 1 << 32), ops=st.integers(1, 150))
    def burst(self, seed, ops):
        """``ops`` seeded random steps (the rules above, checked the same way after each): a
        long plain workload, which fragments the pool in ways short shrunk examples do not
        reach. A failure names the seed and lists the steps, ready to become a regression."""
        r = random.Random(seed)
        trace: list[str] = []
        for _ in range(ops):
            p = (r.randrange(NUM_BASES), r.randint(1, 6 * CHUNK),
                 None if r.random() < 0.7 else r.randrange(6 * CHUNK))
            sa = (r.randrange(1 << 30), r.random() < 0.5, r.choice([0, 0, 0, 1, 3]))
            rid = r.choice([None, None, 0, 1, 2])
            x = r.random()
            if x < 0.35:
                call = ("store", (p, r.choice([0, 0, 1, 2]), sa))
            elif x < 0.5:
                call = ("pressure", (r.randint(1, 3), r.randint(CHUNK, 5 * CHUNK),
                                     r.randrange(99)))
            elif x < 0.65:
                call = ("lookup", (p, r.random() < 0.5, rid))
            elif x < 0.72:
                call = ("unpin", (p, rid))
            else:
                call = ("retrieve", (p, r.choice([0, 0, 1, 2]), sa, rid, r.random() < 0.5))
            trace.append(f"{call[0]}{call[1]!r}")
            try:
                getattr(self, call[0])(*call[1])
                self.pins_hold()
            except Exception as e:  # an engine error is a failure too: show the steps
                steps = "\n  ".join(trace)
                raise AssertionError(f"burst(seed={seed}) failed at step {len(trace)}: "
                                     f"{type(e).__name__}: {e}\n"
                                     f"steps:\n  {steps}") from e

    @precondition(lambda self: self.steps > 3)
    @rule()
    def reopen(self):
        """Close (draining writes to lower tiers) and open again on the same tiers."""
        if self.persistent:
            assert self.eng.flush(30), "flush timed out"
        exc = self._excuse()
        self._close()
        self.pins.clear()
        if self.persistent:  # still-valid guarantees carry over to the new engine's counters
            self.guaranteed = {k: 0.0 for k, v in self.guaranteed.items() if v == exc}
        else:
            self.guaranteed.clear()
        self._open()

    # ------------------------------------------------------------- invariants
    @invariant()
    def pins_hold(self):
        if self.eng is None:
            return
        self.steps += 1
        pinned = self._stats()["pinned_chunks"]
        want = sum(len(v) for v in self.pins.values())
        assert pinned == want, f"engine holds {pinned} pins, the model {want}"
        for key in self._pinned():
            assert bool(self.eng.contains_chunks(list(key))[-1]), "a pinned chunk left L1"
        pool = self.eng.pool
        assert 0 <= pool.used_bytes <= pool.size

    def _close(self) -> None:
        pool = self.eng.pool
        self.eng.close()
        assert pool.used_bytes == 0, f"closed engine left {pool.used_bytes} B referenced"

    def teardown(self):
        try:
            if self.eng is not None:
                self._close()
        finally:
            rmtree(self.workdir)
