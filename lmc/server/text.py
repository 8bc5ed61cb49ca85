"""Names a peer chose (namespaces, client names, tier and group names in a STATS answer), made
safe for a terminal or a log line.

Why: a namespace is any string up to 64 bytes, and a STATS answer comes from whatever is at
the other end of the socket. Printed raw, ``"x\\x1b]0;pwned\\x07\\x1b[2J\\n# Memory"`` retitles the
operator's terminal, clears it and forges a section of ``lmc stats``. Every character that is
not printable (C0/C1 controls, DEL, line and paragraph separators, bidi overrides and other
format characters) is written as a Python escape, and the backslash itself as ``\\\\``, so the
escaped form is unambiguous and the original can be told from a forgery.
"""

from __future__ import annotations

from typing import Any


def _escape_char(c: str) -> str:
    if c == "\\":
        return "\\\\"
    if c.isprintable():
        return c
    n = ord(c)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def safe(s: Any, limit: int | None = None) -> str:
    """``s`` (any value; non-strings via ``str``) with every non-printable character escaped,
    cut to ``limit`` characters of the original (an ellipsis marks the cut); ``-`` if empty."""
    text = s if isinstance(s, str) else str(s)
    cut = limit is not None and len(text) > limit
    if cut:
        text = text[:limit]
    out = "".join(c if c.isprintable() and c != "\\" else _escape_char(c) for c in text)
    return (out + "...") if cut else (out or "-")
