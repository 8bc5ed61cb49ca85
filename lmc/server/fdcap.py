"""How many client connections the daemon may hold without taking the file descriptors its
tiers need.

Why: every accepted socket is a file descriptor, and so is every file the disk tier opens to
write or read a value, every Redis connection and every /metrics connection. A daemon that
accepts until ``accept()`` fails with EMFILE has, at that moment, left nothing for the tiers:
a disk write fails and a read fails after its destination was allocated (issue 20 lost every
value that way). So the connection cap is what ``RLIMIT_NOFILE`` leaves once the descriptors
open at start-up and a reserve (``fd_reserve``, at most half the limit) are set aside, and
the soft limit is first raised toward the hard one when ``max_connections`` asks for more.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("lmc.server.daemon")


class FdLimitError(ValueError):
    """The fd limit leaves no room for client connections (start-up fails, naming it)."""


def open_fds() -> int:
    """Descriptors this process has open now (0 where /proc is not there)."""
    try:
        return max(0, len(os.listdir("/proc/self/fd")) - 1)  # less listdir's own
    except OSError:
        return 0


def raise_soft_limit(want: int) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` toward ``want`` (never past the hard limit); returns
    the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(max_connections: int, reserve: int) -> int:
    """Connections the daemon may hold: ``max_connections``, lowered to what the fd limit
    leaves after the descriptors open now and ``reserve``. Raises :class:`FdLimitError`
    (naming the limit, the count and the key) when that leaves fewer than 2."""
    in_use = open_fds()
    soft = raise_soft_limit(max_connections + in_use + reserve + 1)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    reserve = min(reserve, soft // 2)  # a low limit still leaves half of it to clients
    # one more for the socket a displacement accepts before the displaced one is closed
    room = soft - in_use - reserve - 1
    if room < 2:
        raise FdLimitError(
            f"fd_reserve: RLIMIT_NOFILE {soft} leaves room for {max(room, 0)} connection(s) "
            f"({in_use} descriptors open at start-up, fd_reserve {reserve}); raise the limit "
            "(ulimit -n) or lower fd_reserve")
    cap = min(max_connections, room)
    if cap < max_connections:
        log.info("max_connections %d lowered to %d: RLIMIT_NOFILE %d, %d descriptors open, "
                 "fd_reserve %d kept for the tiers", max_connections, cap, soft, in_use,
                 reserve)
    return cap
