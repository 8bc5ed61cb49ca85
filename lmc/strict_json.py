"""JSON text parsed without trusting it: nesting, duplicate keys and huge numbers refused.

Why one helper: Python's ``json`` recurses once per nesting level, so ~100 KB of brackets
raises ``RecursionError`` (or, in a thread with a small stack, crashes the process), and it
silently keeps one of two values given for one key. Every file lmc reads that another person
or process wrote (the command line's inputs, a blending verdict, the weight-digest cache, a
calibration, a checkpoint's config files) goes through :func:`parse_json` (a whole file:
:func:`load_json_file`, bounded in bytes), so each refuses the same things with an
:class:`InputError` naming where, never a traceback. The CLI's inputs module
(:mod:`lmc.workloads.inputs`) adds line-by-line reading around it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from lmc.bounded_io import known_size, read_at_most

MAX_JSON_DEPTH = 32  # a trace line needs 2 levels, a ShareGPT file 4, a verdict 3


class InputError(ValueError):
    """A file given on the command line that cannot be used; the message names the file
    (``file:line`` where there is a line) and what was wrong."""


def shown(name: str, limit: int = 40) -> str:
    """A name read from a file, fit for an error message: plain as written when it is a short
    identifier, else ``repr``-escaped and cut (raw text could carry terminal escapes)."""
    if name.isidentifier() and name.isascii() and len(name) <= limit:
        return name
    text = repr(name)
    return text if len(text) <= limit + 2 else f"{text[:limit]}...' ({len(name):,} characters)"


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


def load_json_file(path: str | os.PathLike[str], limit: int) -> Any:
    """The JSON document in the file at ``path``: at most ``limit`` bytes (a larger file is
    refused by its size, unread), UTF-8 (a BOM dropped), parsed by :func:`parse_json`. An
    :class:`InputError` names the file and what was wrong; ``OSError`` as raised by opening."""
    with open(path, "rb") as f:
        if known_size(f) > limit:
            raise InputError(f"{path}: larger than {limit:,} bytes")
        raw = read_at_most(f, limit)
    if len(raw) > limit:
        raise InputError(f"{path}: larger than {limit:,} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                         f"{e.start})") from None
    return parse_json(text.removeprefix("\ufeff"), str(path), document=True)
