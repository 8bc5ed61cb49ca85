"""Cross-process lookups: a scheduler asks the processes that own the cache what they hold.

Engines split a scheduler (which decides how many prompt tokens to take from lmc) from the
workers that own the ``CacheEngine`` and its tiers (vLLM: EngineCore and one worker per
tensor-parallel rank; SGLang: a scheduler per data-parallel rank over its TP workers). This
module is the engine-neutral bridge: each worker runs a :class:`LookupServer` on a Unix
socket answering from its own engine, and the scheduler's :class:`LookupClient` asks every
rank and keeps what all of them can supply. Adapters only choose the socket paths
(:func:`socket_path`) and what answers (anything with ``lookup_result(tokens)``, see
:func:`engine_lookup`).

Why a Unix socket: the answer comes from the very engine that will serve the load, so L1,
the write-behind queues and every lower tier count and a lookup is as fresh as the data;
one round trip per rank (the ranks asked in parallel), nothing outside the engine's
processes, and a filesystem path is a natural per-engine, per-rank address (the socket
file is mode 0600: only the same user can connect). The daemon as source of truth does not
see a worker's L1; a shared-memory index would have to stay coherent with every tier's
evictions and can be left torn by a crashed writer.

Wire format (version 2; no pickle -- the bytes come from a socket; little-endian):

* request: ``b"LMQ2"``, uint32 token count *n* (at most :data:`MAX_TOKENS`), *n* uint32
  token ids; a tagged request's (a LoRA adapter, a ``cache_salt``:
  :func:`lmc.token_database.request_tag`) is ``b"LMT2"``, *n*, the 16-byte tag, then the
  ids: the rank looks the tokens up in the chain of its own root for that tag (a server
  whose lookup function takes no tag answers a miss);
* answer: ``b"LMA2"``, uint64 hit tokens, uint32 chunk size, uint8 tier count *t* (at most
  :data:`~lmc.storage.lookup.MAX_TIERS`), uint32 source count *s*; then *t* names (uint8 length, at
  most :data:`MAX_NAME` bytes of UTF-8); then *s* uint8 tier indices, one per hit chunk
  (*s* is 0 when the server does not attribute hits). Everything is bounded by the request:
  *s* never exceeds the chunks of the tokens asked about. A hybrid model's answer (hits
  servable only at some ends, :mod:`lmc.hybrid.rules`) is ``b"LMH2"`` with the same
  fields, then uint32 slack and uint32 point count *p* (at most the chunks asked about)
  and *p* uint64 points, ascending.

* speeds request (what the load policy decides with, asked of rank 0 at most once a second
  by a scheduler whose ranks live in other processes): ``b"LMS2"``, uint32 0;
* speeds answer: ``b"LMB2"``, uint8 known (0: nothing measured yet, nothing follows), uint8
  tier count *t*; then per tier its name (as above), float64 bytes/s, float64 latency,
  uint8 overlaps, uint32 reads observed; then float64 c0, c1, c2 and uint32 steps observed of
  the prefill fit, float64 KV bytes per token, uint32 layers a load pipelines over. A hybrid
  model's (bytes priced per KV group kind, :class:`lmc.storage.speeds.KVBytes`) is
  ``b"LMK2"`` with the same fields, then uint8 window count *w* (at most
  :data:`MAX_WINDOWS`), *w* times uint32 reach and float64 bytes per position, and float64
  fixed bytes. Every number is checked (finite, in range) before use.

* prefetch request (the chunks a waiting request would recompute by choice, pulled into
  every rank's L1 while it waits): ``b"LMP2"``, uint32 token count *n*, uint32 first
  position, *n* uint32 token ids; a tagged request's is ``b"LMU2"``, *n*, the first
  position, the 16-byte tag, then the ids (the count is checked before anything more is
  read): the rank pulls the chunks of its own root's chain for that tag, never the plain
  chain's or another tag's (a server whose prefetch function takes no tag refuses it, and
  an lmc from before ``LMU2`` hangs up on it: the prefetch is refused, the request only
  loses the wait's head start); answer ``b"LMF2"``, uint8 accepted (0: the rank has no
  engine yet, or refused it).

A rank that is missing, slow (connects and reads share one deadline), or answers something
malformed counts as a miss for that lookup, with a warning naming the socket and what was
wrong (once per outage); its connection is dropped and reopened at the next lookup, so a
lookup never hangs the scheduler. Where a rank's engine lives in the scheduler's own
process, the client calls it directly (:data:`LOCAL_ENGINES`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from lmc.connectors.core.load_policy import Costs
from lmc.connectors.core.lookup_conns import (
    ConnLimits,
    Conns,
    ConnState,
    Overloaded,
    RequestReader,
)
from lmc.storage.lookup import MAX_TIERS, LookupResult, minimum
from lmc.storage.speeds import KVBytes, PrefillRate, TierRate
from lmc.token_database import request_root

log = logging.getLogger(__name__)

REQ_MAGIC = b"LMQ2"
TAGGED_REQ_MAGIC = b"LMT2"
TAG_BYTES = 16
ANS_MAGIC = b"LMA2"
HYBRID_ANS_MAGIC = b"LMH2"  # an answer with servable points (a hybrid model's)
PREFETCH_MAGIC = b"LMP2"
TAGGED_PREFETCH_MAGIC = b"LMU2"
PREFETCH_ANS_MAGIC = b"LMF2"
_U32 = struct.Struct("<I")
SPEEDS_REQ_MAGIC = b"LMS2"
SPEEDS_ANS_MAGIC = b"LMB2"
HYBRID_SPEEDS_ANS_MAGIC = b"LMK2"  # with a hybrid model's bytes per KV group kind
MAX_WINDOWS = 64
_WINDOW = struct.Struct("<Id")
_SPEEDS_HEAD = struct.Struct("<4sBB")
_SPEEDS_TIER = struct.Struct("<ddBI")
_SPEEDS_TAIL = struct.Struct("<dddIdI")
MAX_LAYERS = 1 << 16
_OLD_MAGICS = {b"LMCQ": "request", b"LMCA": "answer"}  # version 1 (before tier attribution)
_REQ_HEAD = struct.Struct("<4sI")
_ANS_HEAD = struct.Struct("<4sQIBI")
_POINTS_HEAD = struct.Struct("<II")
MAX_TOKENS = 1 << 24  # a bound on what a peer can make the other side allocate
MAX_NAME = 64  # bytes of one tier name on the wire

# What answers a lookup: the tokens (uint32 array) -> what this process's cache holds; a
# function that also takes a key tag, ``fn(tokens, tag)``, answers tagged requests too.
LookupFn = Callable[..., LookupResult]
# What answers a speeds request: this process's measured costs, None while unknown.
CostsFn = Callable[[], "Costs | None"]

# What answers a prefetch: (tokens, first position) -> a future (``done()``), or None; a
# function that also takes a key tag, ``fn(tokens, start, tag)``, answers tagged ones too.
PrefetchFn = Callable[..., Any]
# A prefetch function as the server and LOCAL_PREFETCH call it: (tokens, start, tag or None).
TaggedPrefetchFn = Callable[[np.ndarray, int, "bytes | None"], Any]

# Socket path -> prefetch function of an engine living in this process.
LOCAL_PREFETCH: dict[str, TaggedPrefetchFn] = {}

# Socket path -> lookup function of an engine living in this process.
LOCAL_ENGINES: dict[str, LookupFn] = {}
_LOCAL_LOCK = threading.Lock()


class LookupProtocolError(ConnectionError):
    """A peer sent bytes that are not a valid lookup message (the message says which)."""


class SupportsLookup(Protocol):
    db: Any

    def lookup_result(self, tokens: Any, *, keys: Any = None) -> LookupResult: ...


class SupportsPrefetch(Protocol):
    db: Any

    def prefetch(self, tokens: Any, start: int = 0, *, root: bytes | None = None) -> Any: ...


def _takes_args(fn: Callable[..., Any], n: int) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments (its signature read)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read: plain
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= n or any(p.kind is p.VAR_POSITIONAL for p in params)


def takes_tag(fn: LookupFn) -> bool:
    """Whether a lookup function answers tagged lookups (has a second parameter)."""
    return _takes_args(fn, 2)


def engine_root(engine: SupportsLookup | SupportsPrefetch, tag: bytes | None
                ) -> bytes | None:
    """Where a request's keys chain from on this rank: ``None`` (the namespace) for a plain
    request, else the rank's root for the tag (:func:`lmc.token_database.request_root` of
    this engine's namespace: the tag is the same on every rank, the namespace is not)."""
    return None if tag is None else request_root(engine.db.namespace, tag)


