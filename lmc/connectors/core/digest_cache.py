"""Weight digests kept across restarts, so a start-up does not read 16 GB again.

One JSON file, ``<cache>/identity/weight-digests.json`` (:mod:`lmc.user_cache`), maps a
weight file's real path to the digest of its bytes and the state it had when hashed: size,
mtime and ctime in nanoseconds, inode and device. An entry is used only while all of them
match the file now: rewriting a file, touching it, copying another over it or renaming one
into its place changes one of them (ctime cannot be set by a user: even a write that puts
the old mtime back moves it). A file changed less than :data:`RACY_NS` before its digest would
be stored is not stored: where timestamps are coarse (seconds), a same-size rewrite within the
same tick would otherwise look unchanged.

The file decides which KV a model is served, so whoever can write it could name the wrong
weights: it lives in a folder only this user can write (``0700``), is written ``0600``
through a temporary file and a rename under a lock, and is read strictly: a file not
this user's alone, larger than :data:`MAX_FILE_BYTES`, not JSON, or with any entry not
exactly lmc's format is not used (one WARNING naming why; the weights are hashed again and
the file rewritten). At most :data:`MAX_ENTRIES` entries are kept (those of files that are
gone first, then the oldest).

Several processes starting on one checkpoint (the ranks of a tensor-parallel engine) share
the work: a process *claims* a file before hashing it (a byte-range lock on
``weight-digests.claims``, a byte per path), hashes the files no one else claimed, then
waits for the others' results instead of reading those files again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from lmc.bounded_io import read_at_most
from lmc.connectors.core.weight_digest import DIGEST_FORMAT, FileState
from lmc.strict_json import InputError, parse_json
from lmc.user_cache import private_dir, unsafe_reason

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
MAX_ENTRIES = 4096
MAX_FILE_BYTES = 4 << 20
MAX_PATH_CHARS = 4096
RACY_NS = 3_000_000_000  # a file changed this recently is hashed again next time
_FIELDS = ("size", "mtime_ns", "ctime_ns", "ino", "dev")
_ENTRY_KEYS = frozenset(_FIELDS) | {"digest", "stored"}
_HEX32 = re.compile(r"[0-9a-f]{32}")
_warned: set[str] = set()
_claimed: dict[str, threading.Lock] = {}  # this process's claims, by path (threads)
_claims_guard = threading.Lock()
_claims_fd: dict[str, int] = {}  # one descriptor per claims file for the process's life


class CacheRefused(ValueError):
    """The cache file is not lmc's (format, owner, mode, size): not used."""


