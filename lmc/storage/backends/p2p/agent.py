"""One NIXL agent per engine: its export window and version table published, its pool
registered for its own READs only, READs with a deadline.

What a peer can READ is exactly what the agent's metadata describes, and the metadata it
publishes (:attr:`PoolAgent.info`, handed out by the directory) covers two buffers only: the
*export window* (a pool of its own, ``export_bytes`` long, holding copies of the chunks this
engine exports, i.e. KV of its own namespace and nothing else) and the version table, a
small int64 array beside it (:mod:`lmc.storage.backends.p2p.wire` says what a slot means). The engine's memory
pool is registered too, as the destination of this engine's own READs, but left out of the
published metadata, so NIXL refuses a peer's READ of it (``NIXL_ERR_NOT_FOUND``), as it does
any span outside the window. A registered scratch array receives the slots a reader checks.
Threat model: ``docs/threats/p2p.md``.

A transfer that misses its deadline is asked to stop; until NIXL confirms it has, the
destination objects stay referenced (``quarantined``), so a late write can never land in
memory the pool has handed to someone else. NIXL is imported here only, and lazily, so
nothing else in lmc needs it.

Exit: a process that made a UCX-backed agent used to end with a segfault (rc 139) however it
ended. Measured cause (NIXL 1.5.1 wheels): UCX loads the wheel's own ``libnl-route-3`` and,
through the host's RDMA providers, the system's copy; the wheel copy's C destructor
(``rtnl_tc_unregister``, run by ``_dl_fini`` after the interpreter is gone) crashes, closed
agents or not. So the first agent registers :func:`_exit_cleanly` with ``atexit``: at a
normal exit it closes every live agent, runs the other exit functions, flushes, and ends the
process with the status the interpreter was about to return (``sys.exit``'s argument, 1
after an uncaught exception, else 0), skipping only the C library destructors.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmc.lazy_import import LazyModule
from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.storage.backends.p2p.wire import PeerInfo

if TYPE_CHECKING:
    import torch
else:  # imported at first use (lmc.lazy_import says why)
    torch = LazyModule("torch", globals())

log = logging.getLogger(__name__)
SCRATCH_SLOTS = 4096


def import_nixl() -> Any:
    """The ``nixl._api`` module, or an ImportError that says how to get it."""
    try:
        from nixl import _api
    except ImportError as e:
        raise ImportError("the p2p tier needs NIXL: pip install 'lmc-kvcache[nixl]' (or, "
                          "without CUDA packages, pip install --no-deps nixl nixl-cu12; see "
                          f"the README's P2P section): {e}") from e
    return _api


def _span(t: torch.Tensor) -> tuple[int, int, int, str]:
    """A registration descriptor for the whole of ``t`` (host memory)."""
    return (t.data_ptr(), t.numel() * t.element_size(), 0, "")


_LIVE: weakref.WeakSet[PoolAgent] = weakref.WeakSet()
_exit_status: list[object] = []  # what sys.exit was last called with
_hooked = False


def _hook_exit() -> None:
    """Once per process: remember ``sys.exit``'s status, and end cleanly at exit."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    real_exit = sys.exit

    def exit_noting_status(status: object = None) -> None:
        _exit_status[:] = [status]
        real_exit(status)  # type: ignore[arg-type]

    sys.exit = exit_noting_status  # type: ignore[assignment]
    atexit.register(_exit_cleanly)


def _status() -> int:
    """The exit status the interpreter would return now (as ``Py_RunMain`` computes it)."""
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception was printed
        return 1
    if not _exit_status:
        return 0
    code = _exit_status[0]
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # sys.exit("message"): the interpreter printed it; status 1


def _exit_cleanly() -> None:
    """Close live agents, run the remaining exit functions, flush, ``os._exit``."""
    for agent in list(_LIVE):
        with contextlib.suppress(Exception):
            agent.close()
    atexit.unregister(_exit_cleanly)
    atexit._run_exitfuncs()  # noqa: SLF001 - those registered before this one
    status = _status()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


class TransferFailed(Exception):
    """A READ ended in error or missed its deadline: the chunks it was for are misses."""