def with_tags(fn: LookupFn) -> Callable[[np.ndarray, bytes | None], LookupResult]:
    """``fn`` as ``(tokens, tag)``, its signature read once (when a server is made, not per
    lookup): a plain lookup function (tokens alone: it cannot key by a tag) answers a tagged
    lookup with a miss."""
    if takes_tag(fn):
        return fn

    def plain(tokens: np.ndarray, tag: bytes | None) -> LookupResult:
        return fn(tokens) if tag is None else LookupResult.miss()
    return plain


def prefetch_with_tags(fn: PrefetchFn) -> TaggedPrefetchFn:
    """``fn`` as ``(tokens, start, tag)``, its signature read once: a plain prefetch function
    (tokens and start: it cannot key by a tag) refuses a tagged prefetch (``None``), never
    pulling the plain chain for it."""
    if _takes_args(fn, 3):
        return fn

    def plain(tokens: np.ndarray, start: int, tag: bytes | None) -> Any:
        return fn(tokens, start) if tag is None else None
    return plain


def engine_lookup(get_engine: Callable[[], SupportsLookup | None]) -> LookupFn:
    """A server's lookup function over a cache engine that may not exist yet (vLLM and
    SGLang create it once the KV tensors are known): a miss until it does."""
    def answer(tokens: np.ndarray, tag: bytes | None = None) -> LookupResult:
        engine = get_engine()
        if engine is None:
            return LookupResult.miss()
        if tag is None:
            return engine.lookup_result(tokens)
        # a tagged request: its keys chain from this rank's root for the tag
        return engine.lookup_result(tokens, keys=engine.db.keys(tokens,
                                                                root=engine_root(engine, tag)))
    return answer


