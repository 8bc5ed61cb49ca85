"""The ``lmc://`` tier: an engine's remote tier served by ``lmc server``.

``remote_url: lmc://host:port`` (TCP) or ``lmc+unix:///path/to.sock`` (same host), with
``?ns=NAME`` to pick the namespace (default: ``remote_key_prefix``) and ``remote_token`` for
the shared token. Every call is one batched, pipelined conversation; large batches are split
over up to ``connections`` connections in parallel (an option: ``ServerBackend.OPTIONS``).
Values travel from and into pool memory without intermediate copies (see
``lmc.storage.backends.server.client``).

Failure is a miss, never an exception: a call that fails or times out (``remote_timeout``
of inactivity) answers misses, and a circuit breaker then keeps calls off the network until
a trial call succeeds, so a dead or restarting server costs the engine nothing and the tier
comes back by itself.

With ``integrity_secret`` each chunk travels with a keyed tag stored as a companion value
(``tags``); a chunk whose tag is missing or does not verify is a miss and is deleted.
"""

from __future__ import annotations

import difflib
import functools
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.settings import parse_int, parse_opt_str
from lmc.storage.backends.server import protocol as P
from lmc.storage.backends.server.client import Address, Allocate, BlockMeta, ClientConnection
from lmc.storage.backends.server.probe import ProbePolicy
from lmc.storage.breaker import CLOSED, OPEN, CircuitBreaker
from lmc.storage.framing import ValueFraming
from lmc.storage.integrity import Geometry, Integrity
from lmc.storage.remote import Rejects, split_batch
from lmc.storage.serde import CorruptValue, encodable
from lmc.storage.tier import (
    BackendOption,
    Key,
    Medium,
    StorageBackend,
    TierCapabilities,
    register_backend,
)

from .tags import TAG_SHAPE, Tags, interleave, tag_dtype, tag_key

if TYPE_CHECKING:
    import torch

    from lmc.events.notes import ChunkNotes

log = logging.getLogger(__name__)
WARN_INTERVAL = 60.0  # seconds between repeated failure lines (the README: counted per interval)
T = TypeVar("T")
SPLIT_BYTES = 8 << 20  # batches larger than this go over several connections in parallel


