"""Local disk (NVMe) tier: one file per chunk, written with O_DIRECT straight from pool memory.

File format. ``<dir>/<key hex>.<file bytes>.kv`` holds one 4 KiB block with the
:mod:`lmc.storage.serde` header (zero padded), then the payload padded to 4 KiB. Both parts are
4 KiB-aligned, and pool objects start 4 KiB-aligned, so a value goes from pool memory to the
device (and back into a freshly allocated pool object) with one ``pwritev``/``preadv``: the
object's whole 4 KiB units straight from or into pool memory, its last partial unit (if any)
through a 4 KiB buffer of the tier's that also carries the zero padding
(``MemoryObj.io_spans``). So the tier never touches pool bytes past ``obj.nbytes`` and needs
nothing of the allocator. The header carries the key, so a file renamed to another key's
name is caught.

Crash consistency. A value is written under a temporary name (``.tmp.<pid>.<hex>``), optionally
``fdatasync``-ed (``disk_fsync``; then the directory is fsync-ed once per batch), and renamed
to its final name: a name ending in ``.kv`` always denotes a complete write. A crash leaves
only temporary files, which the next start removes, all of them: it holds the directory's
lock (below), so no other live writer can own one, whatever PID its name carries (after a
container restart the dead writer's PID is often the new one's, e.g. 1). Without fsync a
power loss may leave a renamed file with stale blocks; the payload checksum turns that into a
miss, never into wrong KV.

Start-up. The index is rebuilt from one ``scandir`` of the directory: names carry the key and
the file size, so a truncated file is found by its size alone; headers and checksums are
verified lazily, on read. The eviction order survives a restart approximately (files are
re-inserted by mtime, i.e. write order). The directory belongs to lmc: a marker file is
written on first use, files lmc does not recognise there are deleted (counted), and a
non-empty directory without the marker is refused rather than cleaned.

One tier per directory. The index, the eviction order and the size accounting live in the
process, so two processes (two vLLM instances given one ``local_disk``) would each keep the
limit and together exceed it, and evict each other's files under their readers. The tier
therefore holds an exclusive ``flock`` on ``<dir>/.lmc-disk-tier.lock`` for its lifetime: a
second tier on the same directory, in this process or another, is refused at start-up with
a message naming the holder's PID and the fix (a directory per instance). The kernel drops
the lock when its holder exits, however it exits (SIGKILL included), so a crash never leaves
the directory locked; a child forked by the holder drops its inherited copy at once, so a
long-lived child does not keep the directory locked after its parent closed the tier (a tier
opened in the instant before the child ran its at-fork handler waits for that, 2 s at most).

Why one file per chunk rather than segment files, measured here (virtio disk, ext4 mounted
with ``discard``, O_DIRECT, 1 GiB per case, see ``benchmarks/bench_disk.py``): for chunks of
8-32 MiB (a 256-token chunk of a 7-8B model) creating a file per chunk writes as fast as
appending to a segment (1.6-1.8 vs 1.6-1.7 GiB/s) and reads equally fast. A segment file wins
in two places: small values (256 KiB: 1.2-1.4 vs 0.1-0.8 GiB/s) and steady state at capacity,
where each eviction's ``unlink`` costs 3-6 ms of discard and new files need block allocation
(1.2 GiB/s evict+create vs 2.2-2.5 GiB/s overwriting in place). We keep file-per-chunk for
its simple correctness (atomic rename, rebuild from names, eviction = one file) and take the
overwrite speed anyway: at capacity, a victim of the same size is **recycled**: renamed to a
temporary name (so its key disappears atomically) and overwritten in place, which measured
2.2 GiB/s against 1.2 for unlink+create. Segments would only pay off for chunks far below
1 MiB, which lmc's chunk sizes do not produce.

I/O runs on a few threads of its own: a batch of reads or writes is issued in parallel (several
requests in flight keep the device busy), and the caller only waits for the batch. Where the
filesystem refuses O_DIRECT (tmpfs on old kernels, some network filesystems) buffered I/O is
used, logged once per directory. Errors never reach the engine: a failed write (ENOSPC, EIO)
is skipped and counted, earlier values stay served; a bad value is a miss, deleted, counted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any

from lmc import units
from lmc.config import CacheConfig, parse_size
from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.metrics import TierMetrics
from lmc.priority import lower_thread_priority
from lmc.storage.backends.disk.index import BLOCK, DiskIndex, Entry, Eviction, round_up
from lmc.storage.framing import ValueFraming
from lmc.storage.integrity import Geometry
from lmc.storage.layered_read import Coordinators, LayeredRead
from lmc.storage.serde import CorruptValue, Header, encodable
from lmc.storage.tier import Key, Medium, StorageBackend, TierCapabilities, register_backend

log = logging.getLogger(__name__)

MARKER = ".lmc-disk-tier"
LOCK = ".lmc-disk-tier.lock"
_NAME = re.compile(r"^([0-9a-f]{32})\.([0-9]+)\.kv$")
_TMP = re.compile(r"^\.tmp\.([0-9]+)\.[0-9a-f]+$")
# a start-up scan of a large directory (millions of files on a cold disk) can take minutes:
# it logs where it is this often, so the operator sees progress rather than a hang
SCAN_PROGRESS_SECONDS = 5.0
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_buffered_logged: set[str] = set()


_ZEROS = memoryview(bytes(BLOCK))


def _payload_spans(obj: MemoryObj, direct: bool) -> tuple[memoryview, memoryview] | None:
    """``(head, tail)`` of the object for O_DIRECT (``MemoryObj.io_spans``), or ``None`` when
    the I/O is buffered or the object is not 4 KiB-aligned (then the whole ``byte_view()``)."""
    return obj.io_spans(BLOCK) if direct else None


def io_all(op, fd: int, bufs: list[memoryview], offset: int) -> int:
    """``os.preadv``/``os.pwritev`` until every buffer is done; returns bytes moved. A short
    read means end of file (regular files): it is not retried, since an O_DIRECT retry from a
    misaligned position would fail with EINVAL instead of reporting the truncation."""
    total = sum(b.nbytes for b in bufs)
    done = 0
    while done < total:
        n = op(fd, bufs, offset + done)
        if n <= 0:
            break
        done += n
        if op is os.preadv and done < total:
            break
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs = bufs[1:]
        if n:
            bufs = [bufs[0][n:], *bufs[1:]]
    return done


class DirectoryInUse(RuntimeError):
    """Another disk tier (in this or another process) holds the directory's lock."""