def engine_prefetch(get_engine: Callable[[], SupportsPrefetch | None]) -> TaggedPrefetchFn:
    """A server's prefetch function over a cache engine that may not exist yet: refused
    (``None``) until it does; a tagged prefetch pulls this rank's chain for the tag."""
    def pull(tokens: Any, start: int, tag: bytes | None = None) -> Any:
        engine = get_engine()
        if engine is None:
            return None
        return engine.prefetch(tokens, start, root=engine_root(engine, tag))
    return pull


def socket_path(directory: str | os.PathLike, engine_id: str, group: int, rank: int) -> str:
    """The socket of one rank: per engine instance (``engine_id``, e.g. vLLM's
    ``kv_transfer_config.engine_id``), per ``group`` (a data-parallel rank) and per
    ``rank`` (a tensor-parallel rank). The id is hashed to keep the path short (sockaddr_un
    holds 108 bytes)."""
    tag = xxhash.xxh64_hexdigest(f"{engine_id}/{group}".encode())
    return str(Path(directory) / f"lmc-{tag}-tp{rank}.sock")


# ------------------------------------------------------------------------- wire format
def encode_request(tokens: Sequence[int] | np.ndarray, tag: bytes | None = None) -> bytes:
    """A lookup request; with ``tag`` (16 bytes) a tagged one."""
    if tag is not None and (not isinstance(tag, bytes) or len(tag) != TAG_BYTES):
        raise ValueError(f"a key tag must be {TAG_BYTES} bytes, got {tag!r:.40}")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size > MAX_TOKENS:
        raise ValueError(f"{arr.size} tokens exceed the lookup limit of {MAX_TOKENS}")
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must be integers in [0, 2**32)")
    body = arr.astype("<u4", copy=False).tobytes()
    if tag is not None:
        return _REQ_HEAD.pack(TAGGED_REQ_MAGIC, arr.size) + tag + body
    return _REQ_HEAD.pack(REQ_MAGIC, arr.size) + body


def encode_answer(result: LookupResult) -> bytes:
    magic = HYBRID_ANS_MAGIC if result.points else ANS_MAGIC
    parts = [_ANS_HEAD.pack(magic, result.tokens, result.chunk_size, len(result.tiers),
                            len(result.sources))]
    parts += [_encode_name(t) for t in result.tiers]
    parts.append(result.sources)
    if result.points:
        parts.append(_POINTS_HEAD.pack(result.slack, len(result.points)))
        parts.append(struct.pack(f"<{len(result.points)}Q", *result.points))
    return b"".join(parts)


def _encode_name(name: str) -> bytes:
    """A tier name on the wire: uint8 length, at most :data:`MAX_NAME` bytes of UTF-8."""
    b = name.encode()
    if len(b) > MAX_NAME:
        raise ValueError(f"tier name {name!r} is longer than {MAX_NAME} bytes")
    return bytes([len(b)]) + b


def _read_name(sock: socket.socket) -> str:
    (k,) = _recv_exact(sock, 1)
    if k > MAX_NAME:
        raise LookupProtocolError(f"tier name of {k} bytes, at most {MAX_NAME}")
    try:
        return _recv_exact(sock, k).decode()
    except UnicodeDecodeError as e:
        raise LookupProtocolError(f"tier name is not UTF-8: {e}") from None


def encode_speeds_request() -> bytes:
    return _REQ_HEAD.pack(SPEEDS_REQ_MAGIC, 0)


