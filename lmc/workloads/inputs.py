"""Files a person hands the command line: traces, ShareGPT dumps, tokenizers, profiles.

Why one module: every command that reads such a file (``lmc plan``, ``lmc replay``,
``lmc workload``) must fail the same way on the same mistake, with an :class:`InputError`
naming the file (and line, where there is one) and what was wrong, never a traceback. What
is refused here, whoever reads:

- a path that is missing, a directory, unreadable, or not UTF-8 text (binary junk included);
- a line longer than :data:`MAX_LINE_BYTES`, a document larger than :data:`MAX_DOCUMENT_BYTES`;
- JSON nested deeper than :data:`MAX_JSON_DEPTH` (Python's parser would recurse until it
  raised ``RecursionError``), an object naming one key twice (JSON parsers silently keep one
  of them: which, depends on the parser), a number too long to convert (:mod:`lmc.strict_json`,
  which every other reader of others' JSON uses too);
- text holding a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but not Unicode: the
  tokenizer and the terminal raise on it later, far from the line that held it).

Threat model: ``docs/threats/cli.md``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import IO

from lmc.bounded_io import known_size, read_at_most
from lmc.strict_json import MAX_JSON_DEPTH, InputError, parse_json, shown

__all__ = ["MAX_DOCUMENT_BYTES", "MAX_JSON_DEPTH", "MAX_LINE_BYTES", "InputError",
           "has_surrogate", "iter_lines", "open_input", "parse_json", "printable",
           "read_bounded", "read_text", "shown"]

MAX_LINE_BYTES = 64 << 20  # one trace line: about 10M token ids
MAX_DOCUMENT_BYTES = 4 << 30  # one whole-file JSON document (ShareGPT V3 is 0.65 GiB)


# ------------------------------------------------------------------------- files
def open_input(path: str | os.PathLike[str], what: str = "") -> IO[bytes]:
    """``path`` opened for binary reading, every kind of failure named as an InputError."""
    label = f"{what} {path}".strip()
    try:
        if Path(path).is_dir():  # open() would succeed on some systems and fail at read
            raise InputError(f"{label}: is a directory, expected a file")
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:
        raise InputError(f"{label}: no such file") from None
    except PermissionError:
        raise InputError(f"{label}: permission denied") from None
    except OSError as e:
        raise InputError(f"{label}: cannot be read ({e.strerror or e})") from None


def _decode(raw: bytes, where: str, line_start: int = 1) -> str:
    """UTF-8 text of ``raw``; the first NUL or undecodable byte named by line and column."""
    nul = raw.find(b"\x00")
    try:
        text = raw.decode("utf-8")
        bad = -1
    except UnicodeDecodeError as e:
        bad = e.start
    if bad >= 0 and not 0 <= nul < bad:
        line, col = _position(raw, bad, line_start)
        raise InputError(f"{where}{line}: not UTF-8 text (byte 0x{raw[bad]:02x} at column "
                         f"{col})")
    if nul >= 0:
        line, col = _position(raw, nul, line_start)
        raise InputError(f"{where}{line}: binary data (a NUL byte at column {col}); expected "
                         f"UTF-8 JSON text")
    return text


def _position(raw: bytes, offset: int, line_start: int) -> tuple[int, int]:
    line = line_start + raw.count(b"\n", 0, offset)
    return line, offset - (raw.rfind(b"\n", 0, offset) + 1) + 1


def iter_lines(path: str | os.PathLike[str], what: str = "") -> Iterator[tuple[str, str]]:
    """``(where, text)`` of each line of a text file, ``where`` being ``file:line``; a BOM on
    the first line is dropped. Streams: a million-line trace is read a line at a time."""
    with open_input(path, what) as f:
        for lineno in count(1):
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as e:
                raise InputError(f"{path}:{lineno}: cannot be read ({e.strerror or e})") from None
            if not raw:
                return
            where = f"{path}:{lineno}"
            if len(raw) > MAX_LINE_BYTES:
                raise InputError(f"{where}: line longer than {MAX_LINE_BYTES >> 20} MiB")
            text = _decode(raw, f"{path}:", lineno)
            if lineno == 1 and text.startswith("\ufeff"):
                text = text[1:]
            yield where, text


def read_bounded(f: IO[bytes], limit: int, where: str) -> bytes:
    """At most ``limit`` bytes of ``f``, else an InputError naming ``where``; a file larger
    than that is refused by its size before a byte is read (:mod:`lmc.bounded_io`: the
    buffer grows with what is read, never reserved at the limit)."""
    if known_size(f) > limit:
        raise InputError(f"{where}: larger than {limit:,} bytes")
    raw = read_at_most(f, limit)
    if len(raw) > limit:  # it grew while being read, or has no size (a pipe)
        raise InputError(f"{where}: larger than {limit:,} bytes")
    return raw


def read_text(path: str | os.PathLike[str], what: str = "",
              limit: int = MAX_DOCUMENT_BYTES) -> str:
    """A whole text file, at most ``limit`` bytes, as UTF-8 (a BOM dropped)."""
    with open_input(path, what) as f:
        try:
            raw = read_bounded(f, limit, str(path))
        except OSError as e:
            raise InputError(f"{path}: cannot be read ({e.strerror or e})") from None
    return _decode(raw, f"{path}:").removeprefix("\ufeff")


def printable(text: str, limit: int = 200) -> str:
    """``text`` (an error another library raised, which may quote the file) on one line, its
    control characters escaped and its length cut to ``limit``."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(text.split()))
    return out if len(out) <= limit else out[:limit] + "..."


def has_surrogate(text: str) -> bool:
    """True when ``text`` holds a lone UTF-16 surrogate (``"\\ud800"`` in JSON): not Unicode,
    so no tokenizer, file or terminal takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
