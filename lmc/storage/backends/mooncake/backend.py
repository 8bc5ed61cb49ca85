"""``mooncake://MASTER:PORT``: a Mooncake Store cluster as a shared tier.

A Mooncake Store is a master (placement, leases, eviction) plus clients that contribute
memory segments; values move between clients' memory over a transfer engine (TCP here, RDMA
where there are NICs). This tier is one such client: it contributes ``segment`` bytes of its
own (0: a pure client) and reads and writes values straight between the cluster and lmc's
pool -- the pool is registered with the client once, values go with ``get_into_ranges`` /
``batch_put_from_multi_buffers`` from and into pool objects, no intermediate copy.

One value per chunk under ``{remote_key_prefix}/{key.hex()}``: the shared tiers' head
(:class:`lmc.storage.framing.ValueHead`: header with key, geometry and payload checksum; with
``integrity_secret`` the keyed tag) then the payload. A read takes the heads first (one
call for the batch), checks them (key, geometry before allocating), allocates, then reads the
payloads into the objects (one call) and verifies each (checksum, tag) before it is served;
a value failing a check is a miss, deleted (``force``: any read leases a value for 10 s).

Start-up: the constructor waits for the client's set-up (registering the pool and the
segment with the master), up to :data:`STARTUP_TIMEOUT`, not only ``remote_timeout``: under
load the set-up took 0.25-2.4 s here, and the README's second node, asking before its client
was set up, printed "cached tokens: 0" once in two runs. A miss that a call's deadline or a
client not yet set up caused is said once, at WARNING (lmc's loggers have no handler of
their own: a plain script prints it on stderr through Python's last-resort handler).

Failure policy (``docs/threats/mooncake.md``): the library's calls block for seconds on a dead
or hung master and it segfaults on a call after ``close()``, so every call goes through
:class:`.client.ClientGuard` (worker threads, a deadline per call, the lifecycle). ``get``,
``contains`` and ``delete`` end within ``remote_timeout``; ``put`` gets ``remote_timeout``
per part of ``put_part`` bytes. A timed-out call is a miss; the memory it reads into stays
referenced until the library returns. Master failures feed one circuit breaker; a dead
holder (``-800``), a value evicted between the two reads, a full cluster (``-200``) are
misses counted by cause, not breaker trips.
"""

from __future__ import annotations

import functools
import logging
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.settings import (
    ConfigError,
    parse_choice,
    parse_int,
    parse_opt_str,
    parse_positive_size,
    parse_size,
)
from lmc.storage.breaker import OPEN, CircuitBreaker
from lmc.storage.framing import ValueFraming
from lmc.storage.integrity import Geometry, Integrity
from lmc.storage.remote import Rejects, breaker_options
from lmc.storage.serde import CorruptValue, Header, encodable
from lmc.storage.tier import (
    BackendOption,
    Key,
    Medium,
    StorageBackend,
    TierCapabilities,
    register_backend,
)
from lmc.units import size as fmt_size

from . import client as C
from .client import ClientGuard, Outcome
from .heads import HeadArena

log = logging.getLogger(__name__)
DEFAULT_PORT = 50051
P2P = "P2PHANDSHAKE"


def parse_master(spec: str) -> tuple[str, int]:
    """``mooncake://host[:port]`` -> (host, port); anything else in the URL is refused."""
    parts = urlsplit(spec)
    if parts.scheme != "mooncake":
        raise ConfigError(f"mooncake tier: {spec!r} is not a mooncake://HOST:PORT URL")
    extra = [what for what, v in (("a path", parts.path.strip("/")), ("a query", parts.query),
                                  ("credentials", parts.username)) if v]
    if extra:
        raise ConfigError(f"mooncake tier: {spec!r} has {', '.join(extra)}; the URL names the "
                          f"master only (options go in the tier's entry or remote_options)")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as e:
        raise ConfigError(f"mooncake tier: bad port in {spec!r}: {e}") from e
    if not parts.hostname:
        raise ConfigError(f"mooncake tier: {spec!r} names no master host")
    return parts.hostname, port


def _metadata(value: Any, key: str) -> str:
    v = parse_opt_str(value, key) or P2P
    if v.upper() == P2P:
        return P2P
    if not v.startswith(("http://", "etcd://", "redis://")) and "://" in v:
        raise ConfigError(f"{key}: {v!r} is neither P2PHANDSHAKE nor a metadata server URL "
                          f"(http://host:port/metadata, etcd://..., redis://...)")
    return v


