"""Reading at most so many bytes without reserving them first.

Why: ``f.read(n)`` on a buffered file or an HTTP answer reserves ``n`` bytes before it reads
one (CPython allocates the result, then fills it), so a bound written as ``f.read(limit + 1)``
costs the whole bound in address space for every input: a 100-byte file read with a 4 GiB
limit fails with ``MemoryError`` under a 3 GiB ``RLIMIT_AS``. :func:`read_at_most` asks for
what the file says it holds (its size, where it has one) and for bounded pieces beyond it, so
memory follows what arrives.
"""

from __future__ import annotations

import os
import stat
from typing import Any

PIECE = 1 << 20  # past the known size: what one read() asks for (and so reserves)
MAX_PIECE = 64 << 20  # within the known size: the largest single read


def known_size(f: Any) -> int:
    """The byte size of ``f``'s regular file, 0 when it has none (a pipe, a socket)."""
    try:
        st = os.fstat(f.fileno())
    except (AttributeError, OSError, ValueError):
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def read_at_most(f: Any, limit: int) -> bytes:
    """``f``'s bytes up to its end, but never more than ``limit + 1`` of them (so the caller
    sees a longer input as ``len(result) > limit``); the buffer grows with what is read."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    expected = known_size(f)
    pieces: list[bytes] = []
    got = 0
    while got <= limit:
        ahead = expected - got
        ask = min(MAX_PIECE, ahead + 1) if ahead > 0 else PIECE
        piece = f.read(min(ask, limit + 1 - got))
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