def encode_speeds(costs: Costs | None) -> bytes:
    """The speeds answer (module doc) for ``costs`` (``None``: not measured yet)."""
    if costs is None:
        return _SPEEDS_HEAD.pack(SPEEDS_ANS_MAGIC, 0, 0)
    kv = costs.kv
    magic = HYBRID_SPEEDS_ANS_MAGIC if kv is not None else SPEEDS_ANS_MAGIC
    parts = [_SPEEDS_HEAD.pack(magic, 1, len(costs.tiers))]
    for t in costs.tiers:
        parts += [_encode_name(t.name),
                  _SPEEDS_TIER.pack(t.bytes_per_s, t.latency_s, int(t.overlaps), t.observed)]
    p = costs.prefill
    parts.append(_SPEEDS_TAIL.pack(p.c0, p.c1, p.c2, p.observed, costs.bytes_per_token,
                                   costs.num_layers))
    if kv is not None:
        if len(kv.windows) > MAX_WINDOWS:
            raise ValueError(f"{len(kv.windows)} sliding windows, at most {MAX_WINDOWS}")
        parts.append(bytes([len(kv.windows)]))
        parts += [_WINDOW.pack(w, b) for w, b in kv.windows]
        parts.append(struct.pack("<d", kv.fixed))
    return b"".join(parts)


def _finite(v: float, what: str) -> float:
    if not math.isfinite(v) or v < 0:
        raise LookupProtocolError(f"speeds answer: {what} is {v}")
    return v


def read_speeds(sock: socket.socket) -> Costs | None:
    """One speeds answer, every field checked (a peer's numbers steer decisions)."""
    magic = _recv_exact(sock, 4)
    if magic != HYBRID_SPEEDS_ANS_MAGIC:
        _check_magic(magic, SPEEDS_ANS_MAGIC, "speeds answer")
    _, known, n_tiers = _SPEEDS_HEAD.unpack(magic + _recv_exact(sock, _SPEEDS_HEAD.size - 4))
    if known not in (0, 1):
        raise LookupProtocolError(f"speeds answer: known flag {known}")
    if not known:
        return None
    if not 1 <= n_tiers <= MAX_TIERS:
        raise LookupProtocolError(f"speeds answer names {n_tiers} tiers (1 to {MAX_TIERS})")
    tiers = []
    for _ in range(n_tiers):
        name = _read_name(sock)
        bps, lat, overlaps, observed = _SPEEDS_TIER.unpack(_recv_exact(sock, _SPEEDS_TIER.size))
        if overlaps not in (0, 1) or not (math.isfinite(bps) and bps > 0):
            raise LookupProtocolError(f"speeds answer: tier {name!r} bytes/s {bps}, "
                                      f"overlaps {overlaps}")
        tiers.append(TierRate(name, bps, _finite(lat, f"tier {name!r} latency"),
                              bool(overlaps), observed))
    c0, c1, c2, observed, bpt, layers = _SPEEDS_TAIL.unpack(_recv_exact(sock,
                                                                        _SPEEDS_TAIL.size))
    for v, what in ((c0, "c0"), (c1, "c1"), (c2, "c2")):
        _finite(v, f"prefill {what}")
    if not (math.isfinite(bpt) and bpt > 0) or not 1 <= layers <= MAX_LAYERS:
        raise LookupProtocolError(f"speeds answer: {bpt} bytes per token, {layers} layers")
    kv = _read_kv_bytes(sock, bpt) if magic == HYBRID_SPEEDS_ANS_MAGIC else None
    try:
        return Costs(tuple(tiers), PrefillRate(c0, c1, c2, observed), bpt, layers, kv)
    except ValueError as e:
        raise LookupProtocolError(f"inconsistent speeds answer: {e}") from None


def _read_kv_bytes(sock: socket.socket, per_token: float) -> KVBytes:
    """A hybrid speeds answer's bytes per KV group kind, every number checked."""
    (w,) = _recv_exact(sock, 1)
    if w > MAX_WINDOWS:
        raise LookupProtocolError(f"speeds answer: {w} sliding windows, at most {MAX_WINDOWS}")
    windows = [_WINDOW.unpack(_recv_exact(sock, _WINDOW.size)) for _ in range(w)]
    (fixed,) = struct.unpack("<d", _recv_exact(sock, 8))
    for reach, b in windows:
        _finite(b, f"window of {reach} bytes per position")
        if reach < 1:
            raise LookupProtocolError("speeds answer: a window of 0 positions")
    try:
        return KVBytes(per_token, tuple((int(r), float(b)) for r, b in windows),
                       _finite(fixed, "fixed bytes"))
    except ValueError as e:
        raise LookupProtocolError(f"speeds answer: {e}") from None


def _check_magic(magic: bytes, want: bytes, what: str) -> None:
    if magic == want:
        return
    if magic in _OLD_MAGICS:
        raise LookupProtocolError(f"the peer speaks lookup wire format version 1 (an older "
                                  f"lmc); this {what} needs version 2: run the same lmc "
                                  "version on both sides")
    raise LookupProtocolError(f"bad {what} magic {magic!r} (expected {want!r})")


@dataclass(frozen=True)
class Request:
    """One request read off the socket: ``kind`` "lookup", "speeds" or "prefetch"."""

    kind: str
    tokens: np.ndarray | None = None
    start: int = 0
    tag: bytes | None = None  # a tagged lookup's or prefetch's key tag


