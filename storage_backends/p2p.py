"""The peer-to-peer tier: a chunk another engine holds is READ from its pool into ours.

``tiers`` entry ``p2p+lmc://host:port[?ns=NAME]`` or ``p2p+unix:///path.sock``: the lmc
daemon at that address keeps the directory of who holds what (:mod:`lmc.p2p.directory`).

Owner side. Chunks reach this tier as every lower tier's do (``put`` from write-behind,
under write-through on every store): each is *exported*, i.e. the tier takes a reference on
L1's own object (no copy), gives it a slot in the version table with a fresh version, and
advertises ``(offset, length, slot, version, shape)`` on its membership connection. Exports
are bounded in bytes (``export_bytes``, half the pool by default, since exported
chunks cannot be evicted) and in time (``export_ttl`` seconds after they were exported,
swept by a timer): the oldest go first. Letting one go clears its slot *before* the
reference is released.

Reader side. ``contains`` asks the directory where each key lies; ``get`` allocates
destinations from the pool (which may evict L1), READs every chunk of one owner in one NIXL
transfer, then READs their version slots; a chunk is returned only if its slot still holds
the advertised version, i.e. the owner had not let the memory go when the payload READ
finished. A dead owner (its records vanish with its socket; a READ in flight fails), a slow
one (``remote_timeout`` deadline), an evicted chunk (version cleared) or a stale record:
misses, never wrong KV.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmc.breaker import CircuitBreaker
from lmc.config import CacheConfig
from lmc.memory import MemoryObj, MemoryPool
from lmc.p2p.agent import PoolAgent, TransferFailed
from lmc.p2p.directory_client import DirectoryConnection
from lmc.p2p.wire import BadRecord, PeerInfo, Record
from lmc.server.client import Address
from lmc.settings import parse_duration, parse_int, parse_opt_str, parse_size
from lmc.storage_backend import BackendOption, Key, StorageBackend, register_backend

log = logging.getLogger(__name__)
LOCATION_TTL = 1.0  # seconds a located record serves a following get without asking again


@dataclass
class _Export:
    obj: MemoryObj
    slot: int
    version: int
    at: float


def directory_url(spec: str, config: CacheConfig) -> str:
    """The daemon URL behind ``p2p+lmc://...`` / ``p2p+unix://...`` (or ``remote_url``)."""
    if spec.startswith("p2p+"):
        scheme, rest = spec[4:].split("://", 1)
        return ("lmc+unix" if scheme == "unix" else scheme) + "://" + rest
    if config.remote_url and config.remote_url.startswith(("lmc://", "lmc+unix://")):
        return config.remote_url
    raise ValueError(f"the p2p tier needs a directory: p2p+lmc://host:port or "
                     f"p2p+unix:///path (got {spec!r}, remote_url={config.remote_url!r})")