class PoolAgent:
    """Thread-safe (one lock around the agent): owners and readers share it."""

    def __init__(self, name: str, pool: MemoryPool, window: MemoryPool, slots: int = 1 << 16,
                 backends: Sequence[str] = ("UCX",)) -> None:
        api = import_nixl()
        self.name = name
        self.pool = pool
        self._lock = threading.RLock()
        # NIXL's progress thread is needed: without it a reader's first READ hangs in
        # connection set-up until the owner happens to progress its worker. Its cost: it
        # spins about one core even while idle (measured with NIXL 1.5.1 here)
        self.agent = api.nixl_agent(name, api.nixl_agent_config(backends=list(backends)))
        self.window = window
        self.versions = torch.zeros(slots, dtype=torch.int64)
        self._scratch = torch.zeros(SCRATCH_SLOTS, dtype=torch.int64)
        self._regs = []
        for t in (pool.buffer, window.buffer, self.versions, self._scratch):
            self._regs.append(self.agent.register_memory(self._descs(t)))
        published = self.agent.get_reg_descs([_span(window.buffer), _span(self.versions)],
                                             "DRAM")
        metadata = self.agent.get_partial_agent_metadata(published, True, list(backends))
        self.info = PeerInfo(name, bytes(metadata), window.buffer.data_ptr(), window.size,
                             self.versions.data_ptr(), slots)
        self._peers: dict[str, PeerInfo] = {}
        self._quarantine: list[tuple[Any, list[MemoryObj]]] = []
        self._stuck = 0  # transfers ever quarantined
        self.closed = False
        _LIVE.add(self)
        _hook_exit()

    def _descs(self, t: torch.Tensor) -> Any:
        return self.agent.get_reg_descs([_span(t)], "DRAM")

    # ------------------------------------------------------------ peers
    def knows(self, agent: str) -> PeerInfo | None:
        return self._peers.get(agent)

    def add_peer(self, info: PeerInfo) -> None:
        """Load a peer's metadata; ``ValueError`` if it describes another agent than the one
        it was joined as (loading it under that name would redirect our READs of that agent:
        the name is dropped again, and re-fetched from the directory when next needed)."""
        with self._lock:
            if self.closed:
                raise ValueError("the agent is closed")
            if info.agent in self._peers:
                return
            name = self.agent.add_remote_agent(info.metadata)
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            if name != info.agent:
                self._peers.pop(name, None)
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as e:
                    log.debug("remove_remote_agent(%s): %s", name, e)
                raise ValueError(f"the metadata of peer {info.agent!r} names agent {name!r}")
            self._peers[info.agent] = info

    def forget_peer(self, agent: str) -> None:
        """Drop a peer that failed a transfer: its next record is looked up afresh."""
        with self._lock:
            if self._peers.pop(agent, None) is not None and not self.closed:
                try:
                    self.agent.remove_remote_agent(agent)
                except Exception as e:  # already gone on NIXL's side
                    log.debug("remove_remote_agent(%s): %s", agent, e)

    # ------------------------------------------------------------ reads
    def read(self, peer: PeerInfo, pairs: Sequence[tuple[int, int, int]], deadline: float,
             hold: Sequence[MemoryObj] = (), groups: Sequence[int] | None = None,
             on_group: Callable[[int], None] | None = None) -> None:
        """READ ``(local_addr, remote_addr, nbytes)`` spans from ``peer`` by ``deadline``
        (``time.monotonic``); raises :class:`TransferFailed`. ``hold``: the destination
        objects, kept referenced if the transfer cannot be stopped after a timeout.
        ``groups``: sizes (in spans) of consecutive groups posted as transfers of their own,
        all at once; ``on_group(i)`` is called, in order, as soon as groups ``0..i`` have
        landed, while the later ones are still moving (a reader verifies what landed)."""
        sizes = [len(pairs)] if not groups else [k for k in groups if k > 0]
        if sum(sizes) != len(pairs):
            raise ValueError(f"READ groups of {sum(sizes)} spans for {len(pairs)} spans")
        with self._lock:
            if self.closed:
                raise TransferFailed("the agent is closed")
            self._drain_quarantine()
            a = self.agent
            handles: list[Any] = []
            states: list[str] = []
            try:
                at = 0
                for k in sizes:
                    part = pairs[at: at + k]
                    at += k
                    local = a.get_xfer_descs([(la, n, 0) for la, _, n in part], "DRAM")
                    remote = a.get_xfer_descs([(ra, n, 0) for _, ra, n in part], "DRAM")
                    try:
                        h = a.initialize_xfer("READ", local, remote, peer.agent)
                    except Exception as e:
                        raise TransferFailed(f"READ from {peer.agent} not started: {e}") from e
                    handles.append(h)
                    states.append(a.transfer(h))
                landed = 0
                spin = 0
                while landed < len(handles):
                    for i in range(landed, len(handles)):
                        if states[i] not in ("DONE", "ERR"):
                            states[i] = a.check_xfer_state(handles[i])
                        if states[i] == "ERR":
                            raise TransferFailed(f"READ from {peer.agent} failed")
                    while landed < len(handles) and states[landed] == "DONE":
                        if on_group is not None:
                            on_group(landed)
                        landed += 1
                    if landed < len(handles):
                        if time.monotonic() > deadline:
                            for i in range(landed, len(handles)):
                                self._abandon(handles[i], hold)
                            del handles[landed:]
                            raise TransferFailed(f"READ from {peer.agent} missed its deadline")
                        spin += 1
                        if spin > 64:  # a slow peer: stop burning a core on it
                            time.sleep(5e-5)
            except TransferFailed:
                raise
            except Exception as e:  # nixl raises its own types for a dead peer
                raise TransferFailed(f"READ from {peer.agent}: {e}") from e
            finally:
                for h in handles:
                    self._release(h, hold)

    def read_versions(self, peer: PeerInfo, slots: Sequence[int], deadline: float
                      ) -> list[int]:
        """The current values of ``slots`` in ``peer``'s version table (one READ per
        ``SCRATCH_SLOTS``), read only after every earlier READ completed."""
        out: list[int] = []
        with self._lock:  # the scratch array is shared
            for i in range(0, len(slots), SCRATCH_SLOTS):
                part = slots[i: i + SCRATCH_SLOTS]
                base = self._scratch.data_ptr()
                self._scratch[: len(part)].fill_(0)
                stuck = self._stuck
                try:
                    self.read(peer, [(base + 8 * j, peer.versions_addr + 8 * s, 8)
                                     for j, s in enumerate(part)], deadline)
                except TransferFailed:
                    if self._stuck > stuck:  # a late write may still land in the scratch
                        self._new_scratch()
                    raise
                out += self._scratch[: len(part)].tolist()
        return out

    def _new_scratch(self) -> None:
        """Stop using a scratch array a stuck READ may still write (a late version value
        there could pass a later check); the old one stays registered and alive."""
        self._scratch = torch.zeros(SCRATCH_SLOTS, dtype=torch.int64)
        self._regs.append(self.agent.register_memory(self._descs(self._scratch)))

    def _release(self, h: Any, hold: Sequence[MemoryObj]) -> None:
        try:
            self.agent.release_xfer_handle(h)
        except Exception as e:
            log.warning("NIXL transfer handle not released (%s): its destinations stay "
                        "quarantined", e)
            self._quarantine.append((h, [o.acquire() for o in hold]))
            self._stuck += 1

    def _abandon(self, h: Any, hold: Sequence[MemoryObj]) -> None:
        """A transfer past its deadline: try to stop it; if NIXL cannot yet, keep its
        destinations referenced until it can (retried before every later READ)."""
        self._release(h, hold)

    def _drain_quarantine(self) -> None:
        keep = []
        for h, objs in self._quarantine:
            try:
                self.agent.release_xfer_handle(h)
            except Exception:
                keep.append((h, objs))
                continue
            for o in objs:
                o.release()
        self._quarantine = keep

    @property
    def quarantined(self) -> int:
        return sum(len(o) for _, o in self._quarantine)

    def close(self) -> None:
        """Deregister everything and let the NIXL agent go (unless a transfer is still
        quarantined). Called at exit for agents still open (see the module docstring)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._drain_quarantine()
            for _h, objs in self._quarantine:  # never released: the pool must not reuse them
                log.warning("closing with a NIXL transfer still in flight; %d objects leak",
                            len(objs))
            for r in self._regs:
                try:
                    self.agent.deregister_memory(r)
                except Exception as e:
                    log.debug("deregister_memory: %s", e)
            self._regs = []
            self._peers.clear()
            if not self._quarantine:  # its progress thread spins ~half a core until freed
                self.agent = None
