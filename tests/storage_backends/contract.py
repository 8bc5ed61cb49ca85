"""The storage-tier contract as one test suite that every tier runs unchanged.

In the style of fsspec's abstract tests: the tests live here as a base class,
:class:`TierContract`, and a tier's test module is one fixture and one line::

    @pytest.fixture
    def tier_spec(tmp_path):
        return TierSpec("disk", config=lambda: {"local_disk": ..., "local_disk_size": "512KiB"})

    class TestDiskContract(TierContract): ...

Every tier is built the public way, ``create_backend(spec, CacheConfig(...), pool)``, over a
pool of its own, and held to ``StorageBackend``'s contract (``lmc/storage_backend.py``):

* a value read back is the value stored, bit for bit, with its shape, dtype and token count;
  a batch answers each key in its place (hits beside misses, a key repeated in one batch);
* ``get`` hands the caller one reference per hit; ``put`` keeps no reference of the caller's
  (a tier that keeps an object takes its own), so memory goes back to the pool when the
  caller releases, and an object a caller holds is never freed or reused for other data,
  whatever the tier evicts meanwhile;
* a chunk a tier cannot represent (no ``lmc.serde`` header describes it) is skipped, never
  an error: the batch's other chunks are stored;
* threads may call a tier at once, ``close()`` included: every call returns, none raises;
  calls after ``close()`` are misses and 0;
* a value failing a check is a miss and is deleted; a dead or hung backend answers misses
  within a deadline, never a hang or an exception;
* integrity: with ``integrity_secret`` set, a value written without it (or damaged so that
  only the tag can tell) is a miss;
* isolation: another tenant over the same backend (another namespace or key prefix, another
  token) neither sees a tier's values nor changes them.

What a spec cannot offer (an in-process tier has no stored copy to damage, no process to kill)
skips the tests that need it, saying so. Randomised tests print their seed; set
``LMC_CONTRACT_SEED`` to replay one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from lmc.config import CacheConfig
from lmc.layered_read import LayerReadError
from lmc.memory import MemoryObj, MemoryPool
from lmc.serde import DTYPE_CODES, CorruptValue
from lmc.storage_backend import Key, MemoryTier, StorageBackend, create_backend

SHAPE = (2, 2, 16, 64)            # [layers, planes, tokens, width]: 8 KiB of float16
CHUNK_BYTES = 2 * 2 * 16 * 64 * 2
POOL_BYTES = 4 << 20              # the pool of a tier made by ``make_tier`` (512 chunks)
SMALL_POOL_BYTES = 24 * CHUNK_BYTES  # eviction test: a pool the flood overruns 4 times
SLACK = 1.0                       # scheduling slack on a loaded 2-core machine, seconds
ROUND_TRIPS = [
    (SHAPE, torch.float16),
    ((2, 2, 5, 64), torch.bfloat16),   # a prompt's last, partial chunk
    ((3, 1, 16, 40), torch.float32),
    ((1, 2, 1, 64), torch.uint8),
    *[((2, 2, 16, 64), getattr(torch, n)) for n in ("float8_e4m3fn", "float8_e5m2")
      if getattr(torch, n, None) in DTYPE_CODES],
]


@dataclass
class TierSpec:
    """One tier as the contract suite needs it.

    ``spec`` and ``config`` build it (``config`` may be a callable giving fresh settings per
    tier: a directory, a key prefix or namespace of its own). The hooks are optional:

    * ``corrupt(tier, key)`` damages the stored value of ``key`` out of band, the way a bad
      disk block or a writer to a shared store would (for a keyed tier, in a way only the
      integrity tag can catch);
    * ``kill(tier)`` makes the backend die (SIGKILL a server, remove a directory) and
      ``revive(tier)`` brings it back; ``hang(tier)`` makes it stop answering (SIGSTOP) and
      ``unhang(tier)`` lets it go on;
    * ``reopen(tier)`` gives the settings of a second tier over the same stored values
      (the same directory after a restart, the same server and key prefix from another
      engine);
    * ``unkeyed_writer(tier)`` gives the settings of a tier writing where a keyed ``tier``
      reads, without the secret (default: ``reopen``'s, the secret removed);
    * ``other_tenants(tier)`` gives the settings of tiers of other tenants over the same
      backend (another namespace, another token): none may see or change ``tier``'s values.

    ``skip`` maps a test's name to the reason this spec leaves it out (say where it is
    covered instead). ``deadline`` bounds any one call on a dead or hung backend, in seconds.
    A tier implementing :class:`lmc.storage_backend.MemoryTier` (L1) keeps the caller's
    objects themselves: the suite's writers allocate through its ``allocate_many``, which
    evicts.
    """

    spec: str
    config: dict[str, Any] | Callable[[], dict[str, Any]] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)
    corrupt: Callable[[StorageBackend, Key], None] | None = None
    kill: Callable[[StorageBackend], None] | None = None
    revive: Callable[[StorageBackend], None] | None = None
    hang: Callable[[StorageBackend], None] | None = None
    unhang: Callable[[StorageBackend], None] | None = None
    reopen: Callable[[StorageBackend], dict[str, Any]] | None = None
    unkeyed_writer: Callable[[StorageBackend], dict[str, Any]] | None = None
    other_tenants: Callable[[StorageBackend], list[dict[str, Any]]] | None = None
    skip: dict[str, str] = field(default_factory=dict)
    deadline: float = 2.0 + SLACK

    def settings(self) -> dict[str, Any]:
        return dict(self.config() if callable(self.config) else self.config)

    def writer_without_secret(self, tier: StorageBackend) -> dict[str, Any] | None:
        """Settings of a tier writing where keyed ``tier`` reads, without the secret."""
        if self.unkeyed_writer is not None:
            settings = self.unkeyed_writer(tier)
        elif self.reopen is not None:
            settings = self.reopen(tier)
        else:
            return None
        return {**settings, "integrity_secret": None, "integrity_secret_file": None}


# --------------------------------------------------------------------------- chunk data
def key_of(name: str) -> Key:
    """A 16-byte content address for a test's own name for a chunk."""
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def expected_bytes(key: Key, nbytes: int) -> torch.Tensor:
    """The bytes every chunk stored under ``key`` holds: a function of the key alone, so any
    thread can check any hit it reads."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def raw(obj: MemoryObj) -> torch.Tensor:
    return obj.tensor.reshape(-1).view(torch.uint8)


def fill(obj: MemoryObj, key: Key) -> MemoryObj:
    raw(obj).copy_(expected_bytes(key, obj.nbytes))
    return obj


def check_hit(obj: MemoryObj | None, key: Key, shape: Sequence[int] = SHAPE,
              dtype: torch.dtype = torch.float16) -> None:
    """``obj`` is the chunk stored under ``key``: shape, dtype, token count and every bit."""
    assert obj is not None, f"miss for {key.hex()}"
    assert obj.ref_count >= 1, f"{obj!r} for {key.hex()} came back without a reference"
    assert (tuple(obj.shape), obj.dtype, obj.num_tokens) == (tuple(shape), dtype, shape[2]), \
        f"{key.hex()}: got {obj!r}, stored shape {tuple(shape)} {dtype}"
    assert torch.equal(raw(obj), expected_bytes(key, obj.nbytes)), \
        f"{key.hex()}: the bytes read back differ from the bytes stored"


def release(objs: Sequence[MemoryObj | None]) -> None:
    for o in objs:
        if o is not None:
            o.release()


def seeded(name: str) -> random.Random:
    """A random source whose seed is printed (and replayed from ``LMC_CONTRACT_SEED``)."""
    seed = int(os.environ.get("LMC_CONTRACT_SEED") or random.randrange(2**32))
    print(f"{name}: LMC_CONTRACT_SEED={seed}")
    return random.Random(seed)


class Timed:
    """Runs tier calls and records the slowest, for the dead-backend deadline."""

    def __init__(self) -> None:
        self.slowest = (0.0, "")

    def __call__(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.monotonic()
        out = fn(*args)
        took = time.monotonic() - t0
        if took > self.slowest[0]:
            self.slowest = (took, what)
        return out


class _Pools:
    """Memory pools by size, reused by the tests of one class."""

    def __init__(self) -> None:
        self._by_size: dict[int, MemoryPool] = {}

    def get(self, size: int) -> MemoryPool:
        pool = self._by_size.get(size)
        if pool is None:
            pool = self._by_size[size] = MemoryPool(size, pin_memory="false")
        return pool

    def drop(self, pool: MemoryPool) -> None:
        """Forget a pool a failed test left memory in (closing it would report each leak
        again); the next test builds a fresh one."""
        self._by_size = {n: p for n, p in self._by_size.items() if p is not pool}

    def close(self) -> None:
        for pool in self._by_size.values():
            pool.close()


# --------------------------------------------------------------------------- the suite
class TierContract:
    """The contract tests. Subclass in a module that defines the ``tier_spec`` fixture."""

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(autouse=True)
    def _spec_skips(self, request, tier_spec: TierSpec) -> None:
        reason = tier_spec.skip.get(request.node.originalname)
        if reason:
            pytest.skip(f"{tier_spec.spec}: {reason}")

    @pytest.fixture(scope="class")
    def pools(self):
        """Pools by size, shared by a class's tests: each test's tiers must hand every byte
        back (checked at their close), so a pool is as good as new for the next test, and
        the harness's garbage collection after each test that builds a pool (a quarter
        second here) is paid once per pool, not once per test."""
        pools = _Pools()
        yield pools
        pools.close()

    @pytest.fixture
    def make_tier(self, tier_spec: TierSpec, pools):
        """``make_tier(pool_bytes=..., **settings)`` -> a tier over a pool no other live tier
        uses; every tier is closed after the test and must have given all its pool memory
        back."""
        made: list[StorageBackend] = []

        def make(pool_bytes: int = POOL_BYTES, fresh_pool: bool = False, **settings: Any
                 ) -> StorageBackend:
            """``fresh_pool``: a pool of this tier's own instead of the class's (a test
            making several tiers of one size)."""
            if fresh_pool:
                pool = MemoryPool(pool_bytes, pin_memory="false")
                own.append(pool)
            else:
                pool = pools.get(pool_bytes)
                others = [t.pool for t in made]  # type: ignore[attr-defined]
                assert pool not in others, "a test makes one tier per shared pool size"
            assert pool.used_bytes == 0, f"a pool of {pool_bytes} B starts with memory in use"
            config = CacheConfig(**{**tier_spec.settings(), **settings})
            tier = create_backend(tier_spec.spec, config, pool, **tier_spec.kwargs)
            made.append(tier)
            return tier

        own: list[MemoryPool] = []
        yield make
        for tier in made:
            tier.close()
            tier.close()  # idempotent
            pool = tier.pool  # type: ignore[attr-defined]
            if pool.used_bytes:
                pools.drop(pool)  # the next test gets a fresh one
            assert pool.used_bytes == 0, \
                f"{tier.name}: {pool.used_bytes} B of pool memory kept after close()"
        for pool in own:
            pool.close()

    @pytest.fixture
    def tier(self, make_tier) -> StorageBackend:
        return make_tier()

    # ------------------------------------------------------------------- helpers
    @staticmethod
    def chunks(tier: StorageBackend, spec: TierSpec, keys: Sequence[Key],
               shape: Sequence[int] = SHAPE, dtype: torch.dtype = torch.float16
               ) -> list[MemoryObj]:
        """Pool objects filled with each key's bytes (fewer when the pool is full of
        referenced chunks); the caller releases them."""
        src: Any = tier if isinstance(tier, MemoryTier) else tier.pool  # type: ignore[attr-defined]
        objs = src.allocate_many(tuple(shape), dtype, len(keys), shape[2])
        return [fill(o, k) for o, k in zip(objs, keys)]

    def store(self, tier: StorageBackend, spec: TierSpec, keys: Sequence[Key],
              shape: Sequence[int] = SHAPE, dtype: torch.dtype = torch.float16) -> None:
        """Put ``keys`` (all of them stored), then drop the caller's references."""
        objs = self.chunks(tier, spec, keys, shape, dtype)
        assert len(objs) == len(keys), "the pool is too small for the test's chunks"
        try:
            assert tier.put(keys, objs) == len(keys)
        finally:
            release(objs)

    @staticmethod
    def used(tier: StorageBackend) -> int:
        return tier.pool.used_bytes  # type: ignore[attr-defined]

    # ------------------------------------------------------------- round trips
    def test_round_trip_is_bit_exact(self, tier, tier_spec):
        """Every dtype and a partial chunk come back with their shape, dtype, token count
        and every bit, as often as asked."""
        for shape, dtype in ROUND_TRIPS:
            case = f"{tuple(shape)} {dtype}"
            keys = [key_of(f"rt{i}{case}") for i in range(3)]
            self.store(tier, tier_spec, keys, shape, dtype)
            assert tier.contains(keys) == [True] * 3, case
            assert tier.prefix_hits(keys) == 3, case
            for _ in range(2):
                got = tier.get(keys)
                try:
                    for k, o in zip(keys, got):
                        check_hit(o, k, shape, dtype)
                finally:
                    release(got)

    def test_stored_values_outlive_the_callers_objects(self, tier, tier_spec):
        """After ``put`` the caller releases its objects and the pool reuses that memory for
        other data: the values stored are unchanged."""
        keys = [key_of(f"outlive{i}") for i in range(4)]
        self.store(tier, tier_spec, keys)
        others = self.chunks(tier, tier_spec, [key_of(f"other{i}") for i in range(8)])
        try:
            got = tier.get(keys)
            try:
                for k, o in zip(keys, got):
                    check_hit(o, k)
            finally:
                release(got)
        finally:
            release(others)

    def test_each_hit_is_one_reference_for_the_caller(self, tier, tier_spec):
        """Releasing what ``get`` returned gives the pool back exactly its memory: no
        reference is kept for the caller, none is missing."""
        keys = [key_of(f"ref{i}") for i in range(3)]
        self.store(tier, tier_spec, keys)
        baseline = self.used(tier)
        for _ in range(3):
            got = tier.get(keys)
            assert all(o is not None and o.ref_count >= 1 for o in got)
            release(got)
            assert self.used(tier) == baseline, "get leaked or lost a pool reference"

    # ---------------------------------------------------------- batches, misses
    def test_missing_keys_and_empty_batches(self, tier):
        missing = [key_of(f"never{i}") for i in range(3)]
        assert tier.get(missing) == [None] * 3
        assert tier.contains(missing) == [False] * 3
        assert tier.prefix_hits(missing) == 0
        assert tier.delete(missing) == 0
        assert tier.get([]) == [] and tier.contains([]) == []
        assert tier.put([], []) == 0 and tier.delete([]) == 0 and tier.prefix_hits([]) == 0
        assert self.used(tier) == 0, "a miss left pool memory allocated"

    def test_partial_batches_answer_each_key_in_place(self, tier, tier_spec):
        present = [key_of(f"part{i}") for i in range(4)]
        absent = [key_of(f"hole{i}") for i in range(3)]
        self.store(tier, tier_spec, present)
        ask = [present[0], absent[0], present[1], present[2], absent[1], present[3], absent[2]]
        want = [k in present for k in ask]
        assert tier.contains(ask) == want
        assert tier.prefix_hits(ask) == 1
        assert tier.prefix_hits(present[:2] + absent[:1] + present[2:]) == 2
        got = tier.get(ask)
        try:
            for k, o, hit in zip(ask, got, want):
                if hit:
                    check_hit(o, k)
                else:
                    assert o is None, f"{k.hex()} was never stored but got {o!r}"
        finally:
            release(got)
        assert tier.delete([present[1], absent[0]]) == 1
        assert tier.contains(present) == [True, False, True, True]
        assert tier.get([present[1]]) == [None]
        assert tier.delete([absent[1], present[0], present[3]]) == 2
        assert tier.contains(present) == [False, False, True, False]

    def test_duplicate_keys_in_one_batch(self, tier, tier_spec):
        """One key twice in a batch (two reads of one chunk promoted together): stored once,
        counted as stored each time, read as two references, deleted once."""
        k, j = key_of("dup-k"), key_of("dup-j")
        objs = self.chunks(tier, tier_spec, [k, k, j])
        try:
            assert tier.put([k, k, j], objs) == 3
        finally:
            release(objs)
        assert tier.contains([k, j, k]) == [True, True, True]
        got = tier.get([k, k, j, k])
        try:
            for key, o in zip([k, k, j, k], got):
                check_hit(o, key)
        finally:
            release(got)
        baseline = self.used(tier)
        again = self.chunks(tier, tier_spec, [j, j])
        try:  # present keys count as stored, and the tier takes nothing of these objects
            assert tier.put([j, j], again) == 2
        finally:
            release(again)
        assert self.used(tier) == baseline, "a put of present keys kept pool memory"
        assert tier.delete([k, k]) == 1
        assert tier.contains([k, j]) == [False, True]

    def test_put_with_mismatched_lengths_is_refused(self, tier, tier_spec):
        """A caller's bug is a clear error before anything is stored, not a half-stored batch."""
        keys = [key_of("len0"), key_of("len1")]
        objs = self.chunks(tier, tier_spec, keys[:1])
        try:
            with pytest.raises(ValueError):
                tier.put(keys, objs)
        finally:
            release(objs)
        assert tier.contains(keys) == [False, False]

    def test_large_batch_with_holes(self, tier, tier_spec):
        """One call for a whole long prompt (tiers split such batches over connections or
        threads): each of 48 keys answered in its place, 36 hits bit-exact, 12 misses."""
        keys = [key_of(f"large{i}") for i in range(48)]
        present = [k for i, k in enumerate(keys) if i % 4 != 3]
        self.store(tier, tier_spec, present)
        assert tier.contains(keys) == [k in present for k in keys]
        got = tier.get(keys)
        try:
            for k, o in zip(keys, got):
                if k in present:
                    check_hit(o, k)
                else:
                    assert o is None, f"{k.hex()} was never stored but got {o!r}"
        finally:
            release(got)

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

    # ------------------------------------------------------------------ memory
    def test_io_stays_inside_each_object(self, tier, tier_spec):
        """Writing a value out and reading it back into pool memory touches only that
        object's bytes: its neighbours in the pool (other chunks, other requests' data)
        keep theirs. Partial chunks (2560 B in 4 KiB blocks) are where padding could spill."""
        shape, dtype = (2, 2, 5, 64), torch.bfloat16
        key = key_of("inside")
        objs = self.chunks(tier, tier_spec, [key_of("left"), key, key_of("right")], shape, dtype)
        assert len(objs) == 3
        left, mid, right = objs
        try:
            assert tier.put([key], [mid]) == 1
            mid.release()
            got = tier.get([key])  # lands in the freed block where the pool reuses it
            try:
                check_hit(got[0], key, shape, dtype)
            finally:
                release(got)
            check_hit(left, key_of("left"), shape, dtype)
            check_hit(right, key_of("right"), shape, dtype)
        finally:
            release([left, right])

    def test_eviction_never_reuses_a_chunk_a_reader_holds(self, make_tier, tier_spec):
        """A reader holds one chunk while a flood four times the pool (and any tier capacity)
        goes through: every read of the flood is right, and the held chunk keeps its bytes.
        A memory tier also keeps the held chunk itself (referenced chunks are never evicted)."""
        tier = make_tier(SMALL_POOL_BYTES)
        held_key = key_of("held")
        self.store(tier, tier_spec, [held_key, key_of("held-neighbour")])
        held = tier.get([held_key])[0]
        check_hit(held, held_key)
        try:
            flood = [key_of(f"flood{i}") for i in range(4 * SMALL_POOL_BYTES // CHUNK_BYTES)]
            for at in range(0, len(flood), 6):
                batch = flood[at: at + 6]
                objs = self.chunks(tier, tier_spec, batch)
                try:
                    tier.put(batch[: len(objs)], objs)
                finally:
                    release(objs)
                got = tier.get(flood[max(0, at - 6): at + 6])
                try:
                    for k, o in zip(flood[max(0, at - 6): at + 6], got):
                        if o is not None:
                            check_hit(o, k)
                finally:
                    release(got)
                check_hit(held, held_key)
            if isinstance(tier, MemoryTier):
                again = tier.get([held_key])
                try:
                    check_hit(again[0], held_key)
                finally:
                    release(again)
        finally:
            held.release()

    def test_reads_into_a_full_pool_are_misses_then_hits(self, tier, tier_spec):
        """With every byte of the pool held by the caller, a read that needs memory is a
        miss, never an error or a partial object; once memory is back the same reads hit
        (a tier that could not place a value must leave its connection or file clean)."""
        keys = [key_of(f"full{i}") for i in range(6)]
        self.store(tier, tier_spec, keys)
        filler: list[MemoryObj] = []
        while True:
            more = tier.pool.allocate_many(SHAPE, torch.float16, 64, SHAPE[2])  # type: ignore[attr-defined]
            if not more:
                break
            filler += more
        try:
            for _ in range(2):
                got = tier.get(keys)
                try:
                    for k, o in zip(keys, got):
                        if isinstance(tier, MemoryTier):  # hands out the objects it holds
                            check_hit(o, k)
                        else:
                            assert o is None, f"{o!r} read into a pool with no room"
                finally:
                    release(got)
        finally:
            release(filler)
        got = tier.get(keys)
        try:
            for k, o in zip(keys, got):
                check_hit(o, k)
        finally:
            release(got)

    # ------------------------------------------------------------- concurrency
    def test_concurrent_readers_and_writers(self, make_tier, tier_spec):
        """Four threads put, get, ask and delete over a shared key space larger than a small
        pool: every hit is right, no call raises, and no reference is lost."""
        tier = make_tier(2 * SMALL_POOL_BYTES)
        rng = seeded("test_concurrent_readers_and_writers")
        keys = [key_of(f"conc{i}") for i in range(48)]
        seeds = [rng.randrange(2**32) for _ in range(4)]
        errors: list[str] = []
        ops = 60

        def work(seed: int) -> None:
            r = random.Random(seed)
            try:
                for _ in range(ops):
                    batch = [r.choice(keys) for _ in range(r.randint(1, 4))]
                    op = r.random()
                    if op < 0.4:
                        objs = self.chunks(tier, tier_spec, batch)
                        try:
                            n = tier.put(batch[: len(objs)], objs)
                            assert 0 <= n <= len(objs), f"put of {len(objs)} returned {n}"
                        finally:
                            release(objs)
                    elif op < 0.8:
                        got = tier.get(batch)
                        try:
                            assert len(got) == len(batch)
                            for k, o in zip(batch, got):
                                if o is not None:
                                    check_hit(o, k)
                        finally:
                            release(got)
                    elif op < 0.93:
                        assert len(tier.contains(batch)) == len(batch)
                    else:
                        assert 0 <= tier.delete(batch) <= len(batch)
            except BaseException as e:  # reported with the thread's seed
                errors.append(f"thread seed {seed}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a tier call hung under concurrency"
        assert not errors, "\n".join(errors)
        self.store(tier, tier_spec, keys[:2])  # still serves after the storm
        got = tier.get(keys[:2])
        try:
            for k, o in zip(keys[:2], got):
                check_hit(o, k)
        finally:
            release(got)

    def test_no_value_is_visible_before_it_is_complete(self, tier, tier_spec):
        """Two readers ask for 192 KiB values while a writer stores and deletes them over and
        over: a hit is always the whole value, never a torn or half-written one."""
        shape = (2, 2, 96, 256)  # 192 KiB of float16: many socket reads, several disk pages
        keys = [key_of(f"visible{i}") for i in range(2)]
        stop = threading.Event()
        errors: list[str] = []
        hits = [0]

        def read() -> None:
            try:
                while not stop.is_set():
                    got = tier.get(keys)
                    try:
                        for k, o in zip(keys, got):
                            if o is not None:
                                check_hit(o, k, shape)
                                hits[0] += 1
                    finally:
                        release(got)
                    assert len(tier.contains(keys)) == 2
            except BaseException as e:
                errors.append(f"reader: {type(e).__name__}: {e}")

        readers = [threading.Thread(target=read, daemon=True) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            for _ in range(12):
                objs = self.chunks(tier, tier_spec, keys, shape)
                try:
                    tier.put(keys[: len(objs)], objs)
                finally:
                    release(objs)
                time.sleep(0.005)
                tier.delete(keys[:1])
        finally:
            stop.set()
            for t in readers:
                t.join(30)
        assert not any(t.is_alive() for t in readers), "a reader hung"
        assert not errors, "\n".join(errors)
        assert hits[0] > 0, "no reader ever saw a value: the test proved nothing"

    def test_close_with_work_in_flight(self, make_tier, tier_spec):
        """``close()`` while three threads call the tier with batches of up to 12 keys (split
        over connections or threads by remote tiers), and go on calling after it: every
        call returns (misses or right bytes), none raises or hangs, and the pool gets all its
        memory back. Several rounds, each closing at a random moment (seed printed)."""
        rng = seeded("test_close_with_work_in_flight")
        keys = [key_of(f"close{i}") for i in range(16)]
        before = 0
        for _ in range(4):
            tier = make_tier(fresh_pool=True)
            self.store(tier, tier_spec, keys[:8])
            before += self._close_during_calls(tier, tier_spec, keys, rng)
            assert self.used(tier) == 0, "memory still held once every caller released"
        assert before > 0, "no call completed before close(): the test proved nothing"

    def _close_during_calls(self, tier: StorageBackend, spec: TierSpec, keys: Sequence[Key],
                            rng: random.Random) -> int:
        """One round; returns how many calls completed before ``close()``."""
        stop, closed = threading.Event(), threading.Event()
        errors: list[str] = []
        calls = [0, 0]  # before, after close

        def work(seed: int) -> None:
            r = random.Random(seed)
            while not stop.is_set():
                batch = [r.choice(keys) for _ in range(r.randint(1, 12))]
                try:
                    if r.random() < 0.6:
                        got = tier.get(batch)
                        try:
                            assert len(got) == len(batch)
                            for k, o in zip(batch, got):
                                if o is not None:
                                    check_hit(o, k)
                        finally:
                            release(got)
                    else:
                        objs = self.chunks(tier, spec, batch)
                        try:
                            tier.put(batch[: len(objs)], objs)
                        finally:
                            release(objs)
                    assert len(tier.contains(batch)) == len(batch)
                except BaseException as e:
                    errors.append(f"{'after' if closed.is_set() else 'before'} close: "
                                  f"{type(e).__name__}: {e}")
                    return
                calls[closed.is_set()] += 1

        threads = [threading.Thread(target=work, args=(rng.randrange(2**32),), daemon=True)
                   for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.02, 0.12))
        t0 = time.monotonic()
        tier.close()
        closed.set()
        took = time.monotonic() - t0
        time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(spec.deadline + 10)
        assert not any(t.is_alive() for t in threads), "a call racing close() never returned"
        assert not errors, "\n".join(errors)
        assert took < spec.deadline + 10, f"close() took {took:.1f} s"
        tier.close()  # again: a no-op
        # a closed tier answers misses and changes nothing (its directory or namespace may
        # already belong to the next tier)
        assert tier.contains(keys) == [False] * len(keys), "contains() after close()"
        assert tier.prefix_hits(keys) == 0 and tier.get(keys) == [None] * len(keys)
        assert tier.delete(keys) == 0, "delete() after close()"
        late = [key_of("after-close")]
        objs = [fill(o, late[0]) for o in tier.pool.allocate_many(  # type: ignore[attr-defined]
            SHAPE, torch.float16, 1, SHAPE[2])]
        try:
            assert tier.put(late, objs) == 0, "put() after close() stored something"
        finally:
            release(objs)
        assert tier.contains(late) == [False]
        return calls[0]

    def test_a_chunk_the_tier_cannot_represent_is_skipped(self, tier, tier_spec):
        """The one rule for shapes and dtypes (``lmc.storage_backend``: a chunk a tier cannot
        represent is skipped): a batch mixing chunks no ``lmc.serde`` header describes (3-D,
        float64) with good ones raises nothing and stores the good ones; each odd one is
        either kept whole (L1 keeps any object) or a miss, and ``put`` counts only what it
        stored."""
        good = [key_of("odd-good0"), key_of("odd-good1")]
        odd = [(key_of("odd-3d"), (4, 16, 64), torch.float16),
               (key_of("odd-f64"), SHAPE, torch.float64)]
        objs = self.chunks(tier, tier_spec, good[:1])
        for k, shape, dtype in odd:
            objs += self.chunks(tier, tier_spec, [k], shape, dtype)
        objs += self.chunks(tier, tier_spec, good[1:])
        keys = [good[0], *(k for k, _, _ in odd), good[1]]
        assert len(objs) == len(keys), "the pool is too small for the test's chunks"
        try:
            stored = tier.put(keys, objs)
        finally:
            release(objs)
        present = tier.contains(keys)
        assert present[0] and present[-1], "a good chunk beside odd ones was not stored"
        assert stored == sum(present), f"put() said {stored}, {sum(present)} are present"
        got = tier.get(keys)
        try:
            check_hit(got[0], good[0])
            check_hit(got[-1], good[1])
            for (k, shape, dtype), o, here in zip(odd, got[1:-1], present[1:-1]):
                if not here:
                    assert o is None, f"{tuple(shape)} {dtype}: a miss in contains, a hit in get"
                    continue
                assert o is not None and (tuple(o.shape), o.dtype) == (shape, dtype)
                assert torch.equal(raw(o), expected_bytes(k, o.nbytes)), f"{shape} {dtype}"
        finally:
            release(got)

    # ------------------------------------------------------------------ faults
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
            objs = [fill(o, other) for o in theirs.pool.allocate_many(  # type: ignore[attr-defined]
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
            for k, o in zip(keys[:3], got):
                check_hit(o, k)
            assert got[3] is None
        finally:
            release(got)

    # ------------------------------------------- optional: reads layer by layer
    @staticmethod
    def layered(tier: StorageBackend, keys: Sequence[Key]):
        """``tier.get_layers(keys)``, skipping the test for tiers that read whole chunks."""
        read = tier.get_layers(keys)
        if read is None:
            pytest.skip(f"{tier.name}: no get_layers (whole chunks only)")
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
                for k, o in zip(asked[::2] + asked[3:], read.objs[::2] + read.objs[3:]):
                    check_hit(o, k, shape, dtype)
                    assert o.ref_count == 1, f"{case}: a hit holds {o.ref_count} references"
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

    @pytest.mark.integration
    def test_dead_backend_answers_misses_within_a_deadline(self, tier, tier_spec):
        if tier_spec.kill is None:
            pytest.skip(f"{tier_spec.spec}: the spec has no way to kill its backend")
        keys = [key_of(f"dead{i}") for i in range(8)]
        self.store(tier, tier_spec, keys)
        tier_spec.kill(tier)
        try:
            self._misses_within_deadline(tier, tier_spec, keys)
        finally:
            if tier_spec.revive is not None:
                tier_spec.revive(tier)
        if tier_spec.revive is not None:
            self._serves_again(tier, tier_spec)

    @pytest.mark.integration
    def test_hung_backend_answers_misses_within_a_deadline(self, tier, tier_spec):
        if tier_spec.hang is None:
            pytest.skip(f"{tier_spec.spec}: the spec has no way to make its backend stop answering")
        keys = [key_of(f"hung{i}") for i in range(8)]
        self.store(tier, tier_spec, keys)
        tier_spec.hang(tier)
        try:
            self._misses_within_deadline(tier, tier_spec, keys)
        finally:
            if tier_spec.unhang is not None:
                tier_spec.unhang(tier)
        self._serves_again(tier, tier_spec)

    @pytest.mark.integration
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