def encode_prefetch(tokens: Sequence[int] | np.ndarray, start: int,
                    tag: bytes | None = None) -> bytes:
    """A prefetch request; with ``tag`` (16 bytes) a tagged one (``LMU2``)."""
    frame = encode_request(tokens, tag)
    head = _REQ_HEAD.size + (0 if tag is None else TAG_BYTES)
    n = (len(frame) - head) // 4
    if not 0 <= start <= n:
        raise ValueError(f"prefetch from position {start} of {n} tokens")
    if tag is None:
        return _REQ_HEAD.pack(PREFETCH_MAGIC, n) + _U32.pack(start) + frame[head:]
    return _REQ_HEAD.pack(TAGGED_PREFETCH_MAGIC, n) + _U32.pack(start) + tag + frame[head:]


def _read_start(recv: Callable[[int], bytes], n: int) -> int:
    """A prefetch's first position, which must lie within its ``n`` tokens."""
    (start,) = _U32.unpack(recv(_U32.size))
    if start > n:
        raise LookupProtocolError(f"prefetch from position {start} of {n} tokens")
    return int(start)


# what each request magic asks for (the speeds request has no tokens: read apart)
_REQ_KINDS = {REQ_MAGIC: "lookup", TAGGED_REQ_MAGIC: "lookup", PREFETCH_MAGIC: "prefetch",
              TAGGED_PREFETCH_MAGIC: "prefetch"}
_TAGGED = (TAGGED_REQ_MAGIC, TAGGED_PREFETCH_MAGIC)  # a 16-byte key tag before the tokens


def read_request(sock: socket.socket, recv: Callable[[int], bytes] | None = None) -> Request:
    """One request; ``recv(n)`` reads exactly ``n`` bytes (the server's bounded reader,
    :class:`~lmc.connectors.core.lookup_conns.RequestReader`; a plain read without one)."""
    if recv is None:
        recv = functools.partial(_recv_exact, sock)
    magic, n = _REQ_HEAD.unpack(recv(_REQ_HEAD.size))
    if magic == SPEEDS_REQ_MAGIC:
        if n != 0:
            raise LookupProtocolError(f"speeds request with a count of {n} (must be 0)")
        return Request("speeds")
    if magic not in _REQ_KINDS:
        _check_magic(magic, REQ_MAGIC, "lookup request")  # raises, naming what came
    kind = _REQ_KINDS[magic]
    if n > MAX_TOKENS:  # before reading anything more
        raise LookupProtocolError(f"request of {n} tokens exceeds the limit of {MAX_TOKENS}")
    start = _read_start(recv, n) if kind == "prefetch" else 0
    tag = recv(TAG_BYTES) if magic in _TAGGED else None
    tokens = np.frombuffer(recv(4 * n), dtype="<u4")  # read as it arrives (the server's)
    return Request(kind, tokens, start, tag)


