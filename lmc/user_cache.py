"""lmc's cache folder: ``$XDG_CACHE_HOME/lmc``, else ``~/.cache/lmc``.

What lives there is this user's: copy-path calibrations, the planner's profile, tiny
checkpoints, and the weights' digests the model identity is made of. A file there that
another user can write is a way to make lmc believe something (that a checkpoint is the one
whose KV a shared tier holds), so files that decide what KV is served live in
:func:`private_dir`: created ``0700``, and used only while it and the folder above it are
owned by this user and writable by no one else. Anything else is a reason not to use the
cache (the caller recomputes), named once in a WARNING.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)
_warned: set[str] = set()


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lmc``, else ``~/.cache/lmc`` (not created)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmc"


def unsafe_reason(st: os.stat_result, what: str) -> str | None:
    """Why a folder or file with status ``st`` cannot hold what only this user may write:
    another owner, or writable by group or others (None: fine)."""
    if st.st_uid != os.geteuid():
        return f"{what} is owned by uid {st.st_uid}, not this user ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_dir(name: str) -> Path | None:
    """``cache_dir() / name``, created ``0700`` if missing; None (with one WARNING naming
    why) when it cannot be made or is not this user's alone."""
    parent = cache_dir()
    path = parent / name
    try:
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        why = (unsafe_reason(os.stat(parent), str(parent))
               or unsafe_reason(os.lstat(path), str(path)))
        if why is None and not stat.S_ISDIR(os.lstat(path).st_mode):
            why = f"{path} is not a folder"
        if why is None and stat.S_IMODE(os.lstat(path).st_mode) & 0o077:
            os.chmod(path, 0o700)  # ours: made private, as it should have been
    except OSError as e:
        why = f"{path} cannot be made ({e.strerror or e})"
    if why is None:
        return path
    if why not in _warned:
        _warned.add(why)
        log.warning("lmc cache not used: %s", why)
    return None
