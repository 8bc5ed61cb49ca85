"""The peer-to-peer tier: a chunk another engine holds is READ from its pool into ours.

``tiers`` entry ``p2p+lmc://host:port[?ns=NAME]`` or ``p2p+unix:///path.sock``: the lmc
daemon at that address keeps the directory of who holds what (:mod:`lmc.server.p2p.directory`).

Owner side. Chunks reach this tier as every lower tier's do (``put`` from write-behind,
under write-through on every store): each is *exported*, i.e. copied into the tier's export
window (a pool of its own, ``export_bytes`` long, the only memory of this engine a peer can
READ: :mod:`lmc.storage.backends.p2p.agent`), checksummed (and tagged, with ``integrity_secret``), given a slot
in the version table with a fresh version, and advertised as ``(offset, length, slot,
version, shape, checksum, tag)`` on its membership connection, in this tier's namespace. The
window bounds exports in bytes; ``export_ttl`` bounds them in time (swept by a timer): the
oldest go first. Letting one go clears its slot *before* its window memory is released. A
chunk stored again is exported afresh (new copy, new version).

Reader side. ``contains`` asks the directory where each key lies (its holders in this
namespace, newest first) and takes the first record it has no reason to distrust. ``get``
checks each record against what this engine can use *before* allocating anything (at most
``chunk_size`` tokens; once the tier knows its engine's chunk geometry, given by
:func:`lmc.storage.integrity.expect_geometry` or learned from the engine's own stores, exactly that
geometry; before that, destinations come from free pool memory only, never by evicting L1), READs every chunk of one owner in one
NIXL transfer, READs their version slots, and keeps a chunk only if its slot still holds the
advertised version *and* its bytes verify like any shared tier's (the checksum always; the
keyed tag when ``integrity_secret`` is set, so an untagged record is a miss for a keyed
reader). A record failing either check is a miss, counted (``verify_failures``,
``refused``), and dropped: that (owner, version) is never read again, so the next lookup
takes the key's next holder. A dead owner (its records vanish with its socket; a READ in
flight fails), a slow one (``remote_timeout`` deadline), an evicted chunk (version cleared)
or a stale record: misses, never wrong KV. Threat model: ``docs/threats/p2p.md``.
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmc.config import CacheConfig
from lmc.lazy_import import LazyModule
from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.ratelog import RateLimitedWarnings
from lmc.settings import parse_duration, parse_int, parse_opt_str, parse_size
from lmc.storage.backends.p2p.agent import PoolAgent, TransferFailed
from lmc.storage.backends.p2p.directory_client import DirectoryConnection
from lmc.storage.backends.p2p.wire import BadRecord, PeerInfo, Record
from lmc.storage.backends.server.client import Address
from lmc.storage.breaker import CircuitBreaker
from lmc.storage.framing import ValueFraming
from lmc.storage.integrity import Geometry, Integrity
from lmc.storage.serde import HEADER_SIZE, CorruptValue, encodable
from lmc.storage.tier import (
    BackendOption,
    Key,
    Medium,
    StorageBackend,
    TierCapabilities,
    register_backend,
)

if TYPE_CHECKING:
    import torch
else:  # imported at first use (lmc.lazy_import says why)
    torch = LazyModule("torch", globals())

log = logging.getLogger(__name__)
LOCATION_TTL = 1.0  # seconds a located record serves a following get without asking again
MAX_DISTRUSTED = 4096  # (owner, version) records remembered as failing their checks
AGENT_STRIKES = 3  # records of one owner failing verification before all its records are
AGENT_DISTRUST_S = 60.0  # ... skipped for this long (a liar re-advertising cannot shadow
MAX_DISTRUSTED_AGENTS = 1024  # the honest holders of a key)
MAX_LEARNED = 8  # chunk geometries an engine's stores may teach the tier
Shape = tuple[int, int, int, "torch.dtype"]  # layers, planes, row width, dtype: all but tokens


def shape_class(shape: Sequence[int], dtype: torch.dtype) -> Shape:
    return (shape[0], shape[1], shape[3], dtype)


READ_GROUP_BYTES = 32 << 20  # a pull of more is READ in groups, verified as each lands
READ_GROUPS = 4
_VERIFIER: ThreadPoolExecutor | None = None
_VERIFIER_LOCK = threading.Lock()


def verifier() -> ThreadPoolExecutor:
    """The threads that verify pulled bytes (xxh3 releases the GIL: two cores hash), shared
    by the process's P2P tiers."""
    global _VERIFIER
    with _VERIFIER_LOCK:
        if _VERIFIER is None:
            _VERIFIER = ThreadPoolExecutor(2, thread_name_prefix="lmc-p2p-verify")
        return _VERIFIER