#: How long a tier waits for a lock that only a just-forked child of this process still holds
#: (its inherited copy, closed by the child's at-fork handler once the child runs).
FORK_RELEASE_WAIT_S = 2.0


def lock_directory(path: str) -> int:
    """Take the directory's exclusive lock; returns the fd that holds it (closing it releases
    the lock). Raises :class:`DirectoryInUse` naming the holder and the fix.

    A lock written by this process that no open tier here holds is a copy inherited by a
    child forked just now, which drops it as soon as it runs: that case waits
    (:data:`FORK_RELEASE_WAIT_S` at most) instead of failing at once."""
    lock = os.path.join(path, LOCK)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        holder = _take(fd, path)
    except BaseException:
        os.close(fd)
        raise
    if holder is not None:
        os.close(fd)
        if holder != str(os.getpid()):
            who = f"another lmc process (PID {holder})"
        elif _held_here(path):
            who = "another disk tier in this process"
        else:
            who = ("a process forked from this one (it inherited the lock and has not let "
                   "it go)")
        raise DirectoryInUse(
            f"local_disk {path!r} is in use by {who}, which holds {lock!r}. Two processes "
            f"cannot share one disk tier: each would keep local_disk_size and together they "
            f"would exceed it. Give each process its own directory (e.g. "
            f"{os.path.join(path, '<instance>')!r}, each with its own local_disk_size)"
        )
    pid = f"{os.getpid()}\n".encode()
    os.pwrite(fd, pid, 0)  # write, then cut: the file is never empty once a holder wrote it
    os.ftruncate(fd, len(pid))
    return fd


def _take(fd: int, path: str) -> str | None:
    """Lock ``fd``; ``None`` once taken, else the holder's PID as its lock file says."""
    deadline = time.monotonic() + FORK_RELEASE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            holder = _read_holder(fd)
        inherited = holder == str(os.getpid()) and not _held_here(path)
        if not inherited or time.monotonic() > deadline:
            return holder
        time.sleep(0.005)


