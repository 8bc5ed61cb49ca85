"""A transfer whose copies complete late, and poison: the CPU stand-in for a GPU's
asynchronous copies, so CI catches an early release, an early read or a missing wait that
only a GPU would otherwise show.

:class:`LateTransfer` wraps a real transfer. ``gather``/``scatter`` return at once; one
background thread runs each copy after a random delay (calls complete out of order) and only
then marks its handle done. While a copy is in flight:

* its destinations hold poison (``0xFF`` bytes: NaN for every float dtype): the chunk buffers
  a gather fills, the KV slots a scatter writes. Whoever reads them before waiting reads NaN.
* the pool memory it uses must stay allocated: :func:`late_copies` poisons every pool object
  when it is freed and records a violation when a copy is still using its bytes.

:func:`poison_freed_blocks` does the same for an engine's KV blocks: a freed block is filled
with NaN, and freeing one while any copy is in flight is a violation (a step's copies must
have completed before its blocks are reused).

Use: the ``copies`` fixture (a module runs its tests with and without late copies); or
``with late_copies(seed) as watch:`` (every ``CacheEngine`` made inside gets a
``LateTransfer`` and strict release checks) then ``watch.check()``; or
``CacheEngine(transfer=late_factory(seed))`` for one engine.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

import lmc.cache_engine
from lmc.memory.pool import MemoryPool
from lmc.transfer import completion
from lmc.transfer.completion import Completion
from lmc.transfer.factory import make_transfer
from lmc.transfer.kv_spec import KVCaches, KVSpec
from lmc.transfer.plan import KVTransfer, TransferPlan
from lmc.transfer.torch_copy import TorchTransfer

POISON_BYTE = 0xFF
ACTIVE: Watch | None = None  # the Watch of the late_copies() block running now, if any
MAX_DELAY = 0.002  # seconds; late enough to reorder calls, short enough for CI


class LateCompletion(Completion):
    """Done only once the background thread has really performed the copy."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, stream: Any = None) -> None:  # CPU: the host is the stream
        if not self._event.wait(timeout=30):
            raise TimeoutError("a late copy never completed")
        if self.error is not None:
            raise self.error

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self._event.set()


class _Copy:
    """One in-flight copy: its handle and the pool byte ranges it uses."""

    def __init__(self, handle: LateCompletion, ranges: list[tuple[int, int]], what: str) -> None:
        self.handle = handle
        self.ranges = ranges
        self.what = what


