"""Files a person hands the command line: traces, ShareGPT dumps, tokenizers, profiles.

Why one module: every command that reads such a file (``lmc plan``, ``lmc replay``,
``lmc workload``) must fail the same way on the same mistake, with an :class:`InputError`
naming the file (and line, where there is one) and what was wrong, never a traceback. What
is refused here, whoever reads:

- a path that is missing, a directory, unreadable, or not UTF-8 text (binary junk included);
- a line longer than :data:`MAX_LINE_BYTES`, a document larger than :data:`MAX_DOCUMENT_BYTES`;
- JSON nested deeper than :data:`MAX_JSON_DEPTH` (Python's parser would recurse until it
  raised ``RecursionError``), an object naming one key twice (JSON parsers silently keep one
  of them: which, depends on the parser), a number too long to convert;
- text holding a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but not Unicode: the
  tokenizer and the terminal raise on it later, far from the line that held it).

Threat model: ``docs/threats/cli.md``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import IO, Any

MAX_JSON_DEPTH = 32  # a trace line needs 2 levels, a ShareGPT file 4
MAX_LINE_BYTES = 64 << 20  # one trace line: about 10M token ids
MAX_DOCUMENT_BYTES = 4 << 30  # one whole-file JSON document (ShareGPT V3 is 0.65 GiB)


class InputError(ValueError):
    """A file given on the command line that cannot be used; the message names the file
    (``file:line`` where there is a line) and what was wrong."""


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


def read_text(path: str | os.PathLike[str], what: str = "",
              limit: int = MAX_DOCUMENT_BYTES) -> str:
    """A whole text file, at most ``limit`` bytes, as UTF-8 (a BOM dropped)."""
    with open_input(path, what) as f:
        try:
            raw = f.read(limit + 1)
        except OSError as e:
            raise InputError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(raw) > limit:
        raise InputError(f"{path}: larger than {limit:,} bytes")
    return _decode(raw, f"{path}:").removeprefix("\ufeff")


def printable(text: str, limit: int = 200) -> str:
    """``text`` (an error another library raised, which may quote the file) on one line, its
    control characters escaped and its length cut to ``limit``."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(text.split()))
    return out if len(out) <= limit else out[:limit] + "..."


def shown(name: str, limit: int = 40) -> str:
    """A name read from a file, fit for an error message: plain as written when it is a short
    identifier, else ``repr``-escaped and cut (raw text could carry terminal escapes)."""
    if name.isidentifier() and name.isascii() and len(name) <= limit:
        return name
    text = repr(name)
    return text if len(text) <= limit + 2 else f"{text[:limit]}...' ({len(name):,} characters)"


# -------------------------------------------------------------------------- JSON
class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


_OPEN, _CONTAINERS = "[{", frozenset({list, dict})


def _deeper_than(obj: Any, limit: int) -> bool:
    """True when parsed JSON nests containers more than ``limit`` deep; level by level, no
    recursion, each container's members typed in one C-speed pass (a trace line's list of
    10,000 token ids costs one ``set(map(type, ...))``)."""
    level = [obj] if type(obj) in _CONTAINERS else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        deeper: list[Any] = []
        for c in level:
            members = c.values() if type(c) is dict else c
            if _CONTAINERS & set(map(type, members)):
                deeper.extend(m for m in members if type(m) in _CONTAINERS)
        level = deeper
    return False


def _too_deep_at(text: str, limit: int) -> int:
    """Offset of the first bracket nested deeper than ``limit`` (slow: only on the error
    path, to name the line), or the end of the text."""
    depth, pos, in_string = 0, 0, False
    outside, inside = re.compile(r'[\[\]{}"]'), re.compile(r'["\\]')
    while True:
        m = (inside if in_string else outside).search(text, pos)
        if m is None:
            return len(text)
        c, pos = m.group(), m.end()
        if in_string:
            if c == "\\":
                pos += 1
            else:
                in_string = False
        elif c == '"':
            in_string = True
        elif c in _OPEN:
            depth += 1
            if depth > limit:
                return m.start()
        else:
            depth -= 1


def parse_json(text: str, where: str, *, document: bool = False,
               max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``text`` as JSON, refused by an InputError naming ``where`` when malformed, nested
    deeper than ``max_depth``, holding a key twice or a number too long. ``document``: the
    text is a whole file, so positions are named as ``where:line``."""

    def at(offset: int) -> str:
        if not document:
            return where
        return f"{where}:{text.count(chr(10), 0, offset) + 1}"

    def too_deep() -> InputError:
        return InputError(f"{at(_too_deep_at(text, max_depth))}: JSON nested deeper than "
                          f"{max_depth} levels")

    try:
        obj = json.loads(text, object_pairs_hook=_unique)
    except RecursionError:
        raise too_deep() from None
    except json.JSONDecodeError as e:
        place = f"{where}:{e.lineno}" if document else where
        raise InputError(f"{place}: malformed JSON: {e.msg} (column {e.colno})") from None
    except _DuplicateKey as e:
        raise InputError(f"{where}: {shown(e.key)}: key given twice in one object") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise InputError(f"{where}: malformed JSON: {e}") from None
    if text.count("[") + text.count("{") > max_depth and _deeper_than(obj, max_depth):
        raise too_deep()
    return obj


def has_surrogate(text: str) -> bool:
    """True when ``text`` holds a lone UTF-16 surrogate (``"\\ud800"`` in JSON): not Unicode,
    so no tokenizer, file or terminal takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