@register_backend("p2p", schemes=("p2p+lmc", "p2p+unix"))
class P2PBackend(StorageBackend):
    """Exports this engine's chunks and pulls other engines' over NIXL."""

    OPTIONS = {  # remote_options / ?name=value in the URL; defaults as in __init__
        "agent_name": BackendOption(None, parse_opt_str,
                                    "this engine's NIXL agent name (default: host, pid, random)"),
        "export_bytes": BackendOption(None, lambda v, k: None if v is None else parse_size(v, k),
                                      "bytes of exported chunks at most (default: half the pool)"),
        "export_ttl": BackendOption(600.0, lambda v, k: parse_duration(v, k, minimum=0.001),
                                    "seconds a chunk stays exported (pinned in the pool)"),
        "slots": BackendOption(1 << 16, lambda v, k: parse_int(v, k, minimum=1),
                               "version slots: chunks exported at once at most"),
    }

    def __init__(self, spec: str = "p2p", *, config: CacheConfig, pool: MemoryPool,
                 agent_name: str | None = None, export_bytes: int | None = None,
                 export_ttl: float = 600.0, slots: int = 1 << 16, **_: Any) -> None:
        url = directory_url(spec, config)
        self.address = Address.parse(url)
        self.namespace = self.address.namespace or config.remote_key_prefix
        self.pool = pool  # allocation (a TierPool evicts L1 to make room)
        # the one tier that needs the buffer itself: it registers the whole pool with NIXL
        self.raw: MemoryPool = getattr(pool, "raw", pool)
        self.timeout = config.remote_timeout
        self._token = config.remote_token
        self.export_bytes = self.raw.size // 2 if export_bytes is None else export_bytes
        if export_ttl <= 0:
            raise ValueError(f"export_ttl must be > 0 seconds, got {export_ttl}")
        self.export_ttl = export_ttl
        name = agent_name or f"lmc-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = PoolAgent(name, self.raw, slots)
        self.breaker = CircuitBreaker()
        self._lock = threading.RLock()
        self._exports: OrderedDict[Key, _Export] = OrderedDict()  # oldest first
        self._exported_bytes = 0
        self._free_slots = list(range(slots - 1, -1, -1))
        self._next_version = 1
        self._member: DirectoryConnection | None = None
        self._query: DirectoryConnection | None = None
        self._query_lock = threading.Lock()
        self._located: dict[Key, tuple[float, str, Record]] = {}
        self.counts = {"exported": 0, "withdrawn": 0, "expired": 0, "advertise_failures": 0,
                       "hits": 0, "misses": 0, "stale": 0, "transfer_failures": 0,
                       "bad_records": 0, "alloc_failures": 0, "bytes_in": 0,
                       "directory_failures": 0}
        # test seams: called with the owner's agent name before the payload READ and between
        # it and the version check (the tests kill or evict the owner exactly there)
        self.before_read: Callable[[str], None] | None = None
        self.after_read: Callable[[str], None] | None = None
        self._closed = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="lmc-p2p-expiry",
                                         daemon=True)
        self._sweeper.start()

    @property
    def agent_name(self) -> str:
        return self.agent.name

    def _conn(self) -> DirectoryConnection:
        return DirectoryConnection(self.address, self.namespace, self._token, self.timeout,
                                   f"lmc-p2p:{self.agent.name}")

    # ----------------------------------------------------------- owner side
    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        """Export L1's objects (a reference each, no copy) and advertise them."""
        if self._closed.is_set():
            return 0
        fresh: list[Record] = []
        gone: list[tuple[Key, _Export]] = []
        with self._lock:
            now = time.monotonic()
            gone += self._expire(now)
            for k, o in zip(keys, objs, strict=True):
                if o.pool is not self.raw:
                    raise ValueError(f"put of {o!r}: it belongs to another memory pool than "
                                     "this tier's (only pool memory is registered with NIXL)")
                held = self._exports.get(k)
                if held is not None:  # stored again: it stays exported for another ttl
                    held.at = now
                    self._exports.move_to_end(k)
                    continue
                if not self._free_slots:
                    gone += self._drop_oldest()
                if not self._free_slots:
                    break
                slot = self._free_slots.pop()
                version = self._next_version
                self._next_version += 1
                self.agent.versions[slot] = version
                self._exports[k] = _Export(o.acquire(), slot, version, now)
                self._exported_bytes += o.nbytes
                fresh.append(Record(k, o.offset, o.nbytes, version, slot, o.dtype,
                                    tuple(o.shape), o.num_tokens))  # type: ignore[arg-type]
                while self._exported_bytes > self.export_bytes and self._exports:
                    gone += self._drop_oldest()
            self.counts["exported"] += len(fresh)
            fresh = [r for r in fresh if r.key in self._exports]  # not already pushed out
        self._finish_withdraw(gone)
        if fresh:
            self._advertise(fresh)
        return len(keys)

    def _advertise(self, records: list[Record]) -> None:
        try:
            with self._lock:
                if self._member is None or self._member.closed:
                    self._rejoin()
                else:
                    self._member.advertise(records)
        except Exception as e:  # exported but not findable: give them back
            log.warning("p2p tier %s: advertising %d chunks failed: %s", self.agent.name,
                        len(records), e)
            self.counts["advertise_failures"] += 1
            self._close_member()
            self.delete([r.key for r in records])

    def _rejoin(self) -> None:
        """A new membership connection: join, then advertise every live export (the old
        connection's records went with it). Under ``_lock``."""
        self._close_member()
        m = self._conn()
        try:
            m.join(self.agent.info)
            m.advertise([Record(k, e.obj.offset, e.obj.nbytes, e.version, e.slot, e.obj.dtype,
                                tuple(e.obj.shape), e.obj.num_tokens)  # type: ignore[arg-type]
                         for k, e in self._exports.items()])
        except BaseException:
            m.close()
            raise
        self._member = m

    def _close_member(self) -> None:
        m, self._member = self._member, None
        if m is not None:
            m.close()

    def _take(self, k: Key) -> tuple[Key, _Export] | None:
        """Unexport ``k``: its slot is cleared now, before anyone can release its memory.
        Under ``_lock``; the caller releases the reference (``_finish_withdraw``)."""
        e = self._exports.pop(k, None)
        if e is None:
            return None
        self.agent.versions[e.slot] = 0
        self._free_slots.append(e.slot)
        self._exported_bytes -= e.obj.nbytes
        return k, e

    def _drop_oldest(self) -> list[tuple[Key, _Export]]:
        taken = self._take(next(iter(self._exports))) if self._exports else None
        return [taken] if taken else []

    def _expire(self, now: float) -> list[tuple[Key, _Export]]:
        out = []
        while self._exports:
            k, e = next(iter(self._exports.items()))
            if now - e.at < self.export_ttl:
                break
            out.append(self._take(k))
            self.counts["expired"] += 1
        return [t for t in out if t]

    def _finish_withdraw(self, gone: list[tuple[Key, _Export]]) -> None:
        """Release withdrawn exports' references (their slots are already cleared), then tell
        the directory (best effort: a stale record fails its reader's version check)."""
        if not gone:
            return
        for _, e in gone:
            e.obj.release()
        self.counts["withdrawn"] += len(gone)
        try:
            with self._lock:
                if self._member is not None and not self._member.closed:
                    self._member.withdraw([k for k, _ in gone])
        except Exception as e:
            log.info("p2p tier %s: withdraw not sent (%s); readers' version checks cover it",
                     self.agent.name, e)
            self._close_member()

    def _sweep_loop(self) -> None:
        period = min(self.export_ttl / 4, 5.0)
        while not self._closed.wait(period):
            with self._lock:
                gone = self._expire(time.monotonic())
            self._finish_withdraw(gone)

    def delete(self, keys: Sequence[Key]) -> int:
        with self._lock:
            gone = [t for t in (self._take(k) for k in keys) if t]
        self._finish_withdraw(gone)
        return len(gone)

    def exported(self, keys: Sequence[Key]) -> list[bool]:
        """Which keys this engine exports (owner side; ``contains`` asks about peers)."""
        with self._lock:
            return [k in self._exports for k in keys]

    # ---------------------------------------------------------- reader side
    def _ask(self, fn: Callable[[DirectoryConnection], Any], miss: Any) -> Any:
        """Run ``fn`` on the query connection; any failure is ``miss``."""
        if self._closed.is_set() or not self.breaker.allow():
            return miss
        with self._query_lock:
            try:
                if self._query is None or self._query.closed:
                    self._query = self._conn()
                out = fn(self._query)
            except Exception as e:
                log.warning("p2p tier %s: directory call failed: %s", self.agent.name, e)
                self.counts["directory_failures"] += 1
                if self._query is not None:
                    self._query.close()
                    self._query = None
                self.breaker.failure()
                return miss
        self.breaker.success()
        return out

    def _locate(self, keys: Sequence[Key], fresh: bool) -> list[tuple[str, Record] | None]:
        now = time.monotonic()
        out: list[tuple[str, Record] | None] = [None] * len(keys)
        todo = []
        for i, k in enumerate(keys):
            hit = None if fresh else self._located.get(k)
            if hit is not None and now - hit[0] < LOCATION_TTL:
                out[i] = (hit[1], hit[2])
            else:
                todo.append(i)
        if todo:
            got = self._ask(lambda c: c.locate([keys[i] for i in todo], self.agent.name),
                            [None] * len(todo))
            with self._query_lock:
                if len(self._located) > 1 << 16:
                    self._located.clear()
                for i, g in zip(todo, got):
                    out[i] = g
                    if g is not None:
                        self._located[keys[i]] = (now, g[0], g[1])
        return out

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return [g is not None for g in self._locate(keys, fresh=True)]

    def _peer(self, agent: str) -> PeerInfo | None:
        info = self.agent.knows(agent)
        if info is None:
            info = self._ask(lambda c: c.peer(agent), None)
            if info is None or info.agent != agent:
                return None
            try:
                self.agent.add_peer(info)
            except Exception as e:
                log.warning("p2p tier %s: peer %s not added: %s", self.agent.name, agent, e)
                return None
        return info

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = [None] * len(keys)
        if self._closed.is_set() or not keys:
            return out
        by_agent: dict[str, list[tuple[int, Record]]] = {}
        for i, g in enumerate(self._locate(keys, fresh=False)):
            if g is not None:
                by_agent.setdefault(g[0], []).append((i, g[1]))
        for agent, items in by_agent.items():
            self._pull(agent, items, out)
        hits = sum(o is not None for o in out)
        self.counts["hits"] += hits
        self.counts["misses"] += len(keys) - hits
        return out

    def _pull(self, agent: str, items: list[tuple[int, Record]],
              out: list[MemoryObj | None]) -> None:
        """READ one owner's chunks into fresh pool objects; keep those whose version held."""
        info = self._peer(agent)
        if info is None:
            self._forget_located(agent)
            return
        dst: list[tuple[int, Record, MemoryObj]] = []
        try:
            for i, rec in items:
                try:
                    info.check(rec)
                except BadRecord as e:
                    log.warning("p2p tier: bad record from %s: %s", agent, e)
                    self.counts["bad_records"] += 1
                    continue
                o = self.pool.allocate(rec.shape, rec.dtype, rec.num_tokens)
                if o is None:
                    self.counts["alloc_failures"] += 1
                    break
                dst.append((i, rec, o))
            if not dst:
                return
            deadline = time.monotonic() + self.timeout
            base = self.raw.buffer.data_ptr()
            if self.before_read is not None:
                self.before_read(agent)
            self.agent.read(info, [(base + o.offset, info.pool_base + r.offset, r.nbytes)
                                   for _, r, o in dst], deadline, hold=[o for *_, o in dst])
            if self.after_read is not None:
                self.after_read(agent)
            versions = self.agent.read_versions(info, [r.slot for _, r, _ in dst], deadline)
        except TransferFailed as e:
            log.info("p2p tier %s: %s; %d chunks are misses", self.agent.name, e, len(dst))
            self.counts["transfer_failures"] += 1
            self.agent.forget_peer(agent)
            self._forget_located(agent)
            for *_, o in dst:
                o.release()
            return
        except BaseException:
            for *_, o in dst:
                o.release()
            raise
        for (i, rec, o), v in zip(dst, versions):
            if v == rec.version:
                out[i] = o
                self.counts["bytes_in"] += rec.nbytes
            else:  # the owner let it go before our READ finished: its bytes prove nothing
                self.counts["stale"] += 1
                self._located.pop(rec.key, None)
                o.release()

    def _forget_located(self, agent: str) -> None:
        with self._query_lock:  # engine threads may be filling it meanwhile
            for k in [k for k, v in self._located.items() if v[1] == agent]:
                self._located.pop(k, None)

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Withdraw every export (slots cleared, references released), close the directory
        connections and the NIXL agent. End the process with ``os._exit`` afterwards (see
        :mod:`lmc.p2p.agent`)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            gone = [t for t in (self._take(k) for k in list(self._exports)) if t]
        for _, e in gone:
            e.obj.release()
        with self._lock:
            self._close_member()
        with self._query_lock:
            if self._query is not None:
                self._query.close()
        self.agent.close()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.counts, "exports": len(self._exports),
                    "exported_bytes": self._exported_bytes,
                    "quarantined": self.agent.quarantined,
                    **{f"breaker_{k}": v for k, v in self.breaker.stats().items()}}