def read_answer(sock: socket.socket, num_tokens: int) -> LookupResult:
    """One answer to a request of ``num_tokens`` tokens, every field checked against it."""
    magic = _recv_exact(sock, 4)  # alone first: another version's answer may be shorter
    if magic != HYBRID_ANS_MAGIC:
        _check_magic(magic, ANS_MAGIC, "lookup answer")
    _, tokens, cs, n_tiers, n_src = _ANS_HEAD.unpack(magic + _recv_exact(sock, _ANS_HEAD.size - 4))
    if tokens > num_tokens:
        raise LookupProtocolError(f"answer of {tokens} hit tokens for a request of "
                                  f"{num_tokens}")
    if cs < 1:
        raise LookupProtocolError("answer with chunk size 0")
    if n_tiers > MAX_TIERS:
        raise LookupProtocolError(f"answer names {n_tiers} tiers, at most {MAX_TIERS}")
    if n_src > -(-num_tokens // cs):
        raise LookupProtocolError(f"answer has {n_src} chunk sources for a request of "
                                  f"{num_tokens} tokens in chunks of {cs}")
    tiers = [_read_name(sock) for _ in range(n_tiers)]
    sources = _recv_exact(sock, n_src)
    points: tuple[int, ...] = ()
    slack = 0
    if magic == HYBRID_ANS_MAGIC:
        slack, n_pts = _POINTS_HEAD.unpack(_recv_exact(sock, _POINTS_HEAD.size))
        if not 1 <= n_pts <= -(-num_tokens // cs) or slack > cs:
            raise LookupProtocolError(f"hybrid answer with {n_pts} points and slack {slack} "
                                      f"for a request of {num_tokens} tokens in chunks of {cs}")
        points = struct.unpack(f"<{n_pts}Q", _recv_exact(sock, 8 * n_pts))
        if max(points) > num_tokens:
            raise LookupProtocolError(f"hybrid answer with a point past the request's "
                                      f"{num_tokens} tokens")
    try:
        return LookupResult(tokens, cs, tuple(tiers), sources, points, slack)
    except ValueError as e:
        raise LookupProtocolError(f"inconsistent answer: {e}") from None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


# ------------------------------------------------------------------------------ server
class LookupServer:
    """Answers lookups for one process's cache on a Unix socket (one thread per
    connection; a scheduler keeps one connection per rank open). What its peers can make
    it hold is bounded by ``limits`` (:mod:`lmc.connectors.core.lookup_conns`)."""

    def __init__(self, path: str, lookup: LookupFn, costs: CostsFn | None = None,
                 prefetch: PrefetchFn | None = None, limits: ConnLimits | None = None
                 ) -> None:
        """``costs``: this process's measured speeds, for schedulers in other processes
        (answered as "not known" without it); ``prefetch``: pulls chunks into this
        process's L1 in the background (refused without it), ``fn(tokens, start, tag)``
        for tagged prefetches too (a plain ``fn(tokens, start)`` refuses those)."""
        self.path = path
        self._lookup = lookup = with_tags(lookup)
        self._costs = costs
        self._prefetch = prefetch = (prefetch_with_tags(prefetch) if prefetch is not None
                                     else None)
        self._sock = self._bind(path)
        self._closed = threading.Event()
        self.conns = Conns(limits or ConnLimits())
        self.requests = 0
        self.errors = 0
        with _LOCAL_LOCK:
            LOCAL_ENGINES[path] = lookup
            if prefetch is not None:
                LOCAL_PREFETCH[path] = prefetch
        self._thread = threading.Thread(target=self._accept_loop, name="lmc-lookup",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(path: str) -> socket.socket:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(0.5)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # left behind by a process that died
            else:
                raise RuntimeError(
                    f"another process already serves lmc lookups at {path}: two engines "
                    "share one engine id (vLLM: kv_transfer_config.engine_id); give each "
                    "its own")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o600)  # connecting needs write permission: this user only
        sock.listen(16)
        return sock

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            st = self.conns.admit(conn)
            if st is None:  # every connection is inside a request: this one waits for none
                _refused(self.path)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(st,), name="lmc-lookup-conn",
                             daemon=True).start()

    def _answer(self, tokens: np.ndarray, tag: bytes | None = None) -> bytes:
        try:
            return encode_answer(self._lookup(tokens, tag))
        except Exception:  # a failing cache is a miss, never a dead server
            self.errors += 1
            log.exception("lmc lookup at %s failed; answering a miss", self.path)
            return encode_answer(LookupResult.miss())

    def _prefetched(self, req: Request) -> bytes:
        ok = 0
        if self._prefetch is not None and req.tokens is not None:
            try:
                ok = int(self._prefetch(req.tokens, req.start, req.tag) is not None)
            except Exception:  # a prefetch never kills the server: refused
                self.errors += 1
                log.exception("lmc prefetch at %s failed; refused", self.path)
        return PREFETCH_ANS_MAGIC + bytes([ok])

    def _speeds(self) -> bytes:
        try:
            return encode_speeds(self._costs() if self._costs is not None else None)
        except Exception:  # the speeds never kill the server: "not known" (load all)
            self.errors += 1
            log.exception("lmc speeds at %s failed; answering 'not known'", self.path)
            return encode_speeds(None)

    def _serve(self, st: ConnState) -> None:
        conn = st.sock
        reader = RequestReader(st, self.conns)
        try:
            while not self._closed.is_set():
                try:
                    req = read_request(conn, reader.exact)
                except LookupProtocolError as e:
                    self.errors += 1
                    log.warning("lmc lookup server %s: %s; closing the connection", self.path,
                                e)
                    return
                except Overloaded as e:
                    _refused(self.path, str(e))
                    return
                except TimeoutError:  # idle past idle_timeout, or a request too slow
                    self.conns.timed_out()
                    return
                except (ConnectionError, OSError):
                    return
                if req.kind == "speeds":
                    answer = self._speeds()
                elif req.kind == "prefetch":
                    answer = self._prefetched(req)
                else:
                    assert req.tokens is not None  # a lookup carries its tokens
                    answer = self._answer(req.tokens, req.tag)
                del req
                self.requests += 1
                reader.done()
                reader.send(answer)
        except OSError:
            return
        finally:
            self.conns.close(st)
            conn.close()

    def stats(self) -> dict[str, int]:
        """Requests, errors and what the connection bounds counted."""
        return {"requests": self.requests, "errors": self.errors, **self.conns.stats()}

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with _LOCAL_LOCK:
            LOCAL_ENGINES.pop(self.path, None)
            LOCAL_PREFETCH.pop(self.path, None)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for c in self.conns.all():
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._thread.join(timeout=2)


_REFUSED_AT: dict[str, float] = {}


def _refused(path: str, why: str = "too many connections, none idle") -> None:
    """One warning per socket per 10 s: a flood must not become a log flood."""
    now = time.monotonic()
    if now - _REFUSED_AT.get(path, float("-inf")) >= 10.0:
        _REFUSED_AT[path] = now
        log.warning("lmc lookup server %s: a connection refused (%s)", path, why)


# ------------------------------------------------------------------------------ client
@dataclass
class LookupClientStats:
    lookups: int = 0
    rank_failures: int = 0  # a rank missing, slow or broken for one lookup (counted as 0)
    local_calls: int = 0
    seconds: float = 0.0


class LookupClient:
    """Asks every rank's :class:`LookupServer` and returns what all of them can supply
    (:func:`lmc.storage.lookup.minimum`).

    ``timeout`` bounds the whole lookup (connects and reads of all ranks together); a rank
    that does not answer in time is a miss for that lookup, and its connection is dropped
    (a late answer would desynchronise the stream) and reopened at the next lookup.
    """

    def __init__(self, paths: Sequence[str], timeout: float = 1.0, use_local: bool = True
                 ) -> None:
        if not paths:
            raise ValueError("LookupClient needs at least one socket path")
        if timeout <= 0:
            raise ValueError(f"lookup timeout must be > 0, got {timeout}")
        self.paths = list(paths)
        self.timeout = timeout
        self.use_local = use_local  # call engines of this process directly (no socket)
        self._socks: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        self.stats = LookupClientStats()
        self._warned: set[str] = set()
        self.speeds_max_age = 1.0  # seconds a rank's speeds are reused before asking again
        self._speeds: tuple[float, Costs | None] | None = None  # (when asked, answer)

    def lookup(self, tokens: Sequence[int] | np.ndarray, tag: bytes | None = None
               ) -> LookupResult:
        """What every rank can supply of ``tokens``; a miss where a rank cannot answer.
        ``tag``: a tagged request's key tag (each rank looks up its own root's chain)."""
        t0 = time.perf_counter()
        with self._lock:
            self.stats.lookups += 1
            try:
                return self._lookup(tokens, t0, tag)
            finally:
                self.stats.seconds += time.perf_counter() - t0

    def _lookup(self, tokens: Sequence[int] | np.ndarray, t0: float,
                tag: bytes | None = None) -> LookupResult:
        frame = encode_request(tokens, tag)
        head = _REQ_HEAD.size + (0 if tag is None else TAG_BYTES)
        n = (len(frame) - head) // 4
        local = [LOCAL_ENGINES.get(p) for p in self.paths] if self.use_local else [None]
        found = [fn for fn in local if fn is not None]
        if len(found) == len(local):
            self.stats.local_calls += 1
            arr = np.frombuffer(frame, dtype="<u4", offset=head)
            return minimum(fn(arr, tag).clipped(n) for fn in found)
        deadline = t0 + self.timeout
        sent: list[tuple[str, socket.socket]] = []
        for path in self.paths:  # send to every rank first: they work in parallel
            try:
                sock = self._connect(path, deadline)
                sock.settimeout(max(1e-3, deadline - time.perf_counter()))
                sock.sendall(frame)
                sent.append((path, sock))
            except (OSError, TimeoutError) as e:
                self._fail(path, e)
                self._drop(p for p, _ in sent)  # their answers would desynchronise them
                return LookupResult.miss()
        answers = []
        for i, (path, sock) in enumerate(sent):
            try:
                sock.settimeout(max(1e-3, deadline - time.perf_counter()))
                answers.append(read_answer(sock, n))
            except (OSError, TimeoutError, ConnectionError, struct.error) as e:
                self._fail(path, e)
                self._drop(p for p, _ in sent[i + 1:])
                return LookupResult.miss()
        try:
            return minimum(answers)
        except ValueError as e:  # ranks disagree on the chunk size: a misconfiguration
            self.stats.rank_failures += 1
            log.warning("lmc lookup: %s; counted as a miss", e)
            return LookupResult.miss()

    def costs(self) -> Costs | None:
        """Rank 0's measured speeds (the load policy's input), asked over its socket at most
        once per ``speeds_max_age``; ``None`` while unknown or when it cannot answer (the
        whole hit is loaded then)."""
        with self._lock:
            now = time.perf_counter()
            if self._speeds is not None and now - self._speeds[0] < self.speeds_max_age:
                return self._speeds[1]
            path = self.paths[0]
            got: Costs | None = None
            try:
                deadline = now + self.timeout
                sock = self._connect(path, deadline)
                sock.settimeout(max(1e-3, deadline - time.perf_counter()))
                sock.sendall(encode_speeds_request())
                got = read_speeds(sock)
            except (OSError, TimeoutError, ConnectionError, struct.error) as e:
                self._fail(path, e)
            self._speeds = (now, got)
            return got

    def prefetch(self, tokens: Sequence[int] | np.ndarray, start: int,
                 tag: bytes | None = None) -> RemotePrefetch | None:
        """Ask every rank to pull the chunks of ``tokens`` from position ``start`` on into
        its L1 (each rank holds its own share of the KV); ``None`` where any cannot. The
        answer is done once a lookup sees those chunks in L1 (or they are gone). ``tag``: a
        tagged request's key tag (each rank pulls its own root's chain for it, ``LMU2``)."""
        frame = encode_prefetch(tokens, start, tag)
        head = _REQ_HEAD.size + _U32.size + (0 if tag is None else TAG_BYTES)
        with self._lock:
            local = [LOCAL_PREFETCH.get(p) for p in self.paths] if self.use_local else [None]
            if all(fn is not None for fn in local):
                arr = np.frombuffer(frame, dtype="<u4", offset=head)
                futs = [fn(arr, start, tag) for fn in local if fn is not None]
                if any(f is None for f in futs):
                    return None
                return RemotePrefetch(self, tokens, start, futures=futs, tag=tag)
            deadline = time.perf_counter() + self.timeout
            for path in self.paths:
                try:
                    sock = self._connect(path, deadline)
                    sock.settimeout(max(1e-3, deadline - time.perf_counter()))
                    sock.sendall(frame)
                    magic = _recv_exact(sock, 4)
                    _check_magic(magic, PREFETCH_ANS_MAGIC, "prefetch answer")
                    (ok,) = _recv_exact(sock, 1)
                except (OSError, TimeoutError, ConnectionError) as e:
                    self._fail(path, e)
                    return None
                if ok != 1:
                    return None
        return RemotePrefetch(self, tokens, start, tag=tag)

    def _drop(self, paths: Iterable[str]) -> None:
        for path in paths:
            sock = self._socks.pop(path, None)
            if sock is not None:
                sock.close()

    def _connect(self, path: str, deadline: float) -> socket.socket:
        sock = self._socks.get(path)
        if sock is not None:
            if _usable(sock):
                return sock
            self._drop([path])  # the server closed it (idle, evicted): a fresh one
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(1e-3, deadline - time.perf_counter()))
        try:
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        self._socks[path] = sock
        self._warned.discard(path)
        return sock

    def _fail(self, path: str, err: BaseException) -> None:
        """Count the rank as a miss for this lookup and drop its connection."""
        self.stats.rank_failures += 1
        self._drop([path])
        if path not in self._warned:  # once per outage, not once per request
            self._warned.add(path)
            log.warning("lmc lookup at %s failed (%s: %s): counted as a miss until it "
                        "answers again", path, type(err).__name__, err)

    def close(self) -> None:
        with self._lock:
            for sock in self._socks.values():
                sock.close()
            self._socks.clear()


