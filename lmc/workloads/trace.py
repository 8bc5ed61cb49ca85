"""The trace format: JSONL, one request per line (see ``docs/workloads.md``).

One format serves every consumer (replay, the capacity planner, generators, loaders), so
a trace generated once can be replayed on a real engine and sized by the planner and the
two answers compared request for request. Bad input fails with ``file:line`` and the
field, because traces are often hand-edited or produced by other tools: lines are read by
:mod:`lmc.workloads.inputs` (bounded line length and nesting, no key given twice, UTF-8),
and every field is typed and range-checked (bounds below). Threat model:
``docs/threats/cli.md``.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lmc.workloads.inputs import (
    InputError,
    has_surrogate,
    iter_lines,
    parse_json,
    printable,
    shown,
)

KEYS = ("arrival_s", "request_id", "session_id", "prefix_group", "prompt_tokens", "prompt",
        "output_len", "segments", "segment_separator")


_U32_OK = array("I").itemsize == 4  # 'I' holds exactly [0, 2**32) here

MAX_OUTPUT_LEN = 1 << 20  # tokens one request may generate (longer than any model's context)
MAX_ARRIVAL_S = 1e10  # seconds; room for Unix timestamps, none for 1e308
MAX_ID_CHARS = 1024  # request_id, session_id, prefix_group
MAX_SEGMENTS = 1024  # reusable segments one request marks (lmc.blend)
MAX_SEPARATOR_CHARS = 64  # a segment separator is a short marker, not text
Span = tuple[int, int]


class TraceError(InputError):
    """A trace line that cannot be read; the message names ``file:line`` and the field."""


class Encoder(Protocol):
    """What :meth:`TraceRequest.tokens` needs of a tokenizer (lmc.reference.tokenizer has it)."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class TraceRequest:
    """One request: when it arrives, what it asks, how many tokens it generates.

    Exactly one of ``prompt_tokens`` / ``prompt_text`` is set. ``session_id`` ties the turns
    of one conversation together; ``prefix_group`` names requests built on one shared
    prefix (a system prompt, a document); both are informational for reports and may be None.
    """

    arrival_s: float
    request_id: str
    session_id: str | None
    prefix_group: str | None
    prompt_tokens: list[int] | None
    prompt_text: str | None
    output_len: int
    segments: tuple[Span, ...] | None = None
    segment_separator: str | None = None
    # ``file:line`` it was read from, for errors found later (tokenizing); not compared
    source: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        problem = _check(self)
        if problem is not None:
            raise TraceError(f"request {self.request_id!r}: {problem}")
        _normalize(self)

    def tokens(self, tokenizer: Encoder | None) -> list[int]:
        """The prompt as token ids; a text prompt needs a tokenizer (the engine's own, so
        keys match what the engine caches)."""
        if self.prompt_tokens is not None:
            return list(self.prompt_tokens)
        if tokenizer is None:
            raise TraceError(
                f"request {self.request_id!r} has a text prompt; a tokenizer is needed to get token ids"
            )
        assert self.prompt_text is not None
        try:
            return list(tokenizer.encode(self.prompt_text))
        except Exception as e:  # the tokenizers library raises plain Exception and TypeError
            where = self.source or f"request {self.request_id!r}"
            raise TraceError(f"{where}: prompt: the tokenizer cannot encode it "
                             f"({type(e).__name__}: {printable(str(e))})") from None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of one trace line (``prompt_tokens`` or ``prompt``, never both)."""
        out: dict[str, Any] = {
            "arrival_s": self.arrival_s,
            "request_id": self.request_id,
            "session_id": self.session_id,
            "prefix_group": self.prefix_group,
        }
        if self.prompt_tokens is not None:
            out["prompt_tokens"] = self.prompt_tokens
        else:
            out["prompt"] = self.prompt_text
        out["output_len"] = self.output_len
        if self.segments is not None:
            out["segments"] = [list(span) for span in self.segments]
        if self.segment_separator is not None:
            out["segment_separator"] = self.segment_separator
        return out


def _normalize(req: TraceRequest) -> None:
    """After a check passed: seconds as a float, spans as tuples (equal however given)."""
    if isinstance(req.arrival_s, int):
        object.__setattr__(req, "arrival_s", float(req.arrival_s))
    if req.segments is not None:
        object.__setattr__(req, "segments", tuple((s, e) for s, e in req.segments))


def _tokens_ok(toks: list[Any], bools_possible: bool) -> bool:
    """All ints in [0, 2**32), in C passes: the planner reads million-request traces, where
    a Python loop over every token id would cost more than parsing the JSON. ``array``
    refuses floats, strings, negatives and ids past 32 bits in one pass; only booleans
    (ints to ``array``) need their own look, skipped when the line cannot hold one."""
    if not _U32_OK:  # pragma: no cover - no such platform in CI
        return set(map(type, toks)) == {int} and min(toks) >= 0 and max(toks) < 2**32
    try:
        array("I", toks)
    except (TypeError, OverflowError):
        return False
    return not bools_possible or bool not in set(map(type, toks))


def _check(req: TraceRequest, bools_possible: bool = True) -> str | None:
    """The first thing wrong with a request, as ``field: problem``, or None."""
    if isinstance(req.arrival_s, bool) or not isinstance(req.arrival_s, (int, float)):
        return f"arrival_s: expected a number of seconds, got {req.arrival_s!r}"
    if not math.isfinite(req.arrival_s) or req.arrival_s < 0:
        return f"arrival_s: must be finite and >= 0, got {req.arrival_s!r}"
    if req.arrival_s > MAX_ARRIVAL_S:
        return f"arrival_s: must be <= {MAX_ARRIVAL_S:g} seconds, got {req.arrival_s!r}"
    if not isinstance(req.request_id, str) or not req.request_id:
        return f"request_id: expected a non-empty string, got {_short(req.request_id)}"
    for name in ("request_id", "session_id", "prefix_group"):
        value = getattr(req, name)
        if value is not None and not isinstance(value, str):
            return f"{name}: expected a string or null, got {_short(value)}"
        if value is not None and (problem := _text_problem(value, MAX_ID_CHARS)):
            return f"{name}: {problem}"
    if (req.prompt_tokens is None) == (req.prompt_text is None):
        return "prompt_tokens/prompt: exactly one of them must be given"
    if req.prompt_tokens is not None:
        if not isinstance(req.prompt_tokens, list) or not req.prompt_tokens:
            return "prompt_tokens: expected a non-empty list of token ids"
        toks = req.prompt_tokens
        if not _tokens_ok(toks, bools_possible):  # the culprit is looked for only on failure
            for i, tok in enumerate(toks):
                if type(tok) is not int or not 0 <= tok < 2**32:
                    return f"prompt_tokens[{i}]: expected a token id in [0, 2**32), got {tok!r}"
    elif not isinstance(req.prompt_text, str) or not req.prompt_text:
        return f"prompt: expected non-empty text, got {_short(req.prompt_text)}"
    elif has_surrogate(req.prompt_text):
        return "prompt: " + _text_problem(req.prompt_text, None)
    n = req.output_len
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_OUTPUT_LEN:
        return f"output_len: expected an integer in [1, {MAX_OUTPUT_LEN}], got {_short(n)}"
    if req.segments is not None and (bad := _segments_problem(req.segments,
                                                              req.prompt_tokens)):
        return bad
    if req.segment_separator is not None:
        return _separator_problem(req.segment_separator, req.prompt_text)
    return None


def _segments_problem(spans: Any, prompt_tokens: list[int] | None) -> str | None:
    """``segments``: in order, disjoint, non-empty spans inside a token prompt."""
    if prompt_tokens is None:
        return "segments: marks spans of prompt_tokens (a text prompt uses segment_separator)"
    if not isinstance(spans, (list, tuple)) or len(spans) > MAX_SEGMENTS:
        return f"segments: expected a list of at most {MAX_SEGMENTS} [start, end] pairs, " \
               f"got {_short(spans)}"
    end_before = 0
    for i, span in enumerate(spans):
        if (not isinstance(span, (list, tuple)) or len(span) != 2
                or any(type(v) is not int for v in span)):
            return f"segments[{i}]: expected a [start, end] pair of integers, got {_short(span)}"
        start, end = span
        if not 0 <= start < end <= len(prompt_tokens):
            return (f"segments[{i}]: [{start}, {end}] must satisfy 0 <= start < end <= "
                    f"{len(prompt_tokens)} (the prompt's length)")
        if start < end_before:
            return (f"segments[{i}]: [{start}, {end}] starts before the previous segment ends "
                    f"({end_before}): segments are in order and disjoint")
        end_before = end
    return None


def _separator_problem(separator: Any, prompt_text: str | None) -> str | None:
    """``segment_separator``: a short non-empty marker on a text prompt with text besides it."""
    if prompt_text is None:
        return "segment_separator: applies to a text prompt (token prompts use segments)"
    if not isinstance(separator, str) or not separator:
        return f"segment_separator: expected a non-empty string, got {_short(separator)}"
    if problem := _text_problem(separator, MAX_SEPARATOR_CHARS):
        return f"segment_separator: {problem}"
    if not prompt_text.replace(separator, ""):
        return "segment_separator: the prompt holds nothing but separators"
    return None


def _short(value: Any) -> str:
    """``repr`` of a bad value, cut short: a 60 MB string is named, not printed."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text):,} characters)"