@register_backend("server", schemes=("lmc", "lmc+unix"))
class ServerBackend(StorageBackend):
    """The server tier (``lmc://``): connections to one daemon, behind a circuit breaker."""

    medium = Medium.REMOTE
    capabilities = TierCapabilities(existence_without_reading=True, durable=True)
    block_notes: ChunkNotes | None = None
    """The seam for the daemon's KV events: set by :func:`lmc.events.notes.bind` (the engine's
    chunk notes, taken from then on). When set and the daemon's HELLO says it publishes
    events at this block size, each PUT carries the chunks' block info
    (``lmc.events.shared``); otherwise PUTs are unchanged, and each HELLO tells the notes
    what it said (:meth:`~lmc.events.notes.ChunkNotes.told`)."""
    block_notes_slot = 0  # this tier's number among those sharing the notes

    OPTIONS = {  # remote_options / ?name=value in the URL; defaults as in __init__
        "connections": BackendOption(4, lambda v, k: parse_int(v, k, minimum=1),
                                     "connections a batch over 8 MiB is split over"),
        "namespace": BackendOption(None, parse_opt_str,
                                   "the daemon namespace (default: ?ns= or remote_key_prefix)"),
        "client_name": BackendOption("lmc-engine", lambda v, k: parse_opt_str(v, k) or "lmc-engine",
                                     "how the daemon's log and STATS name this client"),
    }

    @classmethod
    def check_spec(cls, url: str) -> Address:
        """The URL alone: its form, and no query name but ``ns`` and the tier's options (a
        typo such as ``?conections=8`` is refused naming the closest, never ignored)."""
        known = ["ns", *cls.OPTIONS]
        for name in urllib.parse.parse_qs(urllib.parse.urlsplit(url).query,
                                          keep_blank_values=True):
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(f"remote_url {url!r}: the lmc:// tier has no option "
                                 f"{name!r}{hint} (its options: {', '.join(known)})")
        return Address.parse(url)

    def __init__(self, spec: str = "server", *, config: CacheConfig, pool: MemoryPool,
                 allocate: Allocate | None = None, namespace: str | None = None,
                 client_name: str = "lmc-engine", connections: int = 4) -> None:
        url = spec if "://" in spec else config.remote_url
        if not url:
            raise ValueError("the server tier needs remote_url: lmc://host:port or "
                             "lmc+unix:///path")
        self.address = self.check_spec(url)
        self.url = f"lmc://{self.address}"
        self.namespace = namespace or self.address.namespace or config.remote_key_prefix
        self.pool = pool
        self.allocate = allocate or pool.allocate
        # the framing stage (lmc.storage.framing): the daemon keeps each value's header; with
        # a secret, its keyed tag travels as a companion value (.tags)
        self.framing = ValueFraming(Integrity.from_config(config))
        self.tags = Tags(self.framing, self.allocate) if self.framing.tagged else None
        # the engine's chunk geometry (lmc.storage.integrity.expect_geometry): a value describing
        # another chunk is a bad value (refused, counted, deleted), like a checksum failure
        self.expected_geometry: Geometry | None = None
        self.size = connections
        self.timeout = config.remote_timeout
        self._token = config.remote_token
        self._client_name = client_name
        # a lost server must cost little: open after 2 failures, probe after 0.1 s doubling
        # to 2 s (docs/protocol.md); a probe outlives its own timeout only if it is lost
        self.breaker = CircuitBreaker(threshold=2, backoff=0.1, max_backoff=2.0,
                                      probe_timeout=max(5.0, 4 * self.timeout))
        self.probe = ProbePolicy()
        self._idle: list[ClientConnection] = []
        self._open = 0
        self._cond = threading.Condition()
        self._exec: ThreadPoolExecutor | None = None
        self._closed = False
        self._last_warn = float("-inf")
        self._unlogged = 0  # failures since the last warning line, told with the next one
        self._last_refusal = -1e9
        self._count_lock = threading.Lock()
        self.counts = {"calls": 0, "failures": 0, "skipped_open": 0, "hits": 0, "misses": 0,
                       "stored": 0, "not_stored": 0, "corrupt": 0, "alloc_failures": 0,
                       "bytes_in": 0, "bytes_out": 0, "cleared": 0}

    def _count(self, **kv: int) -> None:
        with self._count_lock:
            for k, v in kv.items():
                self.counts[k] += v

    # ------------------------------------------------------- connections
    def _connect(self) -> ClientConnection:
        conn = ClientConnection(self.address, self._token, self.timeout, self._client_name)
        ev = getattr(conn, "kv_events", None)
        if self.block_notes is not None:  # keep noting while a daemon publishes at our size
            publishes = isinstance(ev, dict) and ev.get("block_size") == self.block_notes.block_size
            self.block_notes.told(self.block_notes_slot, publishes)
        return conn

    def _acquire(self) -> ClientConnection:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if self._closed:
                    raise ConnectionError("server tier closed")
                if self._idle:
                    return self._idle.pop()
                if self._open < self.size:
                    self._open += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise TimeoutError(f"no free connection to {self.address} "
                                       f"within {self.timeout} s")
        try:
            return self._connect()
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise

    def _release(self, conn: ClientConnection, ok: bool) -> None:
        stale: list[ClientConnection] = []
        with self._cond:
            if ok and not self._closed and not conn.closed:
                self._idle.append(conn)
            else:
                conn.close()
                self._open -= 1
                if not ok:  # the others were made to the same (maybe restarted) server
                    stale, self._idle = self._idle, []
                    self._open -= len(stale)
            self._cond.notify_all()
        for c in stale:
            c.close()

    def _call(self, what: str, fn: Callable[[ClientConnection], T], miss: T) -> T:
        """Run ``fn`` on a pooled connection; any failure is ``miss`` (and a breaker tick)."""
        if self._closed:  # a miss, not a failure: no breaker trip, no 'server failed' warning
            return miss
        if not self.breaker.allow():
            self._count(skipped_open=1)
            return miss
        self._count(calls=1)
        conn = None
        try:
            conn = self._acquire()
            out = fn(conn)
        except Exception as e:  # socket, timeout, protocol or server error: all misses
            if conn is not None:
                self._release(conn, ok=False)
            self._failed(what, e)
            return miss
        self._release(conn, ok=True)
        if self.breaker.state != CLOSED:
            log.info("server tier %s is answering again; circuit closed", self.url)
        self.breaker.success()
        return out

    def _failed(self, what: str, e: Exception) -> None:
        """Count a failed call; warn on the first, when the circuit first opens, and then at
        most once a minute with how many failed since (a dead daemon's probes fail every 2 s:
        a line each was the log growing at the daemon's pace)."""
        self._count(failures=1)
        was_closed = self.breaker.state == CLOSED
        self.breaker.failure(e)
        now = time.monotonic()
        opened = was_closed and self.breaker.state == OPEN
        with self._count_lock:
            if not opened and now - self._last_warn < WARN_INTERVAL:
                self._unlogged += 1
                return
            since, self._unlogged, self._last_warn = self._unlogged, 0, now
        log.warning("server tier %s: %s failed (%s: %s); serving misses%s%s", self.url, what,
                    type(e).__name__, e, ", circuit open" if self.breaker.state == OPEN else "",
                    f" ({since} more failed calls since the last line)" if since else "")

    def _parallel(self, parts: list[tuple[int, int]], run: Callable[[int, int], T]) -> list[T]:
        if len(parts) == 1:
            return [run(*parts[0])]
        if self._closed:  # no executor after close(): each part fails alone, a miss
            return [run(a, b) for a, b in parts]
        if self._exec is None:
            with self._cond:
                if self._exec is None:
                    self._exec = ThreadPoolExecutor(self.size, thread_name_prefix="lmc-remote")
        rest: list[Callable[[], T]] = []
        for a, b in parts[1:]:
            try:
                rest.append(self._exec.submit(run, a, b).result)
            except RuntimeError:  # close() shut the executor down: the part runs here (a miss)
                rest.append(functools.partial(run, a, b))
        first = run(*parts[0])  # the caller's thread does a share too
        return [first, *(r() for r in rest)]

    def _split(self, weights: Sequence[int]) -> list[tuple[int, int]]:
        """Contiguous parts of about equal weight, at most one per connection, none under
        ``SPLIT_BYTES`` (a small batch stays one round trip)."""
        return split_batch(weights, min(self.size, max(1, sum(weights) // SPLIT_BYTES)))

    # ------------------------------------------------------------- reads
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        if not keys:
            return []
        return self._call("contains", lambda c: c.contains(self.namespace, keys),
                          [False] * len(keys))

    def prefix_hits(self, keys: Sequence[Key]) -> int:
        if not keys:
            return 0
        return self._call("prefix_hits", lambda c: c.prefix_hits(self.namespace, keys), 0)

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        """Values whose checksum (and with a secret, keyed tag) verifies; the others are
        misses, deleted after the call (verify-or-delete, :class:`lmc.storage.remote.Rejects`)."""
        if not keys:
            return []
        rejects: Rejects[Key] = Rejects(f"server tier {self.url}")
        geometry = self.expected_geometry
        too_large = [0]
        if self.tags is None:
            got = self._get_values(keys, rejects, geometry, too_large)
            tags: list[MemoryObj | None] = [None] * len(keys)
        else:  # chunks with their tags, in one call
            both = self._get_values(interleave(keys), rejects, geometry, too_large, tags=True)
            got, tags = both[1::2], both[0::2]
        out: list[MemoryObj | None] = []
        for key, obj, tag in zip(keys, got, tags):
            if obj is not None:  # every value through the framing: geometry, then the tag
                obj = rejects.verify(key, obj, functools.partial(self._admit, key, obj, tag,
                                                                 geometry))
            if tag is not None:
                tag.release()
            out.append(obj)
        self._count(corrupt=rejects.delete_with(self.delete) + too_large[0])
        hits = sum(o is not None for o in out)
        self._count(hits=hits, misses=len(out) - hits,
                    bytes_in=sum(o.nbytes for o in out if o is not None))
        return out

    def _admit(self, key: Key, obj: MemoryObj, tag: MemoryObj | None,
               geometry: Geometry | None) -> None:
        """The framing's word on a value the client received (its checksum verified as it
        arrived): the engine's geometry and, with a secret, the companion tag. Raises
        :class:`CorruptValue`."""
        if tag is not None and (tuple(tag.shape) != TAG_SHAPE or tag.dtype != tag_dtype()):
            raise CorruptValue(f"integrity tag has shape {tuple(tag.shape)} of {tag.dtype}")
        self.framing.admit(key, obj, None if tag is None else tag.byte_view(), geometry)

    def _get_values(self, keys: Sequence[Key], rejects: Rejects[Key],
                    geometry: Geometry | None = None, too_large: list[int] | None = None,
                    tags: bool = False) -> list[MemoryObj | None]:
        # sizes are unknown before the answer: assume equal chunks, split by count
        parts = self._split([SPLIT_BYTES // 4] * len(keys)) if len(keys) >= 8 else [(0, len(keys))]
        allocate = self._allocate if geometry is None else self._bounded(geometry, too_large,
                                                                         tags)

        def corrupt(key: Key) -> None:
            rejects.reject(key, "payload checksum mismatch", key.hex())

        def run(a: int, b: int) -> list[MemoryObj | None]:
            return self._call("get", lambda c: c.get(self.namespace, keys[a:b], allocate,
                                                     on_corrupt=corrupt),
                              [None] * (b - a))

        return [o for part in self._parallel(parts, run) for o in part]

    def _bounded(self, geometry: Geometry, too_large: list[int] | None, tags: bool
                 ) -> Allocate:
        """``_allocate`` that refuses, before allocating, a value larger than the engine's
        largest chunk (or, for a tag, than a tag): a forged header cannot make a read evict
        L1 for it. Such a value is counted as corrupt and is a miss; the daemon's client
        does not say its key, so it is not deleted (every value within the bound is
        checked after the read, and deleted when it does not fit)."""
        limit = max(geometry.max_bytes, 4096 if tags else 0)

        def allocate(shape: Sequence[int], dtype: torch.dtype, num_tokens: int
                     ) -> MemoryObj | None:
            n = dtype.itemsize
            for d in shape:
                n *= int(d)
            if n > limit:
                if too_large is not None:
                    too_large[0] += 1
                now = time.monotonic()
                if now - self._last_refusal > 5.0:  # logs stay bounded under a flood
                    self._last_refusal = now
                    log.warning("server tier %s: a value of %d bytes refused before "
                                "allocating (this engine's chunks hold at most %d): a miss "
                                "(counted as corrupt; further ones within 5 s only counted)",
                                self.url, n, geometry.max_bytes)
                return None
            return self._allocate(shape, dtype, num_tokens)

        return allocate

    def _allocate(self, shape: Sequence[int], dtype: torch.dtype, num_tokens: int
                  ) -> MemoryObj | None:
        """The destination of one value; a full pool is a miss, and a counted one (a stored
        chunk must never go missing with no counter saying why)."""
        obj = self.allocate(shape, dtype, num_tokens)
        if obj is None:
            self._count(alloc_failures=1)
        return obj

    # ------------------------------------------------------------ writes
    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        if len(keys) != len(objs):  # the caller's bug: refused before anything is stored
            raise ValueError(f"put: {len(keys)} keys but {len(objs)} objects")
        ok = [i for i, o in enumerate(objs) if encodable(o)]  # the rest: skipped, counted
        if len(ok) < len(objs):
            self._count(not_stored=len(objs) - len(ok))
            keys, objs = [keys[i] for i in ok], [objs[i] for i in ok]
        if not keys:
            return 0
        bytes_out = sum(o.nbytes for o in objs)
        if self.tags is None:
            stored = sum(self._put_values(keys, objs))
        else:
            pairs_keys, pairs, tags = self.tags.seal(keys, objs)
            try:
                done = self._put_values(pairs_keys, pairs)
            finally:
                for t in tags:
                    t.release()
            stored = sum(done[i] and done[i + 1] for i in range(0, len(done), 2))
        self._count(stored=stored, not_stored=len(keys) - stored, bytes_out=bytes_out)
        return stored

    def _put_values(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> list[bool]:
        """Whether each value is now stored."""
        parts = self._split([o.nbytes for o in objs])
        probe = self.probe.want()

        def run(a: int, b: int) -> list[bool]:
            res, present = self._call(
                "put", lambda c: c.put(self.namespace, keys[a:b], objs[a:b], probe,
                                       self._blocks(c, keys[a:b])), (b"", 0))
            if probe:
                self.probe.saw(present, b - a)
            return [j < len(res) and res[j] == P.STORED for j in range(b - a)]

        return [ok for part in self._parallel(parts, run) for ok in part]

    def _blocks(self, conn: ClientConnection, keys: Sequence[Key]) -> BlockMeta | None:
        """Block info for the daemon's KV events, when it publishes at our block size."""
        notes = self.block_notes
        ev = getattr(conn, "kv_events", None)
        if notes is None or ev is None:
            return None
        if ev.get("block_size") != notes.block_size:
            if not getattr(self, "_told_block_size", False):
                self._told_block_size = True
                log.warning("server tier %s: the daemon publishes KV events at block size "
                            "%s, this engine's is %d: its chunks are not published there",
                            self.url, ev.get("block_size"), notes.block_size)
            return None
        items = notes.items(keys)
        if not any(items):
            return None
        return {"bs": notes.block_size, "cs": notes.chunk_size, "lora": None}, items

    def delete(self, keys: Sequence[Key]) -> int:
        if not keys:
            return 0
        n = self._call("delete", lambda c: c.delete(self.namespace, keys), 0)
        if self.tags is not None:
            tags = [tag_key(k) for k in keys]
            self._call("delete", lambda c: c.delete(self.namespace, tags), 0)
        return n

    def clear_namespace(self, prefix: bytes = b"") -> list[Key] | None:
        """CLEAR this tier's daemon namespace (its tags go with it: they live there too);
        the daemon counts, never lists, so ``None``; ``[]`` when the CLEAR failed (nothing
        is known to be gone: no listener publishes a removal). The daemon keys a namespace
        by its own tag, not by the engine's keys: a ``prefix`` cannot be honoured."""
        if prefix:
            raise NotImplementedError(f"tier {self.name!r} clears whole daemon namespaces "
                                      "only, not a key prefix")
        n = self._call("clear", lambda c: c.clear(self.namespace), -1)
        if n < 0:
            return []
        self._count(cleared=n)
        return None

    def set_priority(self, keys: Sequence[Key], priority: int) -> int:
        """The daemon's memory and disk keep the keys' retention priority (PRIORITY)."""
        if not keys:
            return 0
        return self._call("priority", lambda c: c.set_priority(self.namespace, keys, priority),
                          0)

    # ------------------------------------------------------------- admin
    def server_stats(self) -> dict[str, Any]:
        """The daemon's own STATS (empty when it cannot be reached)."""
        return self._call("stats", lambda c: c.stats(), {})

    def stats(self) -> dict[str, Any]:
        with self._cond:
            conns = {"connections_open": self._open, "connections_idle": len(self._idle)}
        with self._count_lock:
            counts = dict(self.counts)
        b = self.breaker.stats()
        return {**counts, **conns, "breaker": b.pop("state"),
                **{f"breaker_{k}": v for k, v in b.items()}, "namespace": self.namespace}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for c in idle:
            c.close()
        if self._exec is not None:
            self._exec.shutdown(wait=True)
