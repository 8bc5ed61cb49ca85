"""The scheduler's view of what the workers hold: a lookup service over Unix sockets.

vLLM builds the scheduler-side connector in the EngineCore process and the worker-side one
in each worker process (tensor-parallel rank); the ``CacheEngine`` and its tiers (L1 pool
included) live in the workers. So the scheduler must ask the workers. Three ways were
weighed:

* **A lookup server in each worker, on a Unix socket (chosen).** It answers from the very
  ``CacheEngine`` that will serve the load, so L1, the write-behind queue and every lower
  tier count, and a lookup is exactly as fresh as the data. It needs nothing outside the
  vLLM processes, costs one round trip per rank (~50-100 us on loopback, the ranks asked in
  parallel), and a filesystem path is a natural per-engine, per-rank address: the socket
  file is mode 0600, so only the same user can connect.
* The lmc cache-server daemon as the source of truth: an extra process to operate, and it
  does not see a worker's L1, which holds exactly the hottest prefixes.
* Shared memory with a key index the workers publish: no round trip, but the index must be
  kept coherent with evictions in every tier and a crashed writer can leave it torn; a
  socket answer is computed on the spot from the real tiers.

Wire format (no pickle: the data comes from a socket): a request is ``b"LMCQ"``, a uint32
token count and that many little-endian uint32 token ids; the answer is ``b"LMCA"`` and two
uint64: the prefix tokens any tier can supply, and the part of that prefix in L1.

The client asks every rank and takes the minimum (a rank that lacks a chunk cannot load
it). Connect and read share one deadline; a rank that is missing, slow, or answers
garbage counts as 0 hits for that lookup and is reconnected next time, so a lookup never
hangs the scheduler. Where a rank's engine lives in the scheduler's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the client calls it directly through
:data:`LOCAL_ENGINES` instead of the socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

log = logging.getLogger(__name__)

REQ_MAGIC = b"LMCQ"
ANS_MAGIC = b"LMCA"
_REQ_HEAD = struct.Struct("<4sI")
_ANS = struct.Struct("<4sQQ")
MAX_TOKENS = 1 << 24  # a bound on what a peer can make the server allocate

# (hit tokens, L1 hit tokens) for a token sequence, computed by a worker's CacheEngine.
LookupFn = Callable[[np.ndarray], tuple[int, int]]

# Socket path -> lookup function of an engine living in this process.
LOCAL_ENGINES: dict[str, LookupFn] = {}
_LOCAL_LOCK = threading.Lock()


def socket_path(directory: str | os.PathLike, engine_id: str, dp_rank: int, tp_rank: int
                ) -> str:
    """Per engine and rank. ``engine_id`` is vLLM's ``kv_transfer_config.engine_id``, a
    uuid4 unless set by the user; it is hashed to keep the path short (sockaddr_un holds
    108 bytes)."""
    tag = xxhash.xxh64_hexdigest(f"{engine_id}/{dp_rank}".encode())
    return str(Path(directory) / f"lmc-{tag}-tp{tp_rank}.sock")


def encode_request(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size > MAX_TOKENS:
        raise ValueError(f"{arr.size} tokens exceed the lookup limit of {MAX_TOKENS}")
    return _REQ_HEAD.pack(REQ_MAGIC, arr.size) + arr.astype("<u4", copy=False).tobytes()


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


# ------------------------------------------------------------------------- server
class LookupServer:
    """Answers lookups for one worker's ``CacheEngine`` on a Unix socket (one thread per
    connection; the scheduler keeps one connection per rank open)."""

    def __init__(self, path: str, lookup: LookupFn) -> None:
        self.path = path
        self._lookup = lookup
        self._sock = self._bind(path)
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.requests = 0
        self.errors = 0
        with _LOCAL_LOCK:
            LOCAL_ENGINES[path] = lookup
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
                    f"another process already serves lmc lookups at {path}: two vLLM "
                    "engines share one kv_transfer_config.engine_id; give each its own")
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
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="lmc-lookup-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                try:
                    head = _recv_exact(conn, _REQ_HEAD.size)
                except (ConnectionError, OSError):
                    return
                magic, n = _REQ_HEAD.unpack(head)
                if magic != REQ_MAGIC or n > MAX_TOKENS:
                    self.errors += 1
                    log.warning("lmc lookup server %s: bad request header; closing", self.path)
                    return
                tokens = np.frombuffer(_recv_exact(conn, 4 * n), dtype="<u4")
                try:
                    hit, l1 = self._lookup(tokens)
                except Exception:  # a failing cache is 0 hits, never a dead server
                    self.errors += 1
                    log.exception("lmc lookup failed; answering 0 hits")
                    hit, l1 = 0, 0
                self.requests += 1
                conn.sendall(_ANS.pack(ANS_MAGIC, hit, l1))
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with _LOCAL_LOCK:
            LOCAL_ENGINES.pop(self.path, None)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._thread.join(timeout=2)


# ------------------------------------------------------------------------- client
@dataclass
class LookupClientStats:
    lookups: int = 0
    rank_failures: int = 0  # a rank missing, slow or broken for one lookup (counted as 0)
    local_calls: int = 0
    seconds: float = 0.0


class LookupClient:
    """Asks every rank's :class:`LookupServer` and returns the minimum answer.

    ``timeout`` bounds the whole lookup (connects and reads of all ranks together); a rank
    that does not answer in time is a 0 for that lookup, and its connection is dropped
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

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """(prefix tokens every rank can supply, of which in every rank's L1)."""
        t0 = time.perf_counter()
        with self._lock:
            self.stats.lookups += 1
            try:
                return self._lookup(tokens, t0)
            finally:
                self.stats.seconds += time.perf_counter() - t0

    def _lookup(self, tokens: Sequence[int] | np.ndarray, t0: float) -> tuple[int, int]:
        arr = np.asarray(tokens, dtype=np.int64)
        local = [LOCAL_ENGINES.get(p) for p in self.paths] if self.use_local else [None]
        if all(fn is not None for fn in local):
            self.stats.local_calls += 1
            answers = [fn(arr) for fn in local]  # type: ignore[misc]
            return min(a[0] for a in answers), min(a[1] for a in answers)
        frame = encode_request(arr)
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
                return 0, 0
        hit, l1 = len(arr), len(arr)
        for i, (path, sock) in enumerate(sent):
            try:
                sock.settimeout(max(1e-3, deadline - time.perf_counter()))
                magic, h, c = _ANS.unpack(_recv_exact(sock, _ANS.size))
                if magic != ANS_MAGIC:
                    raise ConnectionError("bad answer magic")
            except (OSError, TimeoutError, ConnectionError, struct.error) as e:
                self._fail(path, e)
                self._drop(p for p, _ in sent[i + 1:])
                return 0, 0
            hit, l1 = min(hit, int(h)), min(l1, int(c))
        return hit, min(l1, hit)

    def _drop(self, paths: Iterable[str]) -> None:
        for path in paths:
            sock = self._socks.pop(path, None)
            if sock is not None:
                sock.close()

    def _connect(self, path: str, deadline: float) -> socket.socket:
        sock = self._socks.get(path)
        if sock is not None:
            return sock
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
        """Count the rank as 0 for this lookup and drop its connection."""
        self.stats.rank_failures += 1
        self._drop([path])
        if path not in self._warned:  # once per outage, not once per request
            self._warned.add(path)
            log.warning("lmc lookup at %s failed (%s: %s): counted as 0 hits until it "
                        "answers again", path, type(err).__name__, err)

    def close(self) -> None:
        with self._lock:
            for sock in self._socks.values():
                sock.close()
            self._socks.clear()
