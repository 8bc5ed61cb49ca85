"""Write-behind: chunks flow from L1 down to one lower tier on that tier's own thread.

Why: the engine's store must cost a memory copy, never a disk write or a network round trip,
and one slow tier must not hold back another. So each lower tier gets a queue and a writer
thread; ``offer`` only appends and never blocks (beyond a short lock).

The queue is bounded in **bytes** (the pool memory it keeps alive), not in items: chunk sizes
vary by model. When an offer would pass the bound the chunk is dropped and counted: it stays
in L1 (write-through) or is simply gone (write-on-evict), which costs a later recompute, never
a stall. With retention priorities (``rank``: the storage manager's,
:mod:`lmc.storage.priorities`) a full queue drops by the eviction rule instead: a chunk
offered takes the room of waiting chunks of a lower priority (the lowest, then the oldest,
first), which are dropped in its place; it is dropped itself only when nothing waiting ranks
below it. So a burst of low-priority traffic cannot keep a session's chunks off the disk. The queue holds one reference on each object it carries, so L1 eviction cannot free
memory the writer is still reading. Chunks waiting here can be served to readers
(:meth:`lookup`): under write-on-evict an evicted chunk is otherwise invisible until written.

The writer first asks ``tier.contains(keys)`` once per batch and skips what the tier already
holds, then hands the rest to ``tier.put(keys, objs)`` synchronously, from its thread: the
tier may take as long as it needs (and time out as it sees fit); the references are released
when ``put`` returns. ``put`` returns how many keys it stored; the rest count as dropped,
unless failed writes are retried (``retry_for`` seconds, off by default; the daemon turns it
on): then a chunk whose write failed (the tier says which by ``contains``) keeps its place,
its reference and its bytes in the queue and is written again after a doubling backoff, so a
transient failure (EMFILE while a connection flood holds the fds, a tier restarting) does not
lose a value the memory tier held, and the byte bound still caps what waits. Only when the
window has passed is it dropped and counted.

Holding off while the engine saves (``hold``, off by default: ``write_quiet_ms``). On a GPU
the engine's one Python thread launches every kernel, and each write's Python work (the
writer's and the tier's threads taking the GIL between their system calls) delays those
launches; a cold prefill saves layer by layer for its whole length, so writes started during
it are paid by its TTFT. With a :class:`QuietWindow` the writer waits, before each batch,
until the engine has not saved for ``quiet_s``, bounded three ways so nothing is lost to it:
never longer than ``max_hold`` seconds at a time on a non-empty queue, never while the queue
is more than half full (which would drop offers), never during ``flush`` or ``close``.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from lmc.memory.pool import MemoryObj
from lmc.metrics import TierMetrics
from lmc.priority import lower_thread_priority
from lmc.storage.tier import Key, StorageBackend

log = logging.getLogger(__name__)


class QuietWindow:
    """When the engine last saved (``touch``, from its thread: one clock read), and how long
    the writers should still hold off (:meth:`left`) for it to have been quiet ``quiet_s``."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = float(quiet_s)
        self._last = float("-inf")

    def touch(self) -> None:
        self._last = time.monotonic()

    def left(self) -> float:
        return self._last + self.quiet_s - time.monotonic()


