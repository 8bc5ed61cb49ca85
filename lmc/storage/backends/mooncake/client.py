"""The Mooncake store client's lifecycle, owned by lmc: no call after or during ``close()``,
every call bounded by a deadline.

Why a guard: the library ends the process with a segfault on any call made on a client that
was closed or never set up, and on ``close()`` while another thread is inside a call. Its
calls also block far past ``remote_timeout``: about 4.3 s each while the master is dead,
the RPC timeout (30 s unless ``MC_RPC_TIMEOUT_MS`` says otherwise) while it is hung, and
``setup()`` about 4.4 s per try (20 tries by default) when no master answers.

So every library call runs on one of the guard's own worker threads, counted in flight;
the caller waits at most until its deadline and then gets :data:`TIMED_OUT` (a miss),
while the call goes on in its thread and releases what it holds (``on_abandon``) when the
library returns. ``setup()`` runs the same way, on a client object of its own per attempt.
``close()`` lets no new call start, waits for the calls in flight at most ``timeout``, and
leaves unregistering the buffers and the library's own ``close()`` to whoever ends the last
call (a non-daemon thread: interpreter exit waits for it, never cuts it short).
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# error codes (upstream mooncake-store types.h; those seen on 0.3.13 are in docs/threats/mooncake.md)
NO_SPACE = -200            # NO_AVAILABLE_HANDLE: no segment, or no room in any
INVALID = -600             # INVALID_PARAMS (also: buffer smaller than the object)
NOT_READY = -703           # REPLICA_IS_NOT_READY: a put still in flight
NOT_FOUND = -704           # OBJECT_NOT_FOUND
LEASED = -706              # OBJECT_HAS_LEASE (remove without force)
TRANSFER_FAIL = -800       # the holder of the segment did not answer (dead holder)
RPC_FAIL = -900            # the master did not answer (dead master)
RPC_TIMEOUT = -901         # the master did not answer in time (hung master)
MASTER_FAILURES = (RPC_FAIL, RPC_TIMEOUT)


class Outcome(enum.Enum):
    """Why a call did not run or did not finish in time: each is a miss for the tier."""

    TIMED_OUT = "timed_out"        # past the caller's deadline (it goes on in its thread)
    NOT_CONNECTED = "not_connected"  # no set-up client (yet, or the last setup failed)
    CLOSED = "closed"              # close() was called


TIMED_OUT, NOT_CONNECTED, CLOSED = Outcome.TIMED_OUT, Outcome.NOT_CONNECTED, Outcome.CLOSED


def default_environment(rpc_timeout: float, bind_address: str | None) -> dict[str, str]:
    """The library's environment settings lmc sets when the operator did not: one setup
    try (a missing master costs 4.4 s, not 90 s), master RPCs bounded by ``rpc_timeout``
    (a hung master costs that, not 30 s), INFO logs off, and in HTTP-metadata mode the
    transfer engine's address pinned to ``bind_address`` (else it advertises the first
    interface's). Process-wide: the first client set up in a process fixes them."""
    want = {"MC_STORE_CLIENT_SETUP_RETRIES": "1",
            "MC_RPC_TIMEOUT_MS": str(max(100, int(rpc_timeout * 1000))),
            "MC_LOG_LEVEL": "ERROR"}
    if bind_address:
        want["MC_TCP_BIND_ADDRESS"] = bind_address
    set_now = {k: v for k, v in want.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now


class _Call:
    """One library call handed to a worker: its result, or its abandonment by the caller."""

    __slots__ = ("fn", "deadline", "on_abandon", "lock", "done", "abandoned", "result",
                 "error", "event")

    def __init__(self, fn: Callable[[Any], Any], deadline: float,
                 on_abandon: Callable[[], None] | None) -> None:
        self.fn = fn
        self.deadline = deadline
        self.on_abandon = on_abandon
        self.lock = threading.Lock()
        self.done = self.abandoned = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.event = threading.Event()


class ClientGuard:
    """Owns one ``MooncakeDistributedStore``: set-up, the calls, the buffers, the close.

    ``setup(store) -> int`` sets a fresh client up (0 on success); ``buffers`` are the
    ``(pointer, size)`` regions registered once it is up and unregistered before it closes.
    ``workers`` bounds the threads (and so the calls) in the library at once.
    """

    def __init__(self, label: str, setup: Callable[[Any], int],
                 buffers: list[tuple[int, int]], timeout: float, workers: int = 4,
                 factory: Callable[[], Any] | None = None) -> None:
        self.label = label
        self._setup = setup
        self._buffers = buffers
        self.timeout = timeout
        self._factory = factory
        self._store: Any = None            # set once a setup succeeded
        self._connecting = False
        self._next_attempt = 0.0
        self._backoff = 0.5
        self._inflight = 0                 # worker calls and setups not returned yet
        self._closed = False
        self._torn_down = False
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._max_workers = workers
        self._calls = 0                    # worker calls queued or running
        _live.add(self)
        self.counts = {"timed_out": 0, "expired_in_queue": 0, "setups": 0,
                       "setup_failures": 0, "abandoned_running": 0}

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> bool:
        return self._store is not None and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    def inflight(self) -> int:
        with self._cond:
            return self._inflight

    # ------------------------------------------------------------------ set-up
    def connect(self, wait: float) -> bool:
        """Start a setup attempt unless one is running or the backoff has not elapsed, and
        wait for it at most ``wait`` seconds; whether the client is up."""
        with self._cond:
            if self._closed:
                return False
            if self._store is not None:
                return True
            start = not self._connecting and time.monotonic() >= self._next_attempt
            if start:
                self._connecting = True
                self._inflight += 1
        if start:
            threading.Thread(target=self._attempt, name="lmc-mooncake-setup",
                             daemon=False).start()
        if wait > 0:
            end = time.monotonic() + wait
            with self._cond:
                while self._connecting and not self._closed:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
        return self.ready

    def _attempt(self) -> None:
        store = None
        ok = False
        try:
            store = self._new_store()
            rc = self._setup(store)
            ok = rc == 0
            if ok:
                for ptr, size in self._buffers:
                    rc = store.register_buffer(ptr, size)
                    if rc != 0:
                        log.warning("mooncake tier %s: registering %d bytes failed (code %d); "
                                    "transfers from unregistered memory work over TCP only",
                                    self.label, size, rc)
            else:
                log.warning("mooncake tier %s: client setup failed (code %s); serving misses, "
                            "retrying in %.1f s", self.label, rc, self._backoff)
        except Exception as e:  # an ImportError, a bad argument: said once per attempt
            log.warning("mooncake tier %s: client setup failed (%s: %s)", self.label,
                        type(e).__name__, e)
        with self._cond:
            self._connecting = False
            self.counts["setups"] += 1
            if ok and not self._closed:
                self._store, self._backoff = store, 0.5
                store = None
            elif not ok:
                self.counts["setup_failures"] += 1
                self._next_attempt = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, 10.0)
            self._cond.notify_all()
        if store is not None:  # failed (calls on it answer -600, close() is safe), or closed
            with contextlib.suppress(Exception):
                if ok:
                    self._unregister(store)
                store.close()
        if ok and self._store is not None:
            log.info("mooncake tier %s: client set up", self.label)
        self._finish()

    def _new_store(self) -> Any:
        if self._factory is not None:
            return self._factory()
        from mooncake.store import (  # the optional wheel
            MooncakeDistributedStore,
        )
        return MooncakeDistributedStore()

    # ------------------------------------------------------------------ calls
    def call(self, fn: Callable[[Any], T], deadline: float,
             on_abandon: Callable[[], None] | None = None) -> T | Outcome:
        """``fn(store)`` on a worker thread, waited for until ``deadline``
        (``time.monotonic()``). Past it: :data:`TIMED_OUT`; the call goes on and runs
        ``on_abandon`` once the library returns (or at once if it never started). The
        library's exceptions (a pybind ``TypeError``: a bug) are re-raised here."""
        with self._cond:
            if self._closed:
                return CLOSED
            if self._store is None:
                return NOT_CONNECTED
            self._inflight += 1
            self._calls += 1
            if self._calls > len(self._workers) and len(self._workers) < self._max_workers:
                # non-daemon: interpreter exit joins it (after closing this guard, below)
                # instead of unloading the library while it is inside a call (SIGABRT)
                t = threading.Thread(target=self._work, name="lmc-mooncake", daemon=False)
                try:
                    t.start()
                except RuntimeError:  # interpreter shutdown: no new threads, no new calls
                    self._inflight -= 1
                    self._calls -= 1
                    return CLOSED
                self._workers.append(t)
        c = _Call(fn, deadline, on_abandon)
        self._queue.put(c)
        c.event.wait(max(0.0, deadline - time.monotonic()))
        with c.lock:
            if not c.done:
                c.abandoned = True
        if c.abandoned:
            with self._cond:
                self.counts["timed_out"] += 1
            return TIMED_OUT
        if c.error is not None:
            raise c.error
        return c.result

    def _work(self) -> None:
        while True:
            c = self._queue.get()
            if c is None:  # close(): this worker ends
                return
            self._run(c)

    def _run(self, c: _Call) -> None:
        store = self._store
        ran = False
        if time.monotonic() < c.deadline and not c.abandoned and store is not None:
            ran = True
            try:
                result, error = c.fn(store), None
            except BaseException as e:  # handed to the caller
                result, error = None, e
        else:
            result, error = TIMED_OUT, None
        with c.lock:
            abandoned = c.abandoned
            if not abandoned:
                c.result, c.error, c.done = result, error, True
        c.event.set()
        if abandoned:
            with self._cond:
                self.counts["abandoned_running" if ran else "expired_in_queue"] += 1
            if c.on_abandon is not None:
                try:
                    c.on_abandon()
                except Exception:
                    log.exception("mooncake tier %s: releasing an abandoned call's memory "
                                  "failed", self.label)
        self._finish(call=True)

    def _finish(self, call: bool = False) -> None:
        """One call or setup returned: the last one out after close() tears down."""
        with self._cond:
            self._inflight -= 1
            self._calls -= call
            last = self._closed and self._inflight == 0 and not self._torn_down
            if last:
                self._torn_down = True
            self._cond.notify_all()
        if last:
            self._teardown()

    # ------------------------------------------------------------------ close
    def close(self, inline: bool = False) -> None:
        """No call starts after this; calls in flight are waited for at most ``timeout``,
        the library is closed once the last returned (here, or by that call's thread).
        ``inline``: close the library on this thread (interpreter exit), not a new one."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            end = time.monotonic() + self.timeout
            while self._inflight:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            now = self._inflight == 0 and not self._torn_down
            if now:
                self._torn_down = True
            pending = self._inflight
        for _ in self._workers:
            self._queue.put(None)  # each worker ends once its queue is drained
        if now:
            self._teardown(inline)
        else:
            log.info("mooncake tier %s: closed with %d call(s) still inside the library; "
                     "the client closes when the last returns", self.label, pending)

    def _teardown(self, inline: bool = False) -> None:
        store, self._store = self._store, None
        if store is None:
            return

        def run() -> None:
            try:
                self._unregister(store)
                store.close()
            except Exception as e:
                log.warning("mooncake tier %s: closing the client failed (%s)", self.label, e)

        if inline:
            run()
            return
        # the library's close takes about a second, on a thread of its own (non-daemon, so
        # interpreter exit waits for it rather than unmapping under it). It holds the GIL
        # throughout (measured, Mooncake 0.3.13: every Python thread of the process stalls
        # ~0.93 s), so closing a set-up client costs the whole process that second wherever
        # it runs: lmc closes one only when the tier closes, never on a failed call
        # (calls time out and the breaker opens; the client stays)
        try:
            threading.Thread(target=run, name="lmc-mooncake-close", daemon=False).start()
        except RuntimeError:  # no new threads at interpreter shutdown: close here
            run()

    def _unregister(self, store: Any) -> None:
        for ptr, _size in self._buffers:
            store.unregister_buffer(ptr)


_live: weakref.WeakSet[ClientGuard] = weakref.WeakSet()


def _close_all() -> None:
    """Interpreter exit with a tier left open: close it before the interpreter joins its
    (non-daemon) threads -- idle workers then end, calls still inside the library return
    by themselves and the last one closes the client -- rather than in a destructor
    during finalization, with threads still inside the library."""
    for guard in list(_live):
        guard.close(inline=True)


# run before threading joins non-daemon threads (what concurrent.futures uses); plain
# atexit, which runs after that join, where the hook is missing
getattr(threading, "_register_atexit", atexit.register)(_close_all)
