"""Property tests of the readers every CLI command uses for its input files: whatever bytes a
trace or a ShareGPT file holds (random bytes, random JSON, trace-shaped objects with hostile
values, deep nesting, keys given twice, truncated or re-encoded lines), reading either
returns requests every consumer can use or raises :class:`InputError` naming the file, on one
line with no raw control characters; never another exception.

Threat model: docs/threats/cli.md.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmc.planner.keys import key_trace
from lmc.workloads import generators as g
from lmc.workloads import inputs
from lmc.workloads.inputs import InputError, parse_json
from lmc.workloads.trace import (
    KEYS,
    MAX_ARRIVAL_S,
    MAX_ID_CHARS,
    MAX_OUTPUT_LEN,
    TraceError,
    read_trace,
)

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

_text = st.text(st.characters(), max_size=12)  # surrogates and control characters included
_numbers = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, 1, 2**32, 2**63, -1]),
                     st.floats(allow_nan=True, allow_infinity=True))
_scalars = st.one_of(st.none(), st.booleans(), _numbers, _text)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(KEYS) | _text, inner, max_size=5),
                     max_leaves=16)
_trace_obj = st.fixed_dictionaries({}, optional={
    "arrival_s": _scalars, "request_id": _scalars | st.just("r"), "session_id": _scalars,
    "prefix_group": _scalars, "prompt": _text | _json,
    "prompt_tokens": st.lists(_numbers | _scalars, max_size=6) | _json,
    "output_len": _numbers | _scalars,
    "segments": st.lists(st.lists(_numbers | _scalars, max_size=3) | _scalars, max_size=4)
    | _json,
    "segment_separator": _text | _scalars})
_good = st.builds(lambda i, n: json.dumps({"arrival_s": 0, "request_id": f"r{i}",
                                           "prompt_tokens": [1, 2, 3, 4, 5], "output_len": n}),
                  st.integers(0, 10**6), st.integers(1, MAX_OUTPUT_LEN))


def _mangle(line: str, how: int, cut: int) -> bytes:
    """A valid-looking line made hostile in one of several ways."""
    raw = line.encode("utf-8", "surrogatepass")
    if how == 0:
        return raw[: cut % (len(raw) + 1)]  # truncated mid-token
    if how == 1:
        return b"[" * (cut % 2000) + raw  # nested past any sane depth
    if how == 2 and line.endswith("}"):
        return (line[:-1] + ', "output_len": 3}').encode()  # a key given twice
    if how == 3:
        return b"\xef\xbb\xbf" + raw  # a BOM
    if how == 4:
        return raw.replace(b"1", b"\xc0\xb1")  # overlong UTF-8 for "1"
    return raw + b"\r"


_line = st.one_of(
    st.binary(max_size=64),
    _json.map(json.dumps).map(str.encode),
    _trace_obj.map(lambda o: json.dumps(o).encode()),
    _good.map(str.encode),
    st.builds(_mangle, _good | _trace_obj.map(json.dumps), st.integers(0, 5),
              st.integers(0, 10**6)),
)


def _assert_named(e: InputError, path: Path) -> None:
    msg = str(e)
    assert msg.startswith(str(path)), msg
    assert "\n" not in msg and "\x1b" not in msg and "\x07" not in msg, msg
    assert all(c.isprintable() for c in msg), msg
    assert len(msg) < 2000, len(msg)


class _Bytes:
    """A stand-in tokenizer: UTF-8 bytes as ids (a text prompt must encode cleanly)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