MIN_SEGMENT = 16 << 20  # the library refuses a smaller one (setup() returns -600)
STARTUP_TIMEOUT = 10.0  # seconds the constructor waits for the client's set-up at most
EVICTION_HIGH_WATERMARK = 0.9  # mooncake_master's default: it evicts past 90 % full


def _segment(value: Any, key: str) -> int:
    n = parse_size(value, key)
    if 0 < n < MIN_SEGMENT:
        raise ConfigError(f"{key}: {n} B is below Mooncake's smallest segment, "
                          f"{fmt_size(MIN_SEGMENT)} (or 0: contribute no memory)")
    return n


def local_address(host: str, port: int) -> str:
    """The address this host reaches the master from (what other clients must dial to
    reach this client's segment); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _port_open(host: str, port: int, timeout: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


@register_backend("mooncake", schemes=("mooncake",))
class MooncakeBackend(StorageBackend):
    """A Mooncake Store client behind a lifecycle guard and a circuit breaker."""

    medium = Medium.REMOTE
    capabilities = TierCapabilities(existence_without_reading=True, durable=False)

    OPTIONS = {  # the tier's entry / remote_options / ?name=value; defaults as in __init__
        "metadata": BackendOption(P2P, _metadata,
                                  "P2PHANDSHAKE, or the metadata server's URL "
                                  "(http://host:port/metadata)"),
        "segment": BackendOption(1 << 30, _segment,
                                 "bytes of memory this process contributes to the cluster "
                                 "(0: a pure client); mapped as values arrive"),
        "local_buffer": BackendOption(0, parse_size,
                                      "the client's staging buffer (lmc moves values "
                                      "zero-copy and needs none)"),
        "protocol": BackendOption("tcp", lambda v, k: parse_choice(v, k, ("tcp", "rdma")),
                                  "transfer protocol: tcp or rdma"),
        "devices": BackendOption("", lambda v, k: parse_opt_str(v, k) or "",
                                 "RDMA devices (protocol rdma), e.g. 'mlx5_0,mlx5_1'"),
        "host": BackendOption(None, parse_opt_str,
                              "this client's address as other clients dial it (default: "
                              "the address that reaches the master)"),
        "workers": BackendOption(4, lambda v, k: parse_int(v, k, minimum=1),
                                 "threads calling the library at once"),
        "replicas": BackendOption(1, lambda v, k: parse_int(v, k, minimum=1),
                                  "copies of each value, in different segments"),
        "put_part": BackendOption(64 << 20, parse_positive_size,
                                  "bytes of one put call (each gets remote_timeout)"),
        **breaker_options("the master's"),
    }

    def __init__(self, spec: str = "mooncake://127.0.0.1:50051", *, config: CacheConfig,
                 pool: MemoryPool, metadata: str = P2P, segment: int = 1 << 30,
                 local_buffer: int = 0, protocol: str = "tcp", devices: str = "",
                 host: str | None = None, workers: int = 4, replicas: int = 1,
                 put_part: int = 64 << 20, breaker_threshold: int = 3,
                 breaker_backoff: float = 0.25, breaker_max_backoff: float = 10.0,
                 store_factory: Callable[[], Any] | None = None, **_: Any) -> None:
        self.master = parse_master(spec)
        self.url = f"mooncake://{self.master[0]}:{self.master[1]}"
        here = host or local_address(*self.master)
        # before the library loads: it reads some of these once
        C.default_environment(config.remote_timeout, here if metadata != P2P else None)
        try:
            from mooncake.store import ReplicateConfig
        except ImportError as e:
            raise ConfigError(
                f"the mooncake tier needs the mooncake-transfer-engine-non-cuda package "
                f"(pip install mooncake-transfer-engine-non-cuda) and the libibverbs1 system "
                f"library: {e}") from e
        self.pool = pool
        self.raw: MemoryPool = getattr(pool, "raw", pool)
        self.timeout = config.remote_timeout
        self.prefix = config.remote_key_prefix + "/"
        self.framing = ValueFraming(Integrity.from_config(config))
        # the engine's chunk geometry (lmc.storage.integrity.expect_geometry): a head
        # describing another chunk is refused before anything is allocated for it
        self.expected_geometry: Geometry | None = None
        self.put_part = put_part
        self.replicate = ReplicateConfig()
        self.replicate.replica_num = replicas
        self.arena = HeadArena(self.framing.size)
        self._base = self.raw.buffer.data_ptr()
        self._counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._held: dict[int, list[MemoryObj]] = {}  # abandoned reads' objects, by call id
        self._held_lock = threading.Lock()
        self._next_id = 0

        self.breaker = CircuitBreaker(breaker_threshold, breaker_backoff, breaker_max_backoff,
                                      probe_timeout=max(5.0, 4 * self.timeout),
                                      on_change=self._breaker_changed)
        mhost, mport = self.master
        master_addr = f"{mhost}:{mport}"

        def setup(store: Any) -> int:
            if not _port_open(mhost, mport, self.timeout):  # setup() would block 4.4 s
                log.warning("mooncake tier %s: master not reachable; serving misses", self.url)
                return -1
            return int(store.setup(here, metadata, segment, local_buffer, protocol, devices,
                                   master_addr))

        buffers = [(self._base, self.raw.buffer.numel()), (self.arena.base, self.arena.size)]
        self.guard = ClientGuard(self.url, setup, buffers, self.timeout, workers,
                                 factory=store_factory)
        self.guard.connect(wait=max(self.timeout, STARTUP_TIMEOUT))
        self._said: set[str] = set()  # the kinds of miss already told (once each)
        log.info("mooncake tier %s: %s (segment %s contributed, %s, %s)", self.url,
                 "connected" if self.guard.ready else "not connected yet",
                 fmt_size(segment), protocol, "P2P handshake" if metadata == P2P else metadata)

    @classmethod
    def planner_capacity(cls, options: Mapping[str, Any]) -> int:
        """Bytes the planner simulates this tier as holding when not told the cluster's
        size: what this process contributes (``segment``) up to the master's eviction
        watermark -- all a one-engine trace can fill when this engine is the only holder."""
        segment = _segment(options.get("segment", cls.OPTIONS["segment"].default), "segment")
        return int(segment * EVICTION_HIGH_WATERMARK)

    # ------------------------------------------------------------------ helpers
    def remote_key(self, key: Key) -> str:
        return self.prefix + key.hex()

    def _count(self, **kv: int | float) -> None:
        with self._count_lock:
            self._counts.update(kv)

    def _breaker_changed(self, state: str) -> None:
        log.log(logging.WARNING if state == OPEN else logging.INFO,
                "mooncake tier %s: circuit breaker is now %s", self.url, state)

    def _may_call(self, end: float) -> bool:
        """Whether to call the library now: set up, open for calls, breaker closed. A call
        made while the client is being set up waits for it, within its own deadline (a
        setup under load can outlast the constructor's wait)."""
        if self.guard.closed:
            return False
        if not self.guard.ready and not self.guard.connect(wait=end - time.monotonic()):
            self._count(not_connected=1)  # a new attempt starts once its backoff elapsed
            self._miss_once("not_connected", "the client is not set up (yet, or its set-up "
                            "failed: see above)")
            return False
        if not self.breaker.allow():
            self._count(rejected_open=1)
            return False
        return True

    def _answered(self, r: Any, codes: Sequence[int] = ()) -> bool:
        """Feed the breaker from one call's outcome; whether the library answered at all."""
        if isinstance(r, Outcome):
            if r is C.TIMED_OUT:
                self.breaker.failure()
                self._count(timeouts=1)
                self._miss_once("timed_out", f"a call took longer than remote_timeout "
                                f"({self.timeout:g} s)")
            return False
        if codes and all(c in C.MASTER_FAILURES for c in codes):
            self.breaker.failure()
            self._count(master_failures=1)
            return False
        self.breaker.success()
        return True

    def _miss_once(self, kind: str, why: str) -> None:
        """One WARNING per tier and kind: a lookup that came back empty because of the
        store, not because nothing was stored, is never silent (later ones are counted)."""
        with self._count_lock:
            if kind in self._said:
                return
            self._said.add(kind)
        log.warning("mooncake tier %s: %s: its lookups miss and its stores are dropped; "
                    "later ones are counted (%s in stats)", self.url, why,
                    "timeouts" if kind == "timed_out" else kind)

    def _hold(self, objs: list[MemoryObj]) -> tuple[int, Callable[[], None]]:
        """Keep ``objs`` referenced for a call its caller may abandon: the call's id, and
        the release its worker runs once the library returned (if the caller gave up)."""
        with self._held_lock:
            self._next_id += 1
            cid = self._next_id
            self._held[cid] = objs

        def release() -> None:
            for o in self._unhold(cid):
                o.release()

        return cid, release

    def _unhold(self, cid: int) -> list[MemoryObj]:
        """The objects of call ``cid``, no longer listed as held by an abandoned call."""
        with self._held_lock:
            return self._held.pop(cid, [])

    def _classify(self, op: str, code: int) -> None:
        what = {C.NOT_FOUND: "vanished", C.TRANSFER_FAIL: "transfer_failed",
                C.NO_SPACE: "no_space", C.RPC_FAIL: "master_failed",
                C.RPC_TIMEOUT: "master_failed"}.get(code, f"code_{-code}")
        self._count(**{f"{op}_{what}": 1})

    # ------------------------------------------------------------------ reads
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        end = time.monotonic() + self.timeout
        if not keys or not self._may_call(end):
            return [False] * len(keys)
        rkeys = [self.remote_key(k) for k in keys]
        r = self.guard.call(lambda s: s.batch_is_exist(rkeys), end)
        if not self._answered(r, r if isinstance(r, list) else ()):
            return [False] * len(keys)
        self._count(contains_calls=1)
        return [c == 1 for c in r]  # type: ignore[union-attr]

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = [None] * len(keys)
        t0 = time.perf_counter()
        end = time.monotonic() + self.timeout
        if not keys or not self._may_call(end):
            return out
        rkeys = [self.remote_key(k) for k in keys]
        rejects: Rejects[str] = Rejects(f"mooncake tier {self.url}")
        heads = self._read_heads(rkeys, end)
        found: list[tuple[int, Header, bytes]] = []
        geometry = self.expected_geometry
        for i, (k, h) in enumerate(zip(keys, heads)):
            if isinstance(h, int):
                if h == C.INVALID:  # shorter than a head: not a value this tier wrote
                    rejects.reject(rkeys[i], "value shorter than its head", rkeys[i])
                elif h != C.NOT_FOUND:
                    self._classify("get", h)
                continue
            if h is None:
                continue
            try:
                hdr = self.framing.decode(h, k, geometry)
            except CorruptValue as e:
                rejects.reject(rkeys[i], e, rkeys[i])
                continue
            if hdr.payload_len > self.raw.size:  # never servable: refused, not allocated
                rejects.reject(rkeys[i], f"{hdr.payload_len} B value larger than the pool",
                               rkeys[i])
                continue
            found.append((i, hdr, h))
        todo = self._allocate(found)
        if todo:
            self._read_payloads(keys, rkeys, todo, end, rejects, out)
        bad = len(rejects)
        if bad:
            self._remove(rejects.take(), time.monotonic() + self.timeout)
        hits = sum(o is not None for o in out)
        self._count(get_calls=1, get_hit=hits, get_miss=len(keys) - hits, corrupt=bad,
                    bytes_read=sum(o.nbytes for o in out if o is not None),
                    get_seconds=time.perf_counter() - t0)
        return out

    def _allocate(self, found: list[tuple[int, Header, bytes]]
                  ) -> list[tuple[int, Header, bytes, MemoryObj]]:
        """A destination for each value, one ``allocate_many`` per run of equal chunks (a
        prompt's chunks but its last: one call, neighbouring blocks); fewer when the pool
        has no room (counted)."""
        out: list[tuple[int, Header, bytes, MemoryObj]] = []
        a = 0
        while a < len(found):
            hdr = found[a][1]
            b = a + 1
            while b < len(found) and found[b][1].shape == hdr.shape and \
                    found[b][1].dtype == hdr.dtype:
                b += 1
            objs = self.pool.allocate_many(hdr.shape, hdr.dtype, b - a, hdr.num_tokens)
            out += [(*f, o) for f, o in zip(found[a:b], objs)]
            if len(objs) < b - a:
                self._count(alloc_failures=b - a - len(objs))
            a = b
        return out

    def _read_heads(self, rkeys: list[str], end: float) -> list[bytes | int | None]:
        """Each key's head bytes, or its code (-704: absent), or None (not read in time)."""
        out: list[bytes | int | None] = [None] * len(rkeys)
        hs = self.framing.size
        per = self.arena.per_slab
        for a in range(0, len(rkeys), per):
            group = rkeys[a: a + per]
            n = len(group)
            slab = self.arena.take(end)
            if slab is None:
                self._count(heads_busy=1)
                return out
            ptr = self.arena.ptr(slab)
            give = self.arena.give
            dst = [[[i * hs] for i in range(n)]]

            def read(s: Any, p: int = ptr, g: list[str] = group, d: Any = dst,
                     n: int = n) -> Any:
                return s.get_into_ranges([p], [g], d, [[[0]] * n], [[[hs]] * n])

            def abandon(sl: int = slab) -> None:
                self.arena.give(sl)

            r = self.guard.call(read, end, on_abandon=abandon)
            if r is C.TIMED_OUT:  # the worker gives the slab back
                self._answered(r)
                return out
            if isinstance(r, Outcome):
                give(slab)
                return out
            try:
                codes = [rr[0] if rr else C.INVALID for rr in r[0]]
                if not self._answered(r, codes):
                    return out
                view = self.arena.view(slab, n)
                for j, c in enumerate(codes):
                    out[a + j] = bytes(view[j * hs:(j + 1) * hs]) if c == hs else c
            finally:
                give(slab)
        return out

    def _read_payloads(self, keys: Sequence[Key], rkeys: list[str],
                       todo: list[tuple[int, Header, bytes, MemoryObj]], end: float,
                       rejects: Rejects[str], out: list[MemoryObj | None]) -> None:
        objs = [t[3] for t in todo]
        names = [rkeys[t[0]] for t in todo]
        hs = self.framing.size
        dst = [[o.offset] for o in objs]
        sizes = [[o.nbytes] for o in objs]
        base = self._base
        cid, release = self._hold(objs)

        def read(s: Any) -> Any:
            return s.get_into_ranges([base], [names], [dst], [[[hs]] * len(names)], [sizes])

        r = self.guard.call(read, end, on_abandon=release)
        if r is C.TIMED_OUT:  # the objects stay referenced until the library returns
            self._answered(r)
            return
        self._unhold(cid)
        if isinstance(r, Outcome):
            for o in objs:
                o.release()
            return
        codes = [rr[0] if rr else C.INVALID for rr in r[0]]
        self._answered(r, codes)
        for (i, hdr, head, obj), code in zip(todo, codes):
            if code != obj.nbytes:
                obj.release()
                if code == C.INVALID:  # shorter than its head says: not what was written
                    rejects.reject(rkeys[i], "value shorter than its header says", rkeys[i])
                else:
                    self._classify("get", code)
                continue
            out[i] = rejects.verify(rkeys[i], obj,
                                    functools.partial(self.framing.verify, keys[i], head, hdr,
                                                      obj.byte_view()), rkeys[i])

    # ------------------------------------------------------------------ writes
    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        if len(keys) != len(objs):
            raise ValueError(f"put: {len(keys)} keys but {len(objs)} objects")
        ok = [i for i, o in enumerate(objs) if encodable(o)]
        if len(ok) < len(objs):  # what lmc.storage.serde cannot encode is skipped
            self._count(put_unsupported=len(objs) - len(ok))
        first: dict[Key, int] = {}
        for i in ok:  # a key twice in one batch is stored once
            first.setdefault(keys[i], i)
        idx = list(first.values())
        if not idx or not self._may_call(time.monotonic() + self.timeout):
            return 0
        t0 = time.perf_counter()
        stored_keys: set[Key] = set()
        a = 0
        while a < len(idx):
            b, nbytes = a, 0
            while b < len(idx) and b - a < self.arena.per_slab and (
                    b == a or nbytes + objs[idx[b]].nbytes <= self.put_part):
                nbytes += objs[idx[b]].nbytes
                b += 1
            part = idx[a:b]
            stored_keys.update(keys[i] for i, ok_ in zip(part, self._put_part(
                [keys[i] for i in part], [objs[i] for i in part])) if ok_)
            a = b
            if self.guard.closed or self.breaker.state == OPEN:
                break
        stored = sum(1 for i in ok if keys[i] in stored_keys)
        self._count(put_calls=1, put_stored=len(stored_keys),
                    put_failed=len(idx) - len(stored_keys),
                    bytes_written=sum(objs[i].nbytes for i in idx if keys[i] in stored_keys),
                    put_seconds=time.perf_counter() - t0)
        return stored

    def _put_part(self, keys: list[Key], objs: list[MemoryObj]) -> list[bool]:
        end = time.monotonic() + self.timeout
        n = len(keys)
        slab = self.arena.take(end)
        if slab is None:
            self._count(heads_busy=1)
            return [False] * n
        hs = self.framing.size
        view = self.arena.view(slab, n)
        for j, (k, o) in enumerate(zip(keys, objs)):
            view[j * hs:(j + 1) * hs] = self.framing.encode(k, o, o.byte_view())
        rkeys = [self.remote_key(k) for k in keys]
        ptrs = [[self.arena.ptr(slab, j), self._ptr(o)] for j, o in enumerate(objs)]
        sizes = [[hs, o.nbytes] for o in objs]
        held = [o.acquire() for o in objs]  # the library reads them until it returns
        _, release = self._hold(held)
        give = self.arena.give

        def abandon() -> None:
            release()
            give(slab)

        cfg = self.replicate

        def write(s: Any) -> Any:
            return s.batch_put_from_multi_buffers(rkeys, ptrs, sizes, cfg)

        r = self.guard.call(write, end, on_abandon=abandon)
        if r is C.TIMED_OUT:
            self._answered(r)
            return [False] * n
        release()
        give(slab)
        if isinstance(r, Outcome) or not self._answered(r, r):
            return [False] * n
        for c in r:
            if c != 0:
                self._classify("put", c)
        return [c == 0 for c in r]

    def _ptr(self, obj: MemoryObj) -> int:
        if obj.pool is self.raw:
            return self._base + obj.offset
        self._count(put_unregistered=1)  # another pool's object: fine over TCP only
        return int(obj.pool.buffer.data_ptr()) + obj.offset

    def delete(self, keys: Sequence[Key]) -> int:
        end = time.monotonic() + self.timeout
        if not keys or not self._may_call(end):
            return 0
        names = list(dict.fromkeys(self.remote_key(k) for k in keys))
        present = self._remove(names, end)
        self._count(delete_calls=1, deleted=len(present))
        return len(present)

    def clear_namespace(self, prefix: bytes = b"") -> list[Key] | None:
        """Every value under this tier's ``remote_key_prefix`` (or whose key starts with
        ``prefix``), leased ones too, by the library's regex removal within
        ``remote_timeout``; the library answers a count, not the keys (``None``). A clear
        that failed removed nothing as far as anyone can tell: ``[]`` (so no listener
        publishes a removal of values that are still there)."""
        end = time.monotonic() + self.timeout
        if not self._may_call(end):
            return []
        pattern = "^" + re.escape(self.prefix + prefix.hex())
        r = self.guard.call(lambda s: s.remove_by_regex(pattern, True), end)
        if self._answered(r) and isinstance(r, int) and r >= 0:
            self._count(cleared=r)
            return None
        log.warning("mooncake tier %s: clearing %r failed (%s)", self.url, pattern, r)
        return []

    def _remove(self, names: list[str], end: float) -> list[str]:
        """Remove ``names`` even while leased (any read leases a value for 10 s); the names
        that were there."""
        if not names or self.guard.closed:
            return []
        r = self.guard.call(lambda s: s.batch_remove(names, True), end)
        if not self._answered(r, r if isinstance(r, list) else ()):
            return []
        return [n for n, c in zip(names, r) if c == 0]  # type: ignore[arg-type]

    # ------------------------------------------------------------------ lifecycle
    def stats(self) -> dict[str, Any]:
        with self._count_lock:
            counts = dict(self._counts)
        return {"url": self.url, "connected": self.guard.ready,
                "breaker": self.breaker.stats(), "inflight": self.guard.inflight(),
                **{f"guard_{k}": v for k, v in self.guard.counts.items()}, **counts}

    def close(self) -> None:
        self.guard.close()
        with self._held_lock:  # abandoned reads still inside the library release these
            left = [o for objs in self._held.values() for o in objs]
        if left:
            self.raw.leave_to_thread(left)