class _Runner:
    """Each copy on its own timer thread: copies complete in any order, and one copy held
    back (``LateTransfer.hold``) never delays another."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: dict[int, _Copy] = {}

    def submit(self, delay: float, job: Callable[[], None]) -> None:
        t = threading.Timer(delay, job)
        t.daemon = True
        t.start()

    def overlapping(self, lo: int, hi: int) -> list[str]:
        with self.lock:
            copies = list(self.in_flight.values())
        return [c.what for c in copies if any(a < hi and lo < b for a, b in c.ranges)]

    def busy(self) -> list[str]:
        with self.lock:
            return [c.what for c in self.in_flight.values()]


RUNNER = _Runner()


def _ranges(bufs: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    return [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in bufs]


def _has_holes(plan: TransferPlan, i: int) -> bool:
    """Whether chunk ``i`` skips slots (those rows of its buffer must stay untouched)."""
    holes = getattr(plan, "holes", None)
    if holes:
        return bool(holes[i])
    return plan.chunks[i].mode == "masked"


class LateTransfer(KVTransfer):
    """``inner``'s copies, each completing after a random delay on a background thread."""

    def __init__(self, inner: KVTransfer, seed: int = 0, max_delay: float = MAX_DELAY) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.layers = inner.layers
        self.device = inner.device
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self._poison: dict[tuple, torch.Tensor] = {}
        self._handles: list[LateCompletion] = []
        # layers -> event: a copy of exactly these layers runs only once the event is set
        self.hold: dict[tuple[int, ...], threading.Event] = {}

    def plan(self, slots: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> TransferPlan:
        return self.inner.plan(slots, ranges)

    def record_event(self, stream: Any = None) -> Completion:
        return self.inner.record_event(stream)

    def _poison_buf(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (shape, dtype)
        t = self._poison.get(key)
        if t is None:
            t = self._poison[key] = torch.empty(shape, dtype=dtype)
            t.view(-1).view(torch.uint8).fill_(POISON_BYTE)
        return t

    def _launch(self, what: str, bufs: list[torch.Tensor], layers: list[int] | None,
                run: Callable[[], Any], after: Completion | None) -> LateCompletion:
        h = LateCompletion()
        copy = _Copy(h, _ranges(bufs), what)
        key = id(h)
        with RUNNER.lock:
            RUNNER.in_flight[key] = copy
        hold = self.hold.get(tuple(layers or ()))

        def job() -> None:
            err = None
            try:
                if hold is not None:
                    hold.wait(timeout=30)
                if after is not None:
                    after.wait()  # the copy stream waits for the engine's point
                run()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                err = e
            with RUNNER.lock:
                RUNNER.in_flight.pop(key, None)
            h._finish(err)

        self._handles.append(h)
        RUNNER.submit(self.rng.uniform(0, self.max_delay), job)
        return h

    def gather(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
               layers: Any = None, *, after: Completion | None = None,
               stream: Any = None, arrays: Any = None) -> Completion:
        bufs = list(bufs)
        lids = None if layers is None else list(layers)
        for i, b in enumerate(bufs):  # in flight: the destination holds garbage
            if b.numel() and not _has_holes(plan, i):
                for layer in range(b.shape[0]) if lids is None else lids:
                    b[layer].view(-1).view(torch.uint8).fill_(POISON_BYTE)
        return self._launch("gather", bufs, lids,
                            lambda: self.inner.gather(plan, bufs, lids).wait(), after)

    def scatter(self, plan: TransferPlan, bufs: Sequence[torch.Tensor],
                layers: Any = None, arrays: Sequence[np.ndarray] | None = None, *,
                after: Completion | None = None, stream: Any = None) -> Completion:
        bufs = list(bufs)
        lids = None if layers is None else list(layers)
        if bufs:  # in flight: exactly the slots it writes hold garbage
            self.inner.scatter(plan, [self._poison_buf(tuple(b.shape), b.dtype) for b in bufs],
                               lids).wait()
        return self._launch("scatter", bufs, lids,
                            lambda: self.inner.scatter(plan, bufs, lids).wait(), after)

    def synchronize(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            with contextlib.suppress(BaseException):
                h.wait()


def late_factory(seed: int = 0, max_delay: float = MAX_DELAY
                 ) -> Callable[[KVSpec, KVCaches], KVTransfer]:
    """For ``CacheEngine(transfer=...)``: the torch path, late."""
    rng = random.Random(seed)

    def make(spec: KVSpec, kv_caches: KVCaches) -> KVTransfer:
        return LateTransfer(TorchTransfer(spec, kv_caches), rng.randrange(2**32), max_delay)

    return make


class Watch:
    """What :func:`late_copies` saw; ``check()`` fails the test on any violation."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.violations: list[str] = []
        self.transfers = 0  # LateTransfer objects made

    def check(self) -> None:
        assert not self.violations, (f"late-copy violations (seed {self.seed}):\n"
                                     + "\n".join(self.violations[:10]))


@contextlib.contextmanager
def late_copies(seed: int, max_delay: float = MAX_DELAY) -> Iterator[Watch]:
    """Every ``CacheEngine`` made inside gets late, poisoning copies; pools poison freed
    objects and record frees under an in-flight copy; releasing a lease with a copy still
    in flight raises (strict mode)."""
    watch = Watch(seed)
    rng = random.Random(seed)
    real_make = make_transfer
    real_free = MemoryPool._free_locked

    def make(spec: KVSpec, kv_caches: KVCaches, prefer: Any = "auto") -> KVTransfer:
        watch.transfers += 1
        return LateTransfer(real_make(spec, kv_caches, prefer), rng.randrange(2**32), max_delay)

    real_free_many = MemoryPool._free_many_locked

    def check_free(pool: MemoryPool, obj: Any) -> None:
        if not pool.closed:
            lo = pool.buffer.data_ptr() + obj.offset
            users = RUNNER.overlapping(lo, lo + obj.nbytes)
            if users:
                watch.violations.append(f"pool memory of {obj!r} freed under an in-flight "
                                        f"{users[0]}")
            pool.buffer[obj.offset: obj.offset + obj.nbytes].fill_(POISON_BYTE)

    def free(pool: MemoryPool, obj: Any) -> None:
        check_free(pool, obj)
        real_free(pool, obj)

    def free_many(pool: MemoryPool, objs: list[Any]) -> None:  # batch releases
        for obj in objs:
            check_free(pool, obj)
        real_free_many(pool, objs)

    print(f"late copies: seed {seed} (LMC_LATE_SEED={seed} repeats it)")
    with _patched(lmc.cache_engine, "make_transfer", make), \
            _patched(MemoryPool, "_free_locked", free), \
            _patched(MemoryPool, "_free_many_locked", free_many), \
            _patched(completion, "STRICT", True), \
            _patched(sys.modules[__name__], "ACTIVE", watch):
        yield watch


def new_seed() -> int:
    """``LMC_LATE_SEED`` if set (to repeat a failure), else a fresh one (printed)."""
    env = os.environ.get("LMC_LATE_SEED")
    return int(env) if env else random.randrange(2**32)


@pytest.fixture(params=["now", "late"])
def copies(request: pytest.FixtureRequest) -> Iterator[Watch | None]:
    """Run a test with the engine's own transfer, then again with late, poisoning copies
    (``pytestmark = pytest.mark.usefixtures("copies")`` switches a whole module)."""
    if request.param == "now":
        yield None
        return
    with late_copies(new_seed()) as watch:
        yield watch
    watch.check()


def poison_freed_blocks(block_manager: Any, kv_caches: Sequence[torch.Tensor],
                        watch: Watch) -> None:
    """Fill a KV block with NaN when the engine frees it (vLLM flash layout, one tensor per
    layer); freeing any block while a copy is in flight is a violation."""
    real_free = block_manager.free

    def free(block_ids: Any) -> None:
        ids = list(block_ids)
        real_free(ids)
        busy = RUNNER.busy()
        if busy:
            watch.violations.append(f"KV blocks {ids[:4]} freed with {len(busy)} copies in "
                                    f"flight ({busy[0]})")
        freed = [b for b in ids if block_manager.ref_count(b) == 0]
        for t in kv_caches:
            t[:, freed] = float("nan")

    block_manager.free = free


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)