class DigestCache:
    """The digests at ``folder`` (default: lmc's private ``identity`` folder); with no usable
    folder, every lookup misses and nothing is stored."""

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        base = Path(folder) if folder is not None else private_dir("identity")
        self.path = base / "weight-digests.json" if base is not None else None
        self.reads = 0  # times the file was read (tests count these, never timings)

    # ----------------------------------------------------------------- reading
    def lookup(self, states: list[FileState]) -> dict[str, str]:
        """``{path: digest}`` of the states recorded exactly as they are (one read)."""
        entries = self._entries() if states else {}
        out = {}
        for state in states:
            entry = entries.get(state.path)
            if entry is not None and all(entry[k] == getattr(state, k) for k in _FIELDS):
                out[state.path] = str(entry["digest"])
        return out

    def _entries(self) -> dict[str, dict[str, Any]]:
        if self.path is None:
            return {}
        try:
            return self._load()
        except FileNotFoundError:
            return {}
        except (CacheRefused, OSError) as e:
            why = f"{self.path}: {e}"
            if why not in _warned:
                _warned.add(why)
                log.warning("weight digest cache not used (%s): weights are hashed again "
                            "and the file rewritten", why)
            return {}

    def _load(self) -> dict[str, dict[str, Any]]:
        assert self.path is not None
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CacheRefused("not a regular file")
            why = unsafe_reason(st, "it")
            if why:
                raise CacheRefused(why)
            if st.st_size > MAX_FILE_BYTES:
                raise CacheRefused(f"larger than {MAX_FILE_BYTES} bytes")
            raw = read_at_most(f, MAX_FILE_BYTES)
        self.reads += 1
        if len(raw) > MAX_FILE_BYTES:
            raise CacheRefused(f"larger than {MAX_FILE_BYTES} bytes")
        try:
            doc = parse_json(raw.decode("utf-8"), str(self.path), document=True)
        except (InputError, UnicodeDecodeError) as e:
            raise CacheRefused(str(e)) from None
        return check_document(doc)

    # ----------------------------------------------------------------- writing
    def put(self, results: dict[str, tuple[FileState, str]]) -> int:
        """Record digests (merged with what other processes recorded meanwhile); returns how
        many were recorded. A file changed within :data:`RACY_NS` of now is not: on a file
        system with coarse timestamps a rewrite in the same tick, same size, would keep
        every field of its state (git's "racily clean" entries)."""
        if self.path is None or not results:
            return 0
        now_ns = time.time_ns()
        fresh = {p: r for p, r in results.items() if len(p) <= MAX_PATH_CHARS
                 and max(r[0].mtime_ns, r[0].ctime_ns) <= now_ns - RACY_NS}
        if not fresh:
            return 0
        try:
            with self._locked(".lock", fcntl.LOCK_EX):
                entries = self._entries()
                for state, digest in fresh.values():
                    entries[state.path] = {**{k: getattr(state, k) for k in _FIELDS},
                                           "digest": digest, "stored": now_ns / 1e9}
                self._write(_pruned(entries))
        except OSError as e:
            log.warning("weight digests not cached (%s): the next start hashes them again",
                        e.strerror or e)
            return 0
        return len(fresh)

    def _write(self, entries: dict[str, dict[str, Any]]) -> None:
        assert self.path is not None
        doc = {"format": CACHE_FORMAT, "digest": DIGEST_FORMAT, "entries": entries}
        data = json.dumps(doc, indent=0, sort_keys=True).encode()
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".digests-", suffix=".tmp")
        try:  # mkstemp creates it 0600
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @contextlib.contextmanager
    def _locked(self, suffix: str, how: int) -> Iterator[None]:
        assert self.path is not None
        fd = os.open(self.path.with_name(self.path.name + suffix),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ claims
    @contextlib.contextmanager
    def claim(self, path: str, wait: float) -> Iterator[bool]:
        """Hold the right to hash ``path`` (across processes and threads). ``wait`` 0: try
        once; else wait up to ``wait`` seconds. Yields whether it was obtained (not
        obtained: another one is hashing it, or the wait ran out)."""
        if self.path is None:
            yield True
            return
        with _claims_guard:
            local = _claimed.setdefault(path, threading.Lock())
        deadline = time.monotonic() + wait
        got = local.acquire(timeout=max(wait, 0)) if wait > 0 else local.acquire(False)
        if not got:
            yield False
            return
        try:
            fd, offset = self._claims_fd(), xxhash.xxh3_64_intdigest(os.fsencode(path)) % (1 << 40)
            while True:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
                    break
                except OSError:
                    if time.monotonic() >= deadline:
                        yield False
                        return
                    time.sleep(0.05)
            try:
                yield True
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)
        finally:
            local.release()

    def _claims_fd(self) -> int:
        """POSIX locks belong to the process and drop when any of its descriptors of the
        file closes: one descriptor per claims file, never closed."""
        assert self.path is not None
        name = str(self.path.with_name(self.path.name[: -len(".json")] + ".claims"))
        with _claims_guard:
            if name not in _claims_fd:
                _claims_fd[name] = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                                           | getattr(os, "O_CLOEXEC", 0), 0o600)
            return _claims_fd[name]


def check_document(doc: Any) -> dict[str, dict[str, Any]]:
    """The entries of a parsed cache file, or :class:`CacheRefused` naming the first thing
    that is not exactly lmc's format."""
    if not isinstance(doc, dict) or set(doc) != {"format", "digest", "entries"}:
        raise CacheRefused("not a weight digest cache (expected format, digest, entries)")
    if doc["format"] != CACHE_FORMAT or doc["digest"] != DIGEST_FORMAT:
        raise CacheRefused(f"format {doc['format']!r} / {doc['digest']!r}, expected "
                           f"{CACHE_FORMAT} / {DIGEST_FORMAT}")
    entries = doc["entries"]
    if not isinstance(entries, dict) or len(entries) > MAX_ENTRIES:
        raise CacheRefused(f"entries must be an object of at most {MAX_ENTRIES}")
    for path, e in entries.items():
        if not (isinstance(e, dict) and set(e) == _ENTRY_KEYS and os.path.isabs(path)
                and len(path) <= MAX_PATH_CHARS
                and all(type(e[k]) is int and e[k] >= 0 for k in _FIELDS)
                and isinstance(e["digest"], str) and _HEX32.fullmatch(e["digest"])
                and type(e["stored"]) in (int, float) and math.isfinite(e["stored"])):
            raise CacheRefused(f"entry {path[:200]!r} is not a weight digest entry")
    return entries


def _pruned(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """At most MAX_ENTRIES: entries of vanished files go first, then the oldest."""
    if len(entries) <= MAX_ENTRIES:
        return entries
    live = {p: e for p, e in entries.items() if os.path.exists(p)}
    newest = sorted(live.items(), key=lambda pe: pe[1]["stored"], reverse=True)
    return dict(newest[:MAX_ENTRIES])
