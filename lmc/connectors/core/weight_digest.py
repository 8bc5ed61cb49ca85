"""The digest of a weight file: every byte of it, read in bounded pieces, several at once.

Why every byte: KV is a function of the weights, so two checkpoints that differ anywhere
(a fine-tune that touched a few tensors) must never share KV. A sampled fingerprint (the
first, middle and last MiB) missed a 256 KiB change at 30% of a file, and the changed model
was served the original's KV.

Why xxh3_128 over 256 MiB segments: a 16 GB checkpoint read once at start-up must cost
seconds, not minutes. xxh3 hashes at several GB/s per core and releases the GIL for
large updates (the engine's other threads keep running); the file is cut into
:data:`SEGMENT` pieces hashed by a few threads at once (each ``preadv`` into its own
bounded buffer, also without the GIL), and the file's digest is the xxh3_128 of its size
and its segments' digests in order. Not a cryptographic hash: it tells checkpoints apart
when nobody crafts a collision; whoever can write the weights chooses the model's outputs
anyway (``docs/design.md``, *Model identity*).

A file that changes while it is read (size, times or inode differ before and after, or a
read comes back short) raises :class:`WeightsChanged`: a digest of half old, half new bytes
names no checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

SEGMENT = 256 << 20  # hashed alone, in parallel with others; part of the digest's definition
BLOCK = 1 << 20  # one read: the bounded buffer each thread holds (1 MiB: still in cache when hashed)
DIGEST_FORMAT = f"xxh3_128/segments-{SEGMENT}"
MAX_THREADS = 8


class WeightsChanged(ValueError):
    """A weight file changed while it was being hashed."""


@dataclass(frozen=True)
class FileState:
    """What says a file is still the one that was hashed: the cache's key."""

    path: str  # the real path (symlinks resolved)
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, path: str, st: os.stat_result) -> FileState:
        return cls(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def file_state(path: str | os.PathLike) -> FileState:
    real = os.path.realpath(path)
    return FileState.of(real, os.stat(real))


def threads_for(total_bytes: int) -> int:
    """Hashing threads: one per core up to :data:`MAX_THREADS`, no more than segments."""
    return max(1, min(MAX_THREADS, os.cpu_count() or 1, -(-total_bytes // SEGMENT)))


class Progress:
    """Bytes hashed so far, reported through ``say`` at most every ``every`` seconds."""

    def __init__(self, total: int, say: Callable[[int, int, float], None] | None,
                 every: float = 10.0) -> None:
        self.total, self.say, self.every = total, say, every
        self.done = 0
        self.uncached = 0  # files hashed but too freshly changed to cache (digest_cache)
        self.start = self._last = time.monotonic()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.say is None or now - self._last < self.every:
                return
            self._last = now
            done = self.done
        self.say(done, self.total, now - self.start)


def _hash_segment(path: str, fd: int, offset: int, length: int, progress: Progress) -> bytes:
    h = xxhash.xxh3_128()
    buf = bytearray(min(BLOCK, max(length, 1)))
    view = memoryview(buf)
    end = offset + length
    while offset < end:
        want = min(len(buf), end - offset)
        n = os.preadv(fd, [view[:want]], offset)
        if n <= 0:
            raise WeightsChanged(f"{path} ended at byte {offset} while it was being hashed "
                                 "(it was being rewritten?); start again once it is written")
        h.update(view[:n])
        offset += n
        progress.add(n)
    return h.digest()


def digest_files(paths: Sequence[str], progress: Progress | None = None
                 ) -> dict[str, tuple[FileState, str]]:
    """``{path: (state hashed, hex digest)}`` for each of ``paths`` (real paths)."""
    progress = progress or Progress(0, None)
    opened: dict[str, tuple[int, os.stat_result]] = {}
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            opened[path] = (fd, os.fstat(fd))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        total = sum(st.st_size for _, st in opened.values())
        pool = concurrent.futures.ThreadPoolExecutor(threads_for(total),
                                                     thread_name_prefix="lmc-digest")
        try:
            jobs = {path: [pool.submit(_hash_segment, path, fd, off,
                                       min(SEGMENT, st.st_size - off), progress)
                           for off in range(0, st.st_size, SEGMENT)]
                    for path, (fd, st) in opened.items()}
            return {path: _combine(path, *opened[path], futures)
                    for path, futures in jobs.items()}
        finally:  # an error or an interrupt: queued segments are dropped, running ones end
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        for fd, _ in opened.values():
            os.close(fd)


def _combine(path: str, fd: int, before: os.stat_result,
             futures: list[concurrent.futures.Future[bytes]]) -> tuple[FileState, str]:
    h = xxhash.xxh3_128(f"{DIGEST_FORMAT}:{before.st_size}:".encode())
    for f in futures:
        h.update(f.result())
    state = FileState.of(path, before)
    if FileState.of(path, os.fstat(fd)) != state or os.stat(path).st_ino != before.st_ino:
        raise WeightsChanged(f"{path} changed while it was being hashed; start again once it "
                             "is written")
    return state, h.hexdigest()