def _text_problem(text: str, max_chars: int | None) -> str:
    """Why a string field cannot be used, or "" when it can."""
    if max_chars is not None and len(text) > max_chars:
        return f"longer than {max_chars} characters ({len(text):,})"
    if has_surrogate(text):
        bad = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
        return (f"a lone UTF-16 surrogate \\u{ord(text[bad]):04x} at character {bad} "
                "(not Unicode text)")
    return ""


def _from_json(obj: Any, line: str = "") -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise TraceError(f"{shown(unknown[0])}: unknown key (known: {', '.join(KEYS)})")
    for key in ("arrival_s", "request_id", "output_len"):
        if key not in obj:
            raise TraceError(f"{key}: missing")
    if "prompt_tokens" in obj and "prompt" in obj:
        raise TraceError("prompt_tokens/prompt: give one of them, not both")
    if "prompt_tokens" not in obj and "prompt" not in obj:
        raise TraceError("prompt_tokens/prompt: missing (one of them is required)")
    req = object.__new__(TraceRequest)  # validate before __post_init__ wraps the message
    fields = {
        "arrival_s": obj["arrival_s"],
        "request_id": obj["request_id"],
        "session_id": obj.get("session_id"),
        "prefix_group": obj.get("prefix_group"),
        "prompt_tokens": obj.get("prompt_tokens"),
        "prompt_text": obj.get("prompt"),
        "output_len": obj["output_len"],
        "segments": obj.get("segments"),
        "segment_separator": obj.get("segment_separator"),
    }
    for name, value in fields.items():
        object.__setattr__(req, name, value)
    object.__setattr__(req, "source", "")
    problem = _check(req, bools_possible=not line or "true" in line or "false" in line)
    if problem is not None:
        raise TraceError(problem)
    _normalize(req)
    return req