def _usable(sock: socket.socket) -> bool:
    """Whether a kept connection is still open and has nothing unread (one non-blocking
    peek: the server closes connections idle past its ``idle_timeout``)."""
    timeout = sock.gettimeout()
    sock.setblocking(False)  # with a timeout set, recv would first wait that long
    try:
        sock.recv(1, socket.MSG_PEEK)
        return False  # b"": closed; a byte: an answer nobody read
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(timeout)


class RemotePrefetch:
    """A prefetch asked of every rank. ``done()``: its futures finished (ranks in this
    process), else a lookup -- at most every ``poll_s``, in the request's own chain
    (``tag``) -- finds the chunks from ``start`` in L1 or no longer held; after
    ``timeout_s`` it is done whatever became of it."""

    def __init__(self, client: LookupClient, tokens: Sequence[int] | np.ndarray, start: int,
                 futures: Sequence[Any] = (), poll_s: float = 0.02, timeout_s: float = 30.0,
                 tag: bytes | None = None) -> None:
        self.client = client
        self.tokens = np.asarray(tokens)
        self.start = start
        self.tag = tag
        self.futures = list(futures)
        self.poll_s = poll_s
        self._deadline = time.monotonic() + timeout_s
        self._last = time.monotonic()
        self._done = False

    def cancel(self) -> bool:
        """Stop the prefetches of ranks in this process before their next chunk; ranks in
        other processes finish theirs (the socket has no cancel message)."""
        for f in self.futures:
            f.cancel()
        self._done = True
        return True

    def done(self) -> bool:
        if self._done:
            return True
        if self.futures:
            self._done = all(f.done() for f in self.futures)
            return self._done
        now = time.monotonic()
        if now >= self._deadline:
            self._done = True
        elif now - self._last >= self.poll_s:
            self._last = now
            got = self.client.lookup(self.tokens, self.tag)
            first = self.start // got.chunk_size
            self._done = (got.tokens <= self.start or not got.sources  # gone / cannot tell
                          or not any(got.sources[first:]))
        return self._done
