"""What every contract class shares: the tier's description (:class:`TierSpec`), chunk data
that checks itself, and :class:`TierHarness`, the fixtures that build tiers over pools of
their own and check, after each test, that every byte went back to the pool and that no pool
invariant broke (:mod:`lmc.memory.invariants`: views, overlaps, references; on in every pool the
suite makes, whatever ``LMC_DEBUG_INVARIANTS`` says).

Every tier is built the public way, ``create_backend(spec, CacheConfig(...), pool)``.
Randomised tests print their seed; set ``LMC_CONTRACT_SEED`` to replay one.
"""


from __future__ import annotations

import functools
import gc
import hashlib
import os
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from lmc.config import CacheConfig
from lmc.memory import invariants
from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.storage.serde import DTYPE_CODES
from lmc.storage.tier import Key, MemoryTier, StorageBackend, create_backend

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

    ``lossy`` says the tier holds chunks through a lossy codec (``lmc.storage.kvcodecs``):
    float chunks are then filled with finite values, and a hit must hold exactly
    ``lossy(stored values)`` (the codec's own round trip), every other chunk its bytes.

    ``inner`` makes ``spec`` a wrapper tier: the tier ``inner`` describes is built first and
    handed to it as ``inner=`` (its ``kwargs`` apply to it; ``config`` is this spec's).

    ``skip`` maps a test's name to the reason this spec leaves it out (say where it is
    covered instead). ``deadline`` bounds any one call on a dead or hung backend, in seconds.
    A tier implementing :class:`lmc.storage.tier.MemoryTier` (L1) keeps the caller's
    objects themselves: the suite's writers allocate through its ``allocate_many``, which
    evicts.
    """

    spec: str
    config: dict[str, Any] | Callable[[], dict[str, Any]] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)
    inner: TierSpec | None = None
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
    lossy: Callable[[torch.Tensor], torch.Tensor] | None = None

    def build(self, config: CacheConfig, pool: Any) -> StorageBackend:
        """The tier, the public way; a wrapper's ``inner`` tier first, over the same pool and
        config, handed in as ``inner=`` (as a ``tiers:`` chain builds it). The wrapper owns
        it: closing the wrapper closes it."""
        if self.inner is None:
            return create_backend(self.spec, config, pool, **self.kwargs)
        inner = self.inner.build(config, pool)
        try:
            return create_backend(self.spec, config, pool, inner=inner, **self.kwargs)
        except BaseException:
            inner.close()
            raise

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


FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_lossy: list[Callable[[torch.Tensor], torch.Tensor]] = []
"""The lossy round trip of the tier under test (``TierSpec.lossy``), set per test."""


def _values(key: Key, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Finite KV-like values for ``key`` (a lossy tier's chunks: random bytes would hold
    NaNs, which a codec stores exact)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return (torch.randn(shape, generator=g) * 2).to(dtype)


@functools.lru_cache(maxsize=512)
def _lossy_bytes(key: Key, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return _lossy[0](_values(key, shape, dtype)).reshape(-1).view(torch.uint8)


def _is_lossy(obj: MemoryObj) -> bool:
    return bool(_lossy) and obj.dtype in FLOATS and len(obj.shape) == 4


def fill(obj: MemoryObj, key: Key) -> MemoryObj:
    if _is_lossy(obj):
        obj.tensor.copy_(_values(key, tuple(obj.shape), obj.dtype))
    else:
        raw(obj).copy_(expected_bytes(key, obj.nbytes))
    return obj


def fill_like(obj: MemoryObj, key: Key) -> torch.Tensor:
    """What :func:`fill` writes into ``obj`` for ``key``, as a tensor of its own."""
    if _is_lossy(obj):
        return _values(key, tuple(obj.shape), obj.dtype)
    return expected_bytes(key, obj.nbytes)


def stored_bytes(obj: MemoryObj, key: Key) -> torch.Tensor:
    """The bytes a hit for ``key`` holds: what was stored, or its lossy round trip."""
    if _is_lossy(obj):
        return _lossy_bytes(key, tuple(obj.shape), obj.dtype)
    return expected_bytes(key, obj.nbytes)


def check_hit(obj: MemoryObj | None, key: Key, shape: Sequence[int] = SHAPE,
              dtype: torch.dtype = torch.float16, *, read: bool = True) -> None:
    """``obj`` is the chunk stored under ``key``: shape, dtype, token count and every bit
    (``read``: as read back from the tier, a lossy tier's round trip; else as filled)."""
    assert obj is not None, f"miss for {key.hex()}"
    assert obj.ref_count >= 1, f"{obj!r} for {key.hex()} came back without a reference"
    assert (tuple(obj.shape), obj.dtype, obj.num_tokens) == (tuple(shape), dtype, shape[2]), \
        f"{key.hex()}: got {obj!r}, stored shape {tuple(shape)} {dtype}"
    want = stored_bytes(obj, key) if read else fill_like(obj, key).reshape(-1).view(torch.uint8)
    assert torch.equal(raw(obj), want), \
        f"{key.hex()}: the bytes read back differ from the bytes stored"


def get_checked(tier: Any, keys: Sequence[Key], *, misses: bool = False,
                shape: Sequence[int] = SHAPE, dtype: torch.dtype = torch.float16) -> int:
    """``tier.get(keys)``: one answer per key, every hit the chunk stored under its key (a
    miss only where ``misses`` allows it), every reference released; the number of hits."""
    got = tier.get(keys)
    try:
        assert len(got) == len(keys), f"get of {len(keys)} keys answered {len(got)}"
        for k, o in zip(keys, got):
            if o is not None or not misses:
                check_hit(o, k, shape, dtype)
        return sum(o is not None for o in got)
    finally:
        release(got)


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


def new_pool(size: int) -> MemoryPool:
    """A pool checking its own invariants: a reference lost, a view past its object or a use
    after release is reported (see :meth:`TierHarness._pool_invariants`)."""
    return MemoryPool(size, pin_memory="false", invariants=True)


class _Pools:
    """Memory pools by size, reused by the tests of one class."""

    def __init__(self) -> None:
        self._by_size: dict[int, MemoryPool] = {}

    def get(self, size: int) -> MemoryPool:
        pool = self._by_size.get(size)
        if pool is None:
            pool = self._by_size[size] = new_pool(size)
        return pool

    def drop(self, pool: MemoryPool) -> None:
        """Forget a pool a failed test left memory in (closing it would report each leak
        again); the next test builds a fresh one."""
        self._by_size = {n: p for n, p in self._by_size.items() if p is not pool}

    def close(self) -> None:
        for pool in self._by_size.values():
            pool.close()


# --------------------------------------------------------------------------- the suite
class TierHarness:
    """The fixtures and helpers of the contract classes. A tier's test class composes the
    classes it should pass and provides the ``tier_spec`` fixture (a :class:`TierSpec`)."""

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(autouse=True)
    def _pool_invariants(self):
        """Fail the test during which a pool invariant broke (in any thread it started, or
        swallowed by a tier's ``except``): the leak check of every pool the suite makes."""
        earlier = invariants.take()  # not this test's: said, not pinned on it
        if earlier:
            warnings.warn(f"{len(earlier)} pool invariant violation(s) before this test:\n"
                          + "\n".join(earlier), stacklevel=1)
        made = invariants.pools_checked
        yield
        if invariants.pools_checked != made:
            gc.collect()  # objects dropped while referenced are reported when collected
        found = invariants.take()
        if found:
            pytest.fail(f"{len(found)} pool invariant violation(s):\n\n" + "\n\n".join(found),
                        pytrace=False)

    @pytest.fixture(autouse=True)
    def _lossy_tier(self, tier_spec: TierSpec):
        """A lossy spec's round trip is what every hit is checked against, in this test."""
        if tier_spec.lossy is None:
            yield
            return
        _lossy[:] = [tier_spec.lossy]
        _lossy_bytes.cache_clear()
        try:
            yield
        finally:
            _lossy.clear()
            _lossy_bytes.cache_clear()

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
                pool = new_pool(pool_bytes)
                own.append(pool)
            else:
                pool = pools.get(pool_bytes)
                others = [t.pool for t in made]  # type: ignore[attr-defined]
                assert pool not in others, "a test makes one tier per shared pool size"
            assert pool.used_bytes == 0, f"a pool of {pool_bytes} B starts with memory in use"
            config = CacheConfig(**{**tier_spec.settings(), **settings})
            tier = tier_spec.build(config, pool)
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