@FUZZ
@given(st.lists(_line, min_size=1, max_size=6))
def test_any_trace_file_reads_or_is_refused_by_name(tmp_path, lines):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    try:
        reqs = list(read_trace(path))
    except TraceError as e:
        _assert_named(e, path)
        return
    for r in reqs:  # what was accepted is usable by every consumer
        assert 1 <= r.output_len <= MAX_OUTPUT_LEN and type(r.output_len) is int
        assert math.isfinite(r.arrival_s) and 0 <= r.arrival_s <= MAX_ARRIVAL_S
        for s in (r.request_id, r.session_id, r.prefix_group, r.prompt_text):
            if s is not None:
                s.encode("utf-8")
        assert len(r.request_id) <= MAX_ID_CHARS
        if r.segments is not None:  # spans a blending engine can take as they are
            assert r.prompt_tokens is not None
            ends = [0] + [x for span in r.segments for x in span]
            assert all(type(x) is int for x in ends) and ends == sorted(ends)
            assert all(s < e for s, e in r.segments) and ends[-1] <= len(r.prompt_tokens)
        if r.segment_separator is not None:
            assert r.prompt_text is not None and r.prompt_text.replace(r.segment_separator, "")
        json.dumps(r.to_json(), allow_nan=False)
    key_trace(reqs, chunk_size=4, tokenizer=_Bytes())  # the planner's keys: no overflow


@FUZZ
@given(st.one_of(st.binary(max_size=200), _json.map(lambda v: json.dumps(v).encode()),
                 st.lists(st.fixed_dictionaries({"conversations": st.lists(
                     st.fixed_dictionaries({"from": _scalars | st.sampled_from(
                         ["human", "gpt", "system"]), "value": _text | _scalars}),
                     max_size=4)}, optional={"id": _json}), max_size=3)
                 .map(lambda v: json.dumps(v).encode())))
def test_any_sharegpt_file_loads_or_is_refused_by_name(tmp_path, data):
    path = tmp_path / "sg.json"
    path.write_bytes(data)
    try:
        drafts, _ = g.sharegpt_drafts(g.ShareGPTSpec(str(path)))
    except TraceError as e:
        _assert_named(e, path)
        return
    for d in drafts:
        for seg in d.segments:
            seg.encode("utf-8")


# ------------------------------------------------------------------- the bounds, exactly
def test_depth_bound_is_exact_and_ignores_brackets_in_strings():
    assert parse_json("[" * 32 + "]" * 32, "x") is not None
    with pytest.raises(InputError, match=r"^x: JSON nested deeper than 32 levels"):
        parse_json("[" * 33 + "]" * 33, "x")
    assert parse_json(json.dumps({"prompt": "[{" * 5000}), "x") == {"prompt": "[{" * 5000}
    escaped = json.dumps({"p": '\\"[[[[' * 100, "q": [[1]]})
    assert parse_json(escaped, "x")["q"] == [[1]]
    doc = "[\n" + "[" * 40 + "]" * 40 + "\n]"
    with pytest.raises(InputError, match=r"^f:2: JSON nested deeper than 32"):
        parse_json(doc, "f", document=True)


def test_duplicate_keys_are_refused_at_any_depth_and_named_safely():
    with pytest.raises(InputError, match="x: a: key given twice"):
        parse_json('{"b": [{"a": 1, "a": 2}]}', "x")
    with pytest.raises(InputError) as e:
        parse_json('{"\\u001b]0;pwned\\u0007": 1, "\\u001b]0;pwned\\u0007": 2}', "x")
    assert "\x1b" not in str(e.value) and "\\x1b" in str(e.value)


def test_a_line_past_the_bound_is_refused_without_reading_on(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "MAX_LINE_BYTES", 4096)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"arrival_s": 0, "request_id": "r", "output_len": 1,
                                "prompt_tokens": list(range(2000))}) + "\n")
    with pytest.raises(TraceError, match=r"t.jsonl:1: line longer than"):
        list(read_trace(path))
    with pytest.raises(TraceError, match=r"/dev/zero:1: line longer than"):  # endless input
        list(read_trace("/dev/zero"))


def test_a_document_past_the_bound_is_refused(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text("[" + ",".join(["{}"] * 100) + "]")
    with pytest.raises(InputError, match=r"sg.json: larger than 64 bytes"):
        inputs.read_text(path, limit=64)


def test_a_bom_is_dropped_and_line_numbers_stay_the_files(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "t.jsonl"
    good = {"arrival_s": 0, "request_id": "a", "prompt_tokens": [rng.randrange(9)],
            "output_len": 1}
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(good).encode() + b"\n\n{bad\n")
    with pytest.raises(TraceError, match=r"t.jsonl:3: malformed JSON"):
        list(read_trace(path))