def read_groups(sizes: Sequence[int]) -> list[int]:
    """How many consecutive chunks each READ group holds: one group for a small pull, else
    up to :data:`READ_GROUPS` groups of about equal bytes (whole chunks each)."""
    total = sum(sizes)
    if total < READ_GROUP_BYTES or len(sizes) < 2:
        return [len(sizes)]
    want = min(READ_GROUPS, len(sizes))
    out: list[int] = []
    acc, count, target = 0, 0, total / want
    for n in sizes:
        acc += n
        count += 1
        if acc >= target * (len(out) + 1) and len(out) < want - 1:
            out.append(count)
            count = 0
    out.append(count)
    return [k for k in out if k]


def _settle(verdicts: dict[int, Future]) -> None:
    """Wait for every verification already submitted (they read the objects)."""
    for f in verdicts.values():
        if not f.cancel():  # already running or done: wait for it
            f.exception()


@dataclass
class _Export:
    obj: MemoryObj  # the copy in the export window
    slot: int
    version: int
    at: float
    record: Record
    released: bool = False  # its window memory already given back (only the withdraw left)


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

    medium = Medium.PEER
    capabilities = TierCapabilities(existence_without_reading=True)

    OPTIONS = {  # remote_options / ?name=value in the URL; defaults as in __init__
        "agent_name": BackendOption(None, parse_opt_str,
                                    "this engine's NIXL agent name (default: host, pid, random)"),
        "export_bytes": BackendOption(None, lambda v, k: None if v is None else parse_size(v, k),
                                      "bytes of the export window, the only memory peers can "
                                      "READ (default: half the pool)"),
        "export_ttl": BackendOption(600.0, lambda v, k: parse_duration(v, k, minimum=0.001),
                                    "seconds a chunk stays exported"),
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
        # the pool itself: registered with NIXL as the destination of this engine's READs
        self.raw: MemoryPool = getattr(pool, "raw", pool)
        self.timeout = config.remote_timeout
        self._token = config.remote_token
        self.integrity = Integrity.from_config(config)
        # the framing stage (lmc.storage.framing): a record carries the header's fields and,
        # with a secret, the keyed tag; a READ's bytes are checked by the same framing
        self.framing = ValueFraming(self.integrity)
        self.chunk_tokens = config.chunk_size
        self.export_bytes = self.raw.size // 2 if export_bytes is None else export_bytes
        if self.export_bytes < 4096:
            raise ValueError(f"export_bytes must be at least 4096 B (one page), got "
                             f"{self.export_bytes}")
        if export_ttl <= 0:
            raise ValueError(f"export_ttl must be > 0 seconds, got {export_ttl}")
        self.export_ttl = export_ttl
        name = agent_name or f"lmc-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.window = MemoryPool(self.export_bytes, config.pin_memory, prefault="off")
        try:
            self.agent = PoolAgent(name, self.raw, self.window, slots)
        except BaseException:
            self.window.close()
            raise
        self.breaker = CircuitBreaker()
        self._lock = threading.RLock()
        self._exports: OrderedDict[Key, _Export] = OrderedDict()  # oldest first
        self._free_slots = list(range(slots - 1, -1, -1))
        self._next_version = 1
        self._member: DirectoryConnection | None = None
        self._query: DirectoryConnection | None = None
        self._query_lock = threading.Lock()
        self._located: dict[Key, tuple[float, str, Record]] = {}
        self._distrusted: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._strikes: OrderedDict[str, tuple[int, float]] = OrderedDict()  # agent -> n, at
        self._warn = RateLimitedWarnings(limit=20, window=10.0, logger=log)
        # what this engine's chunks look like: given (lmc.storage.integrity.expect_geometry), else
        # learned from its own stores (bounded)
        self.expected_geometry: Geometry | None = None
        self._learned: set[Shape] = set()
        self._vouched: set[Shape] = set()  # shapes of tag-verified pulls: may evict L1 too
        self.counts = {"exported": 0, "withdrawn": 0, "expired": 0, "advertise_failures": 0,
                       "window_full": 0, "skipped": 0, "hits": 0, "misses": 0, "stale": 0,
                       "transfer_failures": 0, "bad_records": 0, "refused": 0,
                       "verify_failures": 0, "alloc_failures": 0, "bytes_in": 0,
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
    def _learn(self, o: MemoryObj) -> None:
        """What the engine stores is what it can use: a record of another geometry is then
        refused (until :attr:`expected_geometry` is given, which supersedes this)."""
        if len(self._learned) < MAX_LEARNED:
            self._learned.add(shape_class(o.shape, o.dtype))

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        """Export copies of the objects into the window and advertise them (the caller's
        objects are only read). A key stored again is exported afresh."""
        if len(keys) != len(objs):
            raise ValueError(f"put of {len(keys)} keys with {len(objs)} objects")
        if self._closed.is_set():
            return 0
        fresh: list[Record] = []
        gone: list[tuple[Key, _Export]] = []
        stored = 0
        with self._lock:
            gone += self._expire(time.monotonic())
            done: set[Key] = set()
            for k, o in zip(keys, objs):
                if not encodable(o):  # no header (hence no tag) describes it: not exported
                    self.counts["skipped"] += 1
                    continue
                stored += 1
                if k in done:
                    continue
                done.add(k)
                self._learn(o)
                rec = self._export(k, o, gone)
                if rec is not None:
                    fresh.append(rec)
            self.counts["exported"] += len(fresh)
            fresh = [r for r in fresh if r.key in self._exports]  # not already pushed out
        self._finish_withdraw(gone)
        if fresh:
            self._advertise(fresh)
        return stored

    def _export(self, k: Key, o: MemoryObj, gone: list[tuple[Key, _Export]]
                ) -> Record | None:
        """Copy ``o`` into the window under a fresh version; its record. Under ``_lock``."""
        old = self._take(k)
        if old is not None:  # replaced: the new record overrides it in the directory
            old[1].obj.release()
            old[1].released = True
        w = self.window.allocate(o.shape, o.dtype, o.num_tokens)
        while w is None and self._exports:
            for taken in self._drop_oldest():  # its slot is cleared: the room is free now
                taken[1].obj.release()
                taken[1].released = True
                gone.append(taken)
            w = self.window.allocate(o.shape, o.dtype, o.num_tokens)
        if w is None or not self._free_slots and not self._make_slot(gone):
            if w is not None:
                w.release()
            if old is not None:  # no new record overrides the old one: withdraw it
                gone.append(old)
            self.counts["window_full"] += 1
            return None
        if old is not None:
            self.counts["withdrawn"] += 1
        w.tensor.copy_(o.tensor)
        payload = w.byte_view()
        csum = self.framing.digest(payload)
        tag = self.framing.encode(k, w, payload, csum)[HEADER_SIZE:] if self.framing.tagged else None
        slot = self._free_slots.pop()
        version = self._next_version
        self._next_version += 1
        self.agent.versions[slot] = version
        rec = Record(k, w.offset, w.nbytes, version, slot, w.dtype,
                     tuple(w.shape), w.num_tokens, csum, tag)  # type: ignore[arg-type]
        self._exports[k] = _Export(w, slot, version, time.monotonic(), rec)
        return rec

    def _make_slot(self, gone: list[tuple[Key, _Export]]) -> bool:
        gone += self._drop_oldest()
        return bool(self._free_slots)

    def _advertise(self, records: list[Record]) -> None:
        """Advertise on the membership connection; while the directory keeps failing (the
        breaker the reader side shares), give the exports back at once instead of making
        every store wait ``remote_timeout``."""
        rejected = not self.breaker.allow()
        try:
            if rejected:
                raise ConnectionError("the directory is failing (circuit breaker open)")
            with self._lock:
                if self._member is None or self._member.closed:
                    self._rejoin()
                else:
                    self._member.advertise(records)
        except Exception as e:  # exported but not findable: give them back
            log.warning("p2p tier %s: advertising %d chunks failed: %s", self.agent.name,
                        len(records), e)
            self.counts["advertise_failures"] += 1
            if not rejected:
                self.breaker.failure()
            self._close_member()
            self.delete([r.key for r in records])
            return
        self.breaker.success()

    def _rejoin(self) -> None:
        """A new membership connection: join, then advertise every live export (the old
        connection's records went with it). Under ``_lock``."""
        self._close_member()
        m = self._conn()
        try:
            m.join(self.agent.info)
            m.advertise([e.record for e in self._exports.values()])
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
            if not e.released:
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
        """Each key's record to read: the newest holder's this tier does not distrust."""
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
                            [[]] * len(todo))
            with self._query_lock:
                if len(self._located) > 1 << 16:
                    self._located.clear()
                for i, holders in zip(todo, got):
                    g = next((h for h in holders if self._trusted(h[0], h[1], now)), None)
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
                self._warn("p2p tier %s: peer %s not added: %s", self.agent.name, agent, e)
                return None
        return info

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = [None] * len(keys)
        if self._closed.is_set() or not keys:
            return out
        first = self._locate(keys, fresh=False)
        stale = self._pull_all(list(enumerate(first)), out)
        if stale:  # a record located earlier went stale: the owner may have exported anew
            again = self._locate([keys[i] for i in stale], fresh=True)
            self._pull_all([(i, g) for i, g in zip(stale, again)
                            if g is not None and g != first[i]], out)
        hits = sum(o is not None for o in out)
        self.counts["hits"] += hits
        self.counts["misses"] += len(keys) - hits
        return out

    def _pull_all(self, located: list[tuple[int, tuple[str, Record] | None]],
                  out: list[MemoryObj | None]) -> list[int]:
        """Pull each located record into ``out``, one transfer per owner; the indices whose
        version had changed (stale)."""
        by_agent: dict[str, list[tuple[int, Record]]] = {}
        for i, g in located:
            if g is not None:
                by_agent.setdefault(g[0], []).append((i, g[1]))
        stale: list[int] = []
        for agent, items in by_agent.items():
            self._pull(agent, items, out, stale)
        return stale

    def _trusted(self, agent: str, rec: Record, now: float) -> bool:
        """Neither this record nor, lately, its owner failed a check. Under ``_query_lock``."""
        if (agent, rec.version) in self._distrusted:
            return False
        strikes = self._strikes.get(agent)
        return (strikes is None or strikes[0] < AGENT_STRIKES
                or now - strikes[1] >= AGENT_DISTRUST_S)

    def _distrust(self, agent: str, rec: Record, counter: str, why: object) -> None:
        """Drop a record that failed a check: never read that (owner, version) again; an
        owner whose records fail verification ``AGENT_STRIKES`` times is skipped for
        ``AGENT_DISTRUST_S`` seconds."""
        self._warn("p2p tier %s: record of %s from %s dropped: %s", self.agent.name,
                   rec.key.hex()[:12], agent, why)
        self.counts[counter] += 1
        with self._query_lock:
            self._distrusted[(agent, rec.version)] = None
            while len(self._distrusted) > MAX_DISTRUSTED:
                self._distrusted.popitem(last=False)
            if counter == "verify_failures":
                n = self._strikes.pop(agent, (0, 0.0))[0] + 1
                self._strikes[agent] = (n, time.monotonic())
                while len(self._strikes) > MAX_DISTRUSTED_AGENTS:
                    self._strikes.popitem(last=False)
            got = self._located.get(rec.key)
            if got is not None and got[1] == agent and got[2].version == rec.version:
                del self._located[rec.key]

    def _usable(self, agent: str, info: PeerInfo, rec: Record) -> bool:
        """Whether this engine could use the record's chunk, decided before any memory is
        allocated for it: inside the owner's window, at most ``chunk_size`` tokens, and this
        engine's geometry once the tier knows it."""
        try:
            info.check(rec)
            if self.expected_geometry is not None:
                self.expected_geometry.check(rec.shape, rec.dtype)
            elif rec.num_tokens > self.chunk_tokens:
                raise BadRecord(f"{rec.num_tokens} tokens, more than chunk_size "
                                f"{self.chunk_tokens}")
            elif self._learned and shape_class(rec.shape, rec.dtype) not in self._learned:
                raise BadRecord(f"shape {rec.shape} {rec.dtype} is not this engine's chunk")
        except (BadRecord, CorruptValue) as e:
            self._distrust(agent, rec, "refused", e)
            return False
        return True

    def _allocate(self, rec: Record) -> MemoryObj | None:
        """A destination; by evicting L1 only for a chunk of a known geometry (given, the
        engine's own stores', or one a verified tag vouched for), from free memory only
        otherwise, so no record can flush L1."""
        shape = shape_class(rec.shape, rec.dtype)
        known = (self.expected_geometry is not None or shape in self._learned
                 or shape in self._vouched)
        src: Any = self.pool if known else self.raw
        return src.allocate(rec.shape, rec.dtype, rec.num_tokens)

    def _verify(self, rec: Record, obj: MemoryObj) -> None:
        """The bytes READ are the chunk the record describes, as any shared tier checks a
        value: the record's header fields, its checksum, and with a secret its tag (an
        untagged record is a miss for a keyed reader, a tagged one for an unkeyed reader).
        Raises :class:`CorruptValue`."""
        framing = self.framing
        payload = obj.byte_view()
        head = framing.header(rec.key, rec.shape, rec.dtype, rec.num_tokens, payload,
                            checksum=rec.checksum, tagged=rec.tag is not None) + (rec.tag or b"")
        framing.verify(rec.key, head, framing.decode(head, rec.key), payload)

    def _pull(self, agent: str, items: list[tuple[int, Record]],
              out: list[MemoryObj | None], stale: list[int]) -> None:
        """READ one owner's chunks into fresh pool objects; keep those whose version held
        and whose bytes verify."""
        info = self._peer(agent)
        if info is None:
            self._forget_located(agent)
            return
        dst: list[tuple[int, Record, MemoryObj]] = []
        verdicts: dict[int, Future] = {}
        try:
            for i, rec in items:
                if not self._usable(agent, info, rec):
                    continue
                o = self._allocate(rec)
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
            # the READ in groups: each group's bytes are verified on the verifier threads
            # as it lands, while the later groups move (hashing after the whole READ made a
            # pull 0.5-0.6 of a raw NIXL READ)
            sizes = read_groups([r.nbytes for _, r, _ in dst])
            bounds = [sum(sizes[:g]) for g in range(len(sizes) + 1)]

            def landed(g: int) -> None:
                for k in range(bounds[g], bounds[g + 1]):
                    _, rec, o = dst[k]
                    verdicts[k] = verifier().submit(self._check, rec, o)

            self.agent.read(info, [(base + o.offset, info.pool_base + r.offset, r.nbytes)
                                   for _, r, o in dst], deadline, hold=[o for *_, o in dst],
                            groups=sizes, on_group=landed)
            if self.after_read is not None:
                self.after_read(agent)
            versions = self.agent.read_versions(info, [r.slot for _, r, _ in dst], deadline)
        except TransferFailed as e:
            log.info("p2p tier %s: %s; %d chunks are misses", self.agent.name, e, len(dst))
            self.counts["transfer_failures"] += 1
            self.agent.forget_peer(agent)
            self._forget_located(agent)
            _settle(verdicts)  # no verifier may still read an object released here
            for *_, o in dst:
                o.release()
            return
        except BaseException:
            _settle(verdicts)
            for *_, o in dst:
                o.release()
            raise
        for k, ((i, rec, o), v) in enumerate(zip(dst, versions)):
            out[i] = self._keep(agent, rec, o, v, verdicts[k].result())
            if v != rec.version:
                stale.append(i)

    def _check(self, rec: Record, obj: MemoryObj) -> CorruptValue | None:
        """:meth:`_verify`'s verdict as a value (run on the verifier threads)."""
        try:
            self._verify(rec, obj)
        except CorruptValue as e:
            return e
        return None

    def _keep(self, agent: str, rec: Record, o: MemoryObj, version: int,
              verdict: CorruptValue | None) -> MemoryObj | None:
        """``o`` if the chunk was still exported when READ and its bytes verified
        (``verdict`` None), else None (``o`` released). The version decides first: bytes
        the owner replaced mid-READ are stale, not a lie."""
        if version != rec.version:  # the owner let it go before our READ finished
            self.counts["stale"] += 1
            with self._query_lock:
                self._located.pop(rec.key, None)
            o.release()
            return None
        if verdict is not None:
            self._distrust(agent, rec, "verify_failures", verdict)
            o.release()
            return None
        if self.integrity is not None and len(self._vouched) < MAX_LEARNED:
            self._vouched.add(shape_class(o.shape, o.dtype))  # a secret-holder made it
        self.counts["bytes_in"] += rec.nbytes
        return o

    def _forget_located(self, agent: str) -> None:
        with self._query_lock:  # engine threads may be filling it meanwhile
            for k in [k for k, v in self._located.items() if v[1] == agent]:
                self._located.pop(k, None)

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Withdraw every export (slots cleared, references released), close the directory
        connections and the NIXL agent. End the process with ``os._exit`` afterwards (see
        :mod:`lmc.storage.backends.p2p.agent`)."""
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
        self.window.close()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.counts, "exports": len(self._exports),
                    "exported_bytes": self.window.used_bytes,
                    "distrusted": len(self._distrusted),
                    # tuple() copies in one step under the GIL: readers may be adding
                    "distrusted_agents": sum(n >= AGENT_STRIKES for n, _ in
                                             tuple(self._strikes.values())),
                    "geometry_known": self.expected_geometry is not None or bool(self._learned),
                    "quarantined": self.agent.quarantined,
                    **{f"breaker_{k}": v for k, v in self.breaker.stats().items()}}