def read_trace(path: str | os.PathLike[str]) -> Iterator[TraceRequest]:
    """Requests of a JSONL trace in file order (streamed: a million-line trace is fine).

    Blank lines are skipped. Arrival times must not decrease, since replay and the planner
    walk the trace in order; a request id may not repeat. Errors read ``file:line: field: problem``.
    """
    seen: set[str] = set()
    last = 0.0
    try:
        for where, line in iter_lines(path, "trace"):
            if not line.strip():
                continue
            try:
                req = _from_json(parse_json(line, where), line)
            except InputError as e:
                msg = str(e)
                raise TraceError(msg if msg.startswith(f"{where}:") else f"{where}: {msg}") from None
            object.__setattr__(req, "source", where)
            if req.arrival_s < last:
                raise TraceError(
                    f"{where}: arrival_s: {req.arrival_s} is earlier than the previous line's {last}"
                    " (traces are in arrival order)"
                )
            if req.request_id in seen:
                raise TraceError(f"{where}: request_id: {req.request_id!r} repeats an earlier line")
            seen.add(req.request_id)
            last = req.arrival_s
            yield req
    except TraceError:
        raise
    except InputError as e:  # the file itself: missing, a directory, not UTF-8...
        raise TraceError(str(e)) from None


def write_trace(path: str | os.PathLike[str], requests: Iterable[TraceRequest]) -> int:
    """Write requests as JSONL (atomically: a temporary file renamed); returns the count."""
    path = Path(path)
    if not path.parent.is_dir():  # else the error would name the temporary file
        raise FileNotFoundError(f"{path}: no directory {path.parent}")
    if path.is_dir():  # found before the work, not at the final rename
        raise IsADirectoryError(f"{path}: is a directory, expected a file to write")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    count = 0
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for req in requests:
                f.write(json.dumps(req.to_json(), separators=(",", ":")))
                f.write("\n")
                count += 1
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return count