def _held_here(path: str) -> bool:
    """Whether an open tier of this process holds ``path``'s lock."""
    return any(lock.path == path and lock.fd >= 0 for lock in list(_HELD))


def _read_holder(fd: int) -> str:
    """The PID in a held lock file; the holder writes it just after taking the lock, so a
    loser arriving in between waits for it briefly (0.5 s at most) rather than say 'unknown'."""
    deadline = time.monotonic() + 0.5
    while True:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if holder or time.monotonic() > deadline:
            return holder or "unknown"
        time.sleep(0.005)


class _DirLock:
    """The fd holding a directory's lock; ``release`` is idempotent."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = lock_directory(path)
        _HELD.add(self)

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


_HELD: weakref.WeakSet[_DirLock] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    """In a forked child: close the copies of the parent's lock fds (the parent keeps its lock;
    the child's tiers cannot run anyway, their I/O threads did not survive the fork)."""
    for lock in list(_HELD):
        lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


class _NoMemory(Exception):
    """The pool had no room for a value being read (a miss, counted)."""


class OpenValue:
    """An opened value: its file, its pool object (one reference), its head (as read) and
    the header decoded from it, and the object's O_DIRECT spans (``None``: buffered)."""

    __slots__ = ("key", "entry", "fd", "obj", "head", "hdr", "spans")

    def __init__(self, key: Key, entry: Entry, fd: int, obj: MemoryObj, head: bytes,
                 hdr: Header, spans: tuple[memoryview, memoryview] | None) -> None:
        self.key, self.entry, self.fd, self.hdr, self.spans = key, entry, fd, hdr, spans
        self.head = head
        self.obj: MemoryObj | None = obj  # None once handed to the caller

    def close(self) -> None:
        """Close the file and drop the object unless someone took it (``obj = None``)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        obj, self.obj = self.obj, None
        if obj is not None:
            obj.release()


@register_backend("disk")
class DiskBackend(StorageBackend):
    """Chunks as files under ``path`` (default ``config.local_disk``), at most ``capacity``
    bytes (``local_disk_size``), evicted in the order of ``eviction_policy`` (a
    :mod:`lmc.storage.eviction` name; least recently used first by default: the L1 key
    ``eviction_policy`` is the memory tier's)."""

    medium = Medium.LOCAL_STORAGE
    capabilities = TierCapabilities(layered_reads=True, existence_without_reading=True,
                                    durable=True)

    def __init__(self, spec: str = "disk", *, config: CacheConfig, pool: MemoryPool,
                 path: str | os.PathLike | None = None, capacity: int | str | None = None,
                 fsync: bool | None = None, io_threads: int = 4,
                 eviction_policy: str = "lru", **_: Any) -> None:
        path = path if path is not None else config.local_disk
        if not path:
            raise ValueError("the disk tier needs a directory: set local_disk")
        self.path = os.path.abspath(os.fspath(path))
        self.capacity = parse_size(config.local_disk_size if capacity is None else capacity,
                                   "local_disk_size")
        self.fsync = config.disk_fsync if fsync is None else bool(fsync)
        self.pool = pool
        self.metrics = TierMetrics(self.name)
        self._lock = threading.Lock()
        # what the directory holds, its bytes and the eviction rule (index.py), under _lock
        self.index = DiskIndex(self.capacity, eviction_policy)
        self._writing: set[Key] = set()
        self._seq = itertools.count()
        self._tag = secrets.token_hex(4)  # two instances in one process never share a name
        self._tls = threading.local()
        self.coordinators = Coordinators("lmc-disk-layers")  # layered reads in progress
        # the one framing stage of shared tiers (lmc.storage.framing); the directory is this
        # process's alone, so its files carry no keyed tag (header version 1)
        self.framing = ValueFraming()
        self._closed = False
        self._warned: set[str] = set()
        # the engine's chunk geometry (lmc.storage.integrity.expect_geometry): a file whose header
        # describes another chunk is refused from its header, like a checksum failure
        self.expected_geometry: Geometry | None = None
        os.makedirs(self.path, exist_ok=True)
        self._check_ownership()  # before the lock file: refuse a foreign directory untouched
        self._dir_lock = _DirLock(self.path)  # before anything writes or deletes files
        # a tier dropped without close() still frees the directory when it is collected
        self._unlock = weakref.finalize(self, self._dir_lock.release)
        try:
            self._claim_directory()
            self.direct = self._probe_direct()
            self._scan()
        except BaseException:
            self._unlock()
            raise
        self._io = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="lmc-disk")
        # writes (the write-behind's, no request waits for them) on threads of their own at
        # a lower priority, so a busy host gives the engine and the reads first (lmc.priority)
        self._io_write = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="lmc-disk-w",
                                            initializer=lower_thread_priority)

    # ------------------------------------------------------------------ paths
    def _path(self, key: Key, size: int) -> str:
        return os.path.join(self.path, f"{key.hex()}.{size}.kv")

    def _tmp_path(self) -> str:
        return os.path.join(self.path, f".tmp.{os.getpid()}.{self._tag}{next(self._seq):x}")

    def _buf(self, name: str) -> memoryview:
        """A per-thread page-aligned 4 KiB buffer (O_DIRECT needs aligned memory)."""
        mv = getattr(self._tls, name, None)
        if mv is None:
            mv = memoryview(mmap.mmap(-1, BLOCK))
            setattr(self._tls, name, mv)
        return mv

    # --------------------------------------------------------------- start-up
    def _check_ownership(self) -> None:
        """Refuse a non-empty directory without lmc's marker (lmc deletes what it does not
        recognise, so it must never adopt a directory holding someone else's files)."""
        if os.path.exists(os.path.join(self.path, MARKER)):
            return
        with os.scandir(self.path) as it:
            names = [e.name for e in it if not e.is_dir(follow_symlinks=False)]
        if MARKER in names:
            # another process claimed it between the check above and this listing: its
            # marker is written before any other file, so whatever else is here is lmc's
            return
        strangers = [n for n in names if n != LOCK]
        if strangers:
            raise ValueError(
                f"local_disk {self.path!r} holds files lmc did not write ({strangers[0]!r}...); "
                f"lmc deletes files it does not recognise in its directory, so give it an "
                f"empty or new one")

    def _claim_directory(self) -> None:
        """Under the lock: check again (another process may have written meanwhile), then
        mark the directory as lmc's."""
        marker = os.path.join(self.path, MARKER)
        if os.path.exists(marker):
            return
        self._check_ownership()
        with open(marker, "w") as f:
            f.write("lmc disk tier: files here are managed (and deleted) by lmc\n")

    def _probe_direct(self) -> bool:
        if not _O_DIRECT:
            return False
        tmp = self._tmp_path()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
            try:
                os.pwritev(fd, [self._buf("_wbuf")], 0)
            finally:
                os.close(fd)
            return True
        except OSError as e:
            if self.path not in _buffered_logged:
                _buffered_logged.add(self.path)
                log.warning("disk tier %s: O_DIRECT not supported here (%s); using buffered I/O",
                            self.path, e.strerror or e)
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _scan(self) -> None:
        """Rebuild the index from file names; remove debris (stale temp files, foreign or
        truncated files); evict down to capacity."""
        found: list[tuple[int, Key, int]] = []
        t0 = last = time.monotonic()
        bad = foreign = temps = seen = found_bytes = 0
        with os.scandir(self.path) as it:
            for e in it:
                seen += 1
                if time.monotonic() - last >= SCAN_PROGRESS_SECONDS:
                    last = time.monotonic()
                    log.info("disk tier %s: index rebuild: %d files seen, %d chunks (%s) "
                             "so far, %s", self.path, seen, len(found), units.size(found_bytes),
                             units.seconds(last - t0))
                name = e.name
                if name in (MARKER, LOCK) or e.is_dir(follow_symlinks=False):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                m = _NAME.match(name)
                if m:
                    size = int(m[2])
                    if (stat.S_ISREG(st.st_mode) and st.st_size == size and size > BLOCK
                            and size % BLOCK == 0):
                        found.append((st.st_mtime_ns, bytes.fromhex(m[1]), size))
                        found_bytes += size
                        continue
                    bad += 1
                elif _TMP.match(name):
                    # the directory's lock is ours, and every writer holds it while it
                    # writes: whatever PID the name carries (a dead writer's may equal ours,
                    # e.g. PID 1 in a restarted container), no live writer owns this file
                    temps += 1
                else:
                    foreign += 1
                with contextlib.suppress(OSError):
                    os.unlink(e.path)
        found.sort()
        for _, key, size in found:
            old = self.index.forget(key)
            if old is not None:  # two sizes for one key: keep the newer file
                with contextlib.suppress(OSError):
                    os.unlink(self._path(key, old.size))
            self.index.policy.insert(key, Entry(size))
            self.index.used += size
        self.metrics.checksum_failure(bad)
        self.metrics.error("scan", "foreign", foreign)
        self.metrics.error("scan", "stale_temp", temps)
        if bad or foreign or temps:
            log.warning("disk tier %s: removed %d truncated, %d foreign and %d temporary files",
                        self.path, bad, foreign, temps)
        with self._lock:  # over capacity (a smaller local_disk_size than last time): evict
            ev = self.index.evict(self.index.used - self.capacity, 0, self._retire_locked,
                                  recycle=False)
        self._unlink(ev.victims, ev.dying)
        log.info("disk tier %s: index rebuilt in %s: %d chunks, %s of %s, %s I/O", self.path,
                 units.seconds(time.monotonic() - t0), len(self.index.entries),
                 units.size(self.index.used), units.size(self.capacity),
                 "O_DIRECT" if self.direct else "buffered")

    # ------------------------------------------------------------------ reads
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        if self._closed:  # its index may describe files the next tier on this directory owns
            return [False] * len(keys)
        idx = self.index.entries
        return [k in idx for k in keys]

    def _reserve_reads(self, keys: Sequence[Key]) -> list[tuple[int, Key, Entry]] | None:
        """``(position, key, entry)`` of each hit, each entry counted as read (so it is not
        recycled until :meth:`_reader_done`) and accessed in the eviction policy; ``None`` once closed."""
        jobs: list[tuple[int, Key, Entry]] = []
        with self._lock:
            if self._closed:
                return None
            for i, k in enumerate(keys):
                e = self.index.entries.get(k)
                if e is not None:
                    e.readers += 1  # not recycled while we read it
                    self.index.policy.access(k)
                    jobs.append((i, k, e))
        return jobs

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = [None] * len(keys)
        jobs = self._reserve_reads(keys)
        if jobs is None:
            return out
        futures = []
        for _, k, e in jobs:
            try:
                futures.append(self._io.submit(self._read, k, e))
            except RuntimeError:  # closed meanwhile
                break
        for (i, _, e), f in itertools.zip_longest(jobs, futures):
            try:  # every future is waited for: none may still write into a pool object
                out[i] = f.result() if f is not None else None
            except CancelledError:  # close() cancelled it before it ran
                f = None
            if f is None:
                with self._lock:
                    e.readers -= 1
        return out

    def get_layers(self, keys: Sequence[Key]) -> LayeredRead | None:
        """Open the hits (headers checked, objects allocated, in parallel) and read them
        layer by layer in the background (:mod:`lmc.storage.backends.disk.disk_layered_read`)."""
        from .disk_layered_read import DiskLayeredRead

        jobs = self._reserve_reads(keys)
        if jobs is None:
            return None
        call = DiskLayeredRead(DiskReads(self), jobs, len(keys))
        call.start()
        return call.read

    def _reader_done(self, entry: Entry) -> None:
        with self._lock:
            entry.readers -= 1

    def _open(self, path: str, flags: int, direct: bool) -> int:
        return os.open(path, flags | (_O_DIRECT if direct else 0), 0o644)

    def _open_value(self, key: Key, entry: Entry) -> OpenValue:
        """Open a value's file, check its header and allocate its pool object (one reference
        for the caller). Raises like a read: ``CorruptValue``, ``OSError``, or
        :class:`_NoMemory` when the pool has no room."""
        path = self._path(key, entry.size)
        fd = self._open(path, os.O_RDONLY, self.direct)
        try:
            block = self._buf("_rbuf")
            framing = self.framing
            if io_all(os.preadv, fd, [block], 0) < framing.size:
                raise CorruptValue("file shorter than its header")
            head = bytes(block[:framing.size])
            h = framing.decode(head, key, self.expected_geometry)  # before allocating for it
            padded = round_up(h.payload_len)
            if entry.size != BLOCK + padded:
                raise CorruptValue(f"file is {entry.size} bytes, header needs {BLOCK + padded}")
            obj = self.pool.allocate(h.shape, h.dtype, h.num_tokens)
            if obj is None:
                raise _NoMemory()
            try:
                if obj.nbytes != h.payload_len:
                    raise CorruptValue(f"header's shape and dtype make {obj.nbytes} bytes, its "
                                       f"payload length says {h.payload_len}")
                spans = _payload_spans(obj, self.direct)
                if spans is None and self.direct:  # unaligned destination: buffered instead
                    os.close(fd)
                    fd = -1
                    fd = self._open(path, os.O_RDONLY, False)
            except BaseException:
                obj.release()
                raise
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return OpenValue(key, entry, fd, obj, head, h, spans)

    def _read_failed(self, key: Key, entry: Entry, e: BaseException) -> None:
        """A read's error as the contract wants it: a miss, counted; a bad value deleted."""
        name = os.path.basename(self._path(key, entry.size))
        if isinstance(e, FileNotFoundError):
            self._forget(key, entry)  # evicted or deleted under us: a plain miss
        elif isinstance(e, _NoMemory):
            self.metrics.error("get", "no_memory")
        elif isinstance(e, CorruptValue):
            log.warning("disk tier: %s: %s; deleted, served as a miss", name, e)
            self.metrics.checksum_failure()
            self._discard(key, entry)
        elif isinstance(e, OSError):
            self.metrics.error("get", errno.errorcode.get(e.errno or 0, "oserror"))
            log.warning("disk tier: reading %s failed: %s", name, e)
        else:  # e.g. the pool closed under us: a miss, never an error
            self.metrics.error("get", type(e).__name__)
            log.warning("disk tier: reading %s failed: %s", name, e)

    def _read(self, key: Key, entry: Entry) -> MemoryObj | None:
        """One value into a new pool object; ``None`` (and the file gone) if anything is off."""
        v = None
        try:
            v = self._open_value(key, entry)
            padded = round_up(v.hdr.payload_len)
            assert v.obj is not None  # a value just opened holds its object
            view = v.obj.byte_view()
            if v.spans is None:
                bufs, want = [view], view.nbytes
            else:  # the tail's block lands in our buffer: nothing past nbytes is written
                head, tail = v.spans
                tbuf = self._buf("_rtail")
                bufs = [head, tbuf] if tail.nbytes else [head]
                want = padded
            if io_all(os.preadv, v.fd, bufs, BLOCK) < want:
                raise CorruptValue("file truncated")
            if v.spans is not None and v.spans[1].nbytes:
                v.spans[1][:] = tbuf[: v.spans[1].nbytes]
            self.framing.verify(key, v.head, v.hdr, view)
            out, v.obj = v.obj, None
            return out
        except Exception as e:
            self._read_failed(key, entry, e)
            return None
        finally:
            if v is not None:
                v.close()
            with self._lock:
                entry.readers -= 1

    def _forget(self, key: Key, entry: Entry) -> None:
        with self._lock:
            if self.index.entries.get(key) is entry:
                self.index.forget(key)

    def _discard(self, key: Key, entry: Entry) -> None:
        """Remove a bad value: renamed away under the lock (so a concurrent rewrite of the same
        key cannot be hit), unlinked outside it."""
        with self._lock:
            if self.index.entries.get(key) is not entry:
                return
            self.index.forget(key)
            tmp = self._retire_locked(key, entry.size)
            if tmp:
                self.index.dying += entry.size
        if tmp:
            self._unlink([tmp], entry.size)

    # ----------------------------------------------------------------- writes
    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        """Write the chunks (in parallel); returns how many are now stored. Returns only when
        every value is visible (and with ``disk_fsync``, durable)."""
        pairs = list(zip(keys, objs, strict=True))
        if not pairs or self._closed:
            return 0
        futures = []
        for k, o in pairs:
            try:
                futures.append(self._io_write.submit(self._write, k, o))
            except RuntimeError:  # closed meanwhile
                break
        stored = 0
        for f in futures:
            with contextlib.suppress(CancelledError):  # close() cancelled it before it ran
                stored += bool(f.result())
        if self.fsync and stored:
            self._fsync_dir()
        return stored

    def _warn_once(self, reason: str, msg: str) -> None:
        """A full disk fails every write: say so once per reason, count the rest."""
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("%s (further %s errors are only counted)", msg, reason)

    def _fsync_dir(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            self.metrics.error("put", "dir_fsync")
            log.warning("disk tier %s: directory fsync failed: %s", self.path, e)

    def _write(self, key: Key, obj: MemoryObj) -> bool:
        if not encodable(obj):  # skipped and counted, as every tier does
            self.metrics.error("put", "unsupported")
            return False
        padded = round_up(obj.nbytes)
        size = BLOCK + padded
        if size > self.capacity:
            self.metrics.error("put", "too_large")
            return False
        with self._lock:
            if key in self.index.entries:
                self.index.policy.access(key)
                return True
            if key in self._writing:
                return True
            self._writing.add(key)
        try:
            ok, recycled = self._reserve(size)
            if not ok:  # the rest is taken by writes in flight
                self.metrics.error("put", "no_space")
                return False
            tmp = recycled or self._tmp_path()
            try:
                self._write_file(tmp, key, obj, padded, create=recycled is None)
                os.rename(tmp, self._path(key, size))
            except Exception as e:  # ENOSPC, EIO, a bad key...: this value is skipped
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                with self._lock:
                    self.index.reserved -= size
                if isinstance(e, OSError):
                    reason = "enospc" if e.errno == errno.ENOSPC else errno.errorcode.get(
                        e.errno or 0, "oserror")
                else:
                    reason = type(e).__name__
                self.metrics.error("put", reason)
                self._warn_once(reason, f"disk tier {self.path}: write skipped: {e}")
                return False
            with self._lock:
                self.index.commit(key, size)
            return True
        finally:
            with self._lock:
                self._writing.discard(key)

    def _write_file(self, path: str, key: Key, obj: MemoryObj, padded: int, create: bool
                    ) -> None:
        payload = obj.byte_view()
        spans = _payload_spans(obj, self.direct)
        pad = padded - obj.nbytes
        if spans is None:  # buffered: the padding comes from a constant
            bufs = [payload, _ZEROS[:pad]] if pad else [payload]
        else:  # the tail and its padding go from our aligned buffer, never from pool bytes
            head, tail = spans
            bufs = [head]
            if tail.nbytes:
                tbuf = self._buf("_wtail")
                tbuf[: tail.nbytes] = tail
                tbuf[tail.nbytes:] = _ZEROS[tail.nbytes:]
                bufs.append(tbuf)
        hdr = self._buf("_wbuf")
        vhead = self.framing.encode(key, obj, payload)
        hdr[:len(vhead)] = vhead  # the rest of the block: zeros from the mapping, never written
        flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = self._open(path, flags, spans is not None)
        try:
            if io_all(os.pwritev, fd, [hdr, *bufs], 0) < BLOCK + padded:
                raise OSError(errno.EIO, "short write")
            if self.fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    # --------------------------------------------------------------- eviction
    def _retire_locked(self, key: Key, size: int) -> str | None:
        """Rename a value's file to a temporary name: its key is gone at once, and the file
        can be unlinked (slow with discard) or overwritten outside the lock."""
        tmp = self._tmp_path()
        try:
            os.rename(self._path(key, size), tmp)
        except OSError:
            return None
        return tmp

    def _reserve(self, size: int) -> tuple[bool, str | None]:
        """Reserve ``size`` bytes, evicting values in the policy's order; returns (ok, a temporary file of
        exactly ``size`` bytes to overwrite when a victim could be recycled). The directory
        never holds more than ``capacity``: a new file's bytes are reserved only once its
        victims are unlinked."""
        for _ in range(8):  # writers in flight may take the room we freed: try again
            with self._lock:
                done, ev = self.index.make_room(size, self._retire_locked)
            if ev is None:
                return True, None
            self._evicted(ev)
            if done:
                return True, ev.recycled
            if not ev.victims:
                return False, None
        return False, None

    def _evicted(self, ev: Eviction) -> None:
        """After an eviction, outside the lock: unlink the victims, tell ``on_evicted``."""
        self._unlink(ev.victims, ev.dying)
        if ev.gone and self.on_evicted is not None:
            self.on_evicted(ev.gone)

    def _unlink(self, paths: Sequence[str], dying: int = 0) -> None:
        for p in paths:
            with contextlib.suppress(OSError):
                os.unlink(p)
        if dying:
            with self._lock:
                self.index.dying -= dying

    def delete(self, keys: Sequence[Key]) -> int:
        gone: list[str] = []
        n = dying = 0
        with self._lock:
            if self._closed:  # the directory is no longer ours: a closed tier deletes nothing
                return 0
            for k in keys:
                e = self.index.forget(k)
                if e is None:
                    continue
                n += 1
                tmp = self._retire_locked(k, e.size)
                if tmp:
                    gone.append(tmp)
                    self.index.dying += e.size
                    dying += e.size
        self._unlink(gone, dying)
        return n

    def clear_namespace(self, prefix: bytes = b"") -> list[Key]:
        """Every value in the directory (it is this tier's alone: one tier per directory),
        or those whose key starts with ``prefix``; files being read go once their reads end
        (as a delete's)."""
        with self._lock:
            if self._closed:
                return []
            keys = [k for k in self.index.entries if k.startswith(prefix)]
        self.delete(keys)
        return keys

    def set_priority(self, keys: Sequence[Key], priority: int) -> int:
        with self._lock:
            return self.index.policy.set_priority(keys, priority)

    def priority_of(self, key: Key) -> int:
        with self._lock:
            return self.index.policy.priority_of(key)

    def rank_arrivals(self, source: Callable[[Key], int | None] | None) -> None:
        with self._lock:
            self.index.policy.arrival = source

    def demote(self, keys: Sequence[Key]) -> None:
        with self._lock:
            self.index.policy.demote(keys)

    def refresh(self, keys: Sequence[Key]) -> None:
        with self._lock:
            policy = self.index.policy
            held = [k for k in keys if k in policy.entries]
            policy.touch_many(held)
            if policy.arrival is not None:  # the rank L1 gave it since, as a write would
                for k in held:
                    p = policy.arrival(k)
                    if p is not None and p != policy.priority_of(k):
                        policy.set_priority((k,), p)

    # ------------------------------------------------------------------- misc
    @property
    def used_bytes(self) -> int:
        return self.index.used

    def __len__(self) -> int:
        return len(self.index.entries)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._io.shutdown(wait=True, cancel_futures=True)  # only the I/O in progress finishes
        self._io_write.shutdown(wait=True, cancel_futures=True)
        self.coordinators.close()  # layered reads end (failed) once their I/O did
        self._unlock()  # the directory is free for the next tier (idempotent)

    def stats(self) -> dict[str, Any]:
        return {"chunks": len(self.index.entries), "used_bytes": self.index.used,
                "capacity": self.capacity, "direct_io": float(self.direct),
                "checksum_failures": self.metrics.get("checksum_failures")}


class DiskReads:
    """What the tier hands its layered reader (:mod:`.layered`), and all that reader may
    use of it: the I/O threads, opening and failing values under the tier's rules (index,
    eviction order, counting, deletion), its aligned buffers, its coordinators, its framing
    and metrics. The tier's index, lock and files stay its own."""

    def __init__(self, tier: DiskBackend) -> None:
        self._tier = tier
        self.framing = tier.framing
        self.metrics = tier.metrics
        self.coordinators = tier.coordinators

    def submit(self, fn: Any, *args: Any) -> Any:
        """A job on the tier's I/O threads (a ``Future``); ``RuntimeError`` once it closed."""
        return self._tier._io.submit(fn, *args)

    def open_value(self, key: Key, entry: Entry) -> OpenValue:
        """Open a value: its header checked, its pool object allocated (one reference)."""
        return self._tier._open_value(key, entry)

    def read_failed(self, key: Key, entry: Entry, e: BaseException) -> None:
        """A read's error as the contract wants it: a miss, counted; a bad value deleted."""
        self._tier._read_failed(key, entry, e)

    def reader_done(self, entry: Entry) -> None:
        """The read of ``entry`` ended (the file may be recycled again)."""
        self._tier._reader_done(entry)

    def buffer(self, name: str) -> memoryview:
        """This thread's page-aligned 4 KiB buffer ``name`` (O_DIRECT tails)."""
        return self._tier._buf(name)