class WriteBehind:
    """A byte-bounded queue of (key, object) feeding ``tier.put`` from one daemon thread."""

    def __init__(self, tier: StorageBackend, max_bytes: int, metrics: TierMetrics | None = None,
                 *, batch_chunks: int = 16, batch_bytes: int = 256 << 20) -> None:
        self.tier = tier
        self.max_bytes = int(max_bytes)
        self.metrics = metrics or TierMetrics(tier.name)
        self.batch_chunks = max(1, batch_chunks)
        self.batch_bytes = max(1, batch_bytes)
        self._q: deque[tuple[Key, MemoryObj]] = deque()
        self._pending: dict[Key, MemoryObj] = {}  # queued or being written
        self._bytes = 0  # bytes queued + being written
        self._inflight = 0
        self._writing: list[MemoryObj] = []  # the batch inside tier.put() now
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self.retry_for = 0.0  # seconds a failed write is retried; 0: dropped at once
        self._retry: list[tuple[float, int, Key, MemoryObj]] = []  # heap by due time
        self._failing_since: dict[Key, tuple[float, float]] = {}  # first failure, next delay
        self._seq = 0
        self.retried = 0
        self.on_dropped: Callable[[list[Key]], None] | None = None
        """Called with the keys a full queue refused (the hit-rate funnel's
        ``write_queue_full``: :mod:`lmc.storage.funnel`)."""
        self.rank: Callable[[Key], int | None] | None = None
        """A key's retention priority (None: 0), or None: no priorities (module doc)."""
        self.on_written: Callable[[list[Key]], None] | None = None
        """Called from the writer thread with the keys a ``put`` stored, once it returned
        (they are readable from the tier): the storage manager's listeners hook in here."""
        self._put_thread: int | None = None  # the writer's ident while inside tier.put()
        self._evicted_in_put: set[Key] = set()  # touched by the writer thread only
        self.hold: QuietWindow | None = None
        """Hold off while the engine saves (module doc); None: write at once."""
        self.max_hold = 2.0  # seconds the writer may stay idle on a non-empty queue
        self.held = 0  # times the writer held off (stats: write_held)
        self._waiting_since = 0.0  # when the queue's head started waiting for the writer
        self._flushing = 0

    # ----------------------------------------------------------------- producer side
    def offer(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        """Queue chunks for the tier without waiting; returns how many were accepted (a key
        already waiting counts as accepted). The rest are dropped and counted."""
        accepted = dropped = 0
        refused: list[Key] | None = [] if self.on_dropped is not None else None
        displaced: list[MemoryObj] = []
        below: list[tuple[int, int, Key]] | None = None  # waiting chunks, by rank
        with self._cv:
            if self._closed:
                self.metrics.dropped("closed", len(keys))
                return 0
            for k, o in zip(keys, objs, strict=True):
                if k in self._pending:
                    accepted += 1
                    continue
                if self._bytes + o.nbytes > self.max_bytes and self.rank is not None:
                    if below is None:
                        below = self._ranked_locked(self.rank)
                    self._displace_locked(below, self.rank(k) or 0, o.nbytes, displaced,
                                          refused)
                if self._bytes + o.nbytes > self.max_bytes:
                    dropped += 1
                    if refused is not None:
                        refused.append(k)
                    continue
                o.acquire()  # before the lock is released: the writer may run at once
                if not self._q:
                    self._waiting_since = time.monotonic()
                self._pending[k] = o
                self._q.append((k, o))
                self._bytes += o.nbytes
                accepted += 1
            if len(self._q):
                self._start_locked()
                self._cv.notify()
            depth = (self._bytes, len(self._pending))
        for o in displaced:
            o.release()
        self.metrics.dropped("queue_full", dropped + len(displaced))
        self.metrics.queue(*depth)
        if refused:
            self.on_dropped(refused)  # type: ignore[misc]  # set when refused is a list
        return accepted

    def _ranked_locked(self, rank: Callable[[Key], int | None]) -> list[tuple[int, int, Key]]:
        """The waiting chunks as (priority, place in the queue, key), the first to give up
        last (a list popped from its end): lowest priority, then oldest, first."""
        out = [(rank(k) or 0, i, k) for i, (k, _) in enumerate(self._q)]
        out.sort(reverse=True)
        return out

    def _displace_locked(self, below: list[tuple[int, int, Key]], prio: int, need: int,
                         displaced: list[MemoryObj], refused: list[Key] | None) -> None:
        """Drop waiting chunks of a priority below ``prio``, lowest first, until ``need``
        more bytes fit (or none is left below it); their objects go to ``displaced`` (the
        caller releases them outside the lock), their keys to ``refused``."""
        gone: set[Key] = set()
        while below and below[-1][0] < prio and self._bytes + need > self.max_bytes:
            k = below.pop()[2]
            o = self._pending.pop(k, None)
            if o is None:  # taken by the writer since the list was made
                continue
            self._bytes -= o.nbytes
            displaced.append(o)
            gone.add(k)
            if refused is not None:
                refused.append(k)
        if gone:
            self._q = deque(item for item in self._q if item[0] not in gone)

    def lookup(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        """Chunks still waiting to be written, acquired for the caller; ``None`` elsewhere."""
        with self._cv:
            if not self._pending:
                return [None] * len(keys)
            out = [self._pending.get(k) for k in keys]
            for o in out:
                if o is not None:
                    o.acquire()
        return out

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        p = self._pending
        return [k in p for k in keys]

    def discard_prefix(self, prefix: bytes = b"") -> int:
        """:meth:`discard` of every queued key starting with ``prefix`` (all: ``b""``)."""
        with self._cv:
            keys = [k for k in self._pending if k.startswith(prefix)]
        return self.discard(keys) if keys else 0

    def discard(self, keys: Sequence[Key]) -> int:
        """Forget queued (not yet in-flight) chunks, e.g. for a delete; returns how many."""
        gone: list[MemoryObj] = []
        with self._cv:
            drop = {k for k in keys if k in self._pending}
            if drop:
                keep: deque[tuple[Key, MemoryObj]] = deque()
                for k, o in self._q:
                    if k in drop:
                        del self._pending[k]
                        self._bytes -= o.nbytes
                        gone.append(o)
                    else:
                        keep.append((k, o))
                self._q = keep
                kept = [r for r in self._retry if r[2] not in drop]
                for _, _, k, o in self._retry:
                    if k in drop:
                        del self._pending[k]
                        self._bytes -= o.nbytes
                        gone.append(o)
                if len(kept) < len(self._retry):
                    self._retry = kept
                    heapq.heapify(self._retry)
                for k in drop:
                    self._failing_since.pop(k, None)
                self._cv.notify_all()
        for o in gone:
            o.release()
        return len(gone)

    # ------------------------------------------------------------------ writer side
    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"lmc-write-{self.tier.name}")
            self._thread.start()

    def _next_batch_locked(self) -> list[tuple[Key, MemoryObj]]:
        batch: list[tuple[Key, MemoryObj]] = []
        nbytes = 0
        while self._q and len(batch) < self.batch_chunks:
            if batch and nbytes + self._q[0][1].nbytes > self.batch_bytes:
                break
            item = self._q.popleft()
            batch.append(item)
            nbytes += item[1].nbytes
        self._inflight += len(batch)
        self._waiting_since = time.monotonic()  # the next head's wait starts now
        return batch

    def _held_locked(self) -> float:
        """Seconds to hold off before the next batch (0: write now): the engine is saving,
        within the bounds of the module doc."""
        hold = self.hold
        if hold is None or self._closed or self._flushing or self._bytes * 2 > self.max_bytes:
            return 0.0
        left = hold.left()
        if left <= 0:
            return 0.0
        return max(0.0, min(left, self._waiting_since + self.max_hold - time.monotonic()))

    def _run(self) -> None:
        lower_thread_priority()  # no request waits for a write-behind (lmc.priority)
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    if self._retry:
                        self._cv.wait(max(0.0, self._retry[0][0] - time.monotonic()))
                        self._due_locked()
                    else:
                        self._cv.wait()
                if not self._q:
                    return
                wait = self._held_locked()
                if wait > 0:
                    self.held += 1
                    self._cv.wait(wait)  # an offer, a flush or a close wakes it early
                    continue
                batch = self._next_batch_locked()
                self._writing = [o for _, o in batch]
            self._write(batch)

    def _absent(self, batch: list[tuple[Key, MemoryObj]]) -> list[tuple[Key, MemoryObj]]:
        """What the tier does not hold yet: one batched ``contains`` spares re-sending chunks
        another engine (or an earlier run) already wrote, e.g. a shared system prompt."""
        try:
            present = self.tier.contains([k for k, _ in batch])
        except Exception:  # let put() meet the error and count it
            return batch
        todo = [kv for kv, p in zip(batch, present) if not p]
        self.metrics.skipped_present(len(batch) - len(todo))
        return todo

    def _due_locked(self) -> None:
        """Move retries whose backoff has passed back into the queue."""
        now = time.monotonic()
        while self._retry and self._retry[0][0] <= now:
            _, _, k, o = heapq.heappop(self._retry)
            self._q.append((k, o))

    def _failed(self, todo: list[tuple[Key, MemoryObj]], stored: int | None
                ) -> list[tuple[Key, MemoryObj]]:
        """Which of ``todo`` the tier does not hold after a ``put`` that stored ``stored`` of
        them (``None``: it raised). Asked only when retrying is on: the count alone does not
        say which."""
        if stored is not None and stored >= len(todo):
            return []
        try:
            held = self.tier.contains([k for k, _ in todo])
        except Exception:
            return todo
        return [kv for kv, h in zip(todo, held) if not h]

    def _retry_or_drop(self, failed: list[tuple[Key, MemoryObj]]) -> int:
        """Under the lock: schedule the failed chunks still inside their retry window (they
        keep their reference, bytes and place in ``_pending``); returns how many were kept."""
        if self.retry_for <= 0 or self._closed:
            return 0
        now, kept = time.monotonic(), 0
        for k, o in failed:
            first, delay = self._failing_since.get(k, (now, 0.25))
            if now + delay - first > self.retry_for or k not in self._pending:
                self._failing_since.pop(k, None)
                continue
            self._failing_since[k] = (first, delay * 2)
            self._seq += 1
            heapq.heappush(self._retry, (now + delay, self._seq, k, o))
            kept += 1
        self.retried += kept
        return kept

    def _write(self, batch: list[tuple[Key, MemoryObj]]) -> None:
        keys = [k for k, _ in batch]
        t0 = time.perf_counter()
        todo: list[tuple[Key, MemoryObj]] = batch
        stored: int | None = None
        try:
            todo = self._absent(batch)
            if todo:
                self._put_thread = threading.get_ident()
                try:
                    stored = int(self.tier.put([k for k, _ in todo], [o for _, o in todo]))
                finally:
                    self._put_thread = None
                self.metrics.write(stored, sum(o.nbytes for _, o in todo[:stored]),
                                   time.perf_counter() - t0)
        except Exception as e:  # a failing tier loses these writes, never the writer thread
            reason = type(e).__name__
            if reason not in self._warned:
                self._warned.add(reason)
                log.warning("tier %s failed put() of %d chunks: %s (further %s errors are "
                            "only counted)", self.tier.name, len(keys), e, reason)
            self.metrics.error("put", reason)
        finally:
            exact = self.retry_for > 0 or (self.on_written is not None and bool(stored))
            failed = (self._failed(todo, stored) if exact else  # which, asked when it matters
                      (todo[stored:] if stored is not None else todo))
            if self._evicted_in_put or (self.on_written is not None and stored):
                self._report_written(todo, failed)  # before a flush() can return
            self._settle(batch, failed, stored is None)

    def note_evicted(self, keys: Sequence[Key]) -> None:
        """The tier dropped ``keys`` on its own. When that happened inside the ``put`` this
        writer is making (the disk tier evicts to make room, possibly a chunk of the same
        batch), those keys are not reported written: they are not readable."""
        if self.on_written is not None and self._put_thread == threading.get_ident():
            self._evicted_in_put.update(keys)

    def _report_written(self, todo: list[tuple[Key, MemoryObj]],
                        failed: list[tuple[Key, MemoryObj]]) -> None:
        lost = {k for k, _ in failed} | self._evicted_in_put
        self._evicted_in_put = set()
        written = [k for k, _ in todo if k not in lost] if todo is not failed else []
        hook = self.on_written
        if written and hook is not None:
            try:
                hook(written)
            except Exception as e:  # an observer's bug never stops the writer
                log.warning("write-behind listener failed: %s", e)

    def _settle(self, batch: list[tuple[Key, MemoryObj]], failed: list[tuple[Key, MemoryObj]],
                raised: bool) -> None:
        """Release what was written (or given up on), keep what will be retried."""
        with self._cv:
            retrying = self._retry_or_drop(failed)
            keep = {k for _, _, k, _ in self._retry} if retrying else set()
            done = [(k, o) for k, o in batch if k not in keep]
            for k, o in done:
                if self._pending.pop(k, None) is not None:
                    self._bytes -= o.nbytes
                self._failing_since.pop(k, None)
            self._inflight -= len(batch)
            self._writing = []
            depth = (self._bytes, len(self._pending))
            self._cv.notify_all()
        self.metrics.dropped("error" if raised else "rejected", len(failed) - retrying)
        for _, o in done:
            o.release()
        self.metrics.queue(*depth)

    def has_room(self, nbytes: int) -> bool:
        """Whether an offer of ``nbytes`` would be taken whole now (an empty queue takes
        anything its bound allows: a batch larger than the bound never waits for room)."""
        return self._closed or self._bytes + min(nbytes, self.max_bytes) <= self.max_bytes

    # ------------------------------------------------------------------- lifecycle
    @property
    def queued_bytes(self) -> int:
        return self._bytes

    @property
    def queued_chunks(self) -> int:
        return len(self._pending)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything offered so far is written (or failed); False on timeout."""
        with self._cv:
            self._flushing += 1  # a held writer writes now
            self._cv.notify_all()
            try:
                return self._cv.wait_for(lambda: not self._q and not self._inflight, timeout)
            finally:
                self._flushing -= 1

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; write what is queued (``drain``, up to ``timeout`` seconds), then
        drop the rest (counted as ``closed``) and stop the writer thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._closed = True  # retries waiting get one last try now (drained like the rest)
            self._q.extend((k, o) for _, _, k, o in sorted(self._retry))
            self._retry = []
            self._cv.notify_all()
        if drain and not self.flush(timeout):
            log.warning("tier %s: write-behind queue not drained within %.1f s; dropping %d "
                        "queued chunks", self.tier.name, timeout or 0.0, len(self._q))
        with self._cv:
            rest, self._q = list(self._q), deque()
            for k, o in rest:
                self._pending.pop(k, None)
                self._bytes -= o.nbytes
            self._cv.notify_all()
            thread = self._thread
        for _, o in rest:
            o.release()
        self.metrics.dropped("closed", len(rest))
        if thread is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(left)
            if thread.is_alive():
                log.warning("tier %s: writer still inside put() at close; left to finish",
                            self.tier.name)
                with self._cv:
                    writing = list(self._writing)
                if writing:  # its chunks are the writer's until put() returns, not leaks
                    writing[0].pool.leave_to_thread(writing)
        self.metrics.queue(self._bytes, len(self._pending))

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"queue_bytes": self._bytes, "queue_chunks": len(self._pending),
               "queue_limit_bytes": self.max_bytes}
        if self.retry_for > 0:
            out.update(write_retries=self.retried, retry_chunks=len(self._retry))
        if self.hold is not None:
            out["write_held"] = self.held
        return out
