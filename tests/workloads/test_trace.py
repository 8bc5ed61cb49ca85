"""The trace format: what is written reads back equal, and every bad line is refused with
``file:line``, the field and what was wrong. Threat model: docs/threats/cli.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmc.workloads import TraceError, TraceRequest, read_trace, write_trace


def _line(**over) -> str:
    obj = {"arrival_s": 0.5, "request_id": "r1", "session_id": "s", "prefix_group": None,
           "prompt_tokens": [1, 2, 3], "output_len": 4}
    obj.update(over)
    return json.dumps({k: v for k, v in obj.items() if v is not _DROP})


_DROP = object()


def _read(tmp_path: Path, *lines: str) -> list[TraceRequest]:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return list(read_trace(path))


def test_round_trip_tokens_and_text(tmp_path):
    reqs = [TraceRequest(0, "a", None, None, [5, 0, 2**32 - 1], None, 1),
            TraceRequest(1.25, "b", "chat-1", "system", None, "Hello, \"world\"\n\u00e9", 64)]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, reqs) == 2
    back = list(read_trace(path))
    assert back == reqs
    assert isinstance(back[0].arrival_s, float)
    lines = path.read_text().splitlines()
    assert "prompt_tokens" in lines[0] and '"prompt"' not in lines[0]
    assert '"prompt"' in lines[1] and "prompt_tokens" not in lines[1]
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file was left behind"
    with pytest.raises(FileNotFoundError, match=r"t.jsonl: no directory .*nowhere"):
        write_trace(tmp_path / "nowhere" / "t.jsonl", reqs)


def test_tokens_of_text_needs_a_tokenizer():
    class Words:
        def encode(self, text: str) -> list[int]:
            return [len(w) for w in text.split()]

    tok = TraceRequest(0, "a", None, None, [7, 8], None, 1)
    text = TraceRequest(0, "b", None, None, None, "one three", 1)
    assert tok.tokens(None) == [7, 8]
    assert text.tokens(Words()) == [3, 5]
    with pytest.raises(TraceError, match="text prompt; a tokenizer is needed"):
        text.tokens(None)


def test_blank_lines_are_skipped(tmp_path):
    assert len(_read(tmp_path, _line(), "", "   ", _line(request_id="r2", arrival_s=1))) == 2


@pytest.mark.parametrize("line, where, message", [
    ("{not json", 1, "malformed JSON"),
    ("[1, 2]", 1, "expected a JSON object, got list"),
    (_line(arrival_s=_DROP), 1, "arrival_s: missing"),
    (_line(arrival_s=-1), 1, "arrival_s: must be finite and >= 0"),
    (_line(arrival_s="soon"), 1, "arrival_s: expected a number"),
    (_line(arrival_s=True), 1, "arrival_s: expected a number"),
    (_line(request_id=""), 1, "request_id: expected a non-empty string"),
    (_line(request_id=7), 1, "request_id: expected a non-empty string"),
    (_line(session_id=3), 1, "session_id: expected a string or null"),
    (_line(prefix_group=["g"]), 1, "prefix_group: expected a string or null"),
    (_line(prompt_tokens=_DROP), 1, "prompt_tokens/prompt: missing"),
    (_line(prompt="hi"), 1, "prompt_tokens/prompt: give one of them, not both"),
    (_line(prompt_tokens=[]), 1, "prompt_tokens: expected a non-empty list"),
    (_line(prompt_tokens=[1, -2]), 1, "prompt_tokens[1]: expected a token id"),
    (_line(prompt_tokens=[1, 2**32]), 1, "prompt_tokens[1]: expected a token id"),
    (_line(prompt_tokens=[1.0]), 1, "prompt_tokens[0]: expected a token id"),
    (_line(prompt_tokens=[0, True]), 1, "prompt_tokens[1]: expected a token id"),
    (_line(prompt_tokens=_DROP, prompt=""), 1, "prompt: expected non-empty text"),
    (_line(output_len=0), 1, "output_len: expected an integer in [1, 1048576]"),
    (_line(output_len=2.5), 1, "output_len: expected an integer in [1, 1048576]"),
    (_line(output_len=_DROP), 1, "output_len: missing"),
    (_line(max_tokens=3), 1, "max_tokens: unknown key"),
    # segments: only on token prompts, in order, disjoint, inside the prompt, bounded
    (_line(segments=[[0, 4]]), 1, "segments[0]: [0, 4] must satisfy 0 <= start < end <= 3"),
    (_line(segments=[[-1, 2]]), 1, "segments[0]: [-1, 2] must satisfy"),
    (_line(segments=[[2, 2]]), 1, "segments[0]: [2, 2] must satisfy"),
    (_line(segments=[[0, 2], [1, 3]]), 1, "segments[1]: [1, 3] starts before the previous"),
    (_line(segments=[[1, 2], [0, 1]]), 1, "segments[1]: [0, 1] starts before the previous"),
    (_line(segments=[[0, 1.5]]), 1, "segments[0]: expected a [start, end] pair of integers"),
    (_line(segments=[[0, True]]), 1, "segments[0]: expected a [start, end] pair of integers"),
    (_line(segments=[[0, 1, 2]]), 1, "segments[0]: expected a [start, end] pair of integers"),
    (_line(segments=[0, 1]), 1, "segments[0]: expected a [start, end] pair of integers"),
    (_line(segments=[[0, 2**64]]), 1, "segments[0]: [0, 18446744073709551616] must satisfy"),
    (_line(segments={"0": 1}), 1, "segments: expected a list of at most 1024"),
    (_line(segments=[[0, 1]] * 1025), 1, "segments: expected a list of at most 1024"),
    (_line(prompt_tokens=_DROP, prompt="a # # b", segments=[[0, 1]]), 1,
     "segments: marks spans of prompt_tokens"),
    # segment_separator: only on text prompts, short text, not the whole prompt
    (_line(segment_separator=" # # "), 1, "segment_separator: applies to a text prompt"),
    (_line(prompt_tokens=_DROP, prompt="a # # b", segment_separator=""), 1,
     "segment_separator: expected a non-empty string"),
    (_line(prompt_tokens=_DROP, prompt="a # # b", segment_separator=7), 1,
     "segment_separator: expected a non-empty string"),
    (_line(prompt_tokens=_DROP, prompt="a # # b", segment_separator="#" * 65), 1,
     "segment_separator: longer than 64 characters"),
    (_line(prompt_tokens=_DROP, prompt="a # # b", segment_separator="\ud800"), 1,
     "segment_separator: a lone UTF-16 surrogate"),
    (_line(prompt_tokens=_DROP, prompt=" # #  # # ", segment_separator=" # # "), 1,
     "segment_separator: the prompt holds nothing but separators"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, line, where, message):
    with pytest.raises(TraceError) as e:
        _read(tmp_path, line)
    text = str(e.value)
    assert text.startswith(f"{tmp_path / 't.jsonl'}:{where}: "), text
    assert message in text, text


def test_segments_and_separators_round_trip(tmp_path):
    reqs = [TraceRequest(0, "a", None, "system", [1, 2, 3, 4, 5], None, 2,
                         segments=((1, 3), (3, 4))),
            TraceRequest(0, "b", None, None, None, "sys # # doc # # q", 2,
                         segment_separator=" # # "),
            TraceRequest(0, "c", None, None, [1, 2], None, 2, segments=())]
    path = tmp_path / "t.jsonl"
    write_trace(path, reqs)
    back = list(read_trace(path))
    assert back == reqs and back[0].segments == ((1, 3), (3, 4))
    assert '"segments":[[1,3],[3,4]]' in path.read_text().splitlines()[0]
    assert "segment" not in TraceRequest(0, "d", None, None, [1], None, 1).to_json()
    with pytest.raises(TraceError, match="request 'x': segments\\[0\\]"):
        TraceRequest(0, "x", None, None, [1], None, 1, segments=((0, 2),))


def test_order_and_uniqueness_are_checked_across_lines(tmp_path):
    # line numbers are the file's own: the blank line counts
    with pytest.raises(TraceError, match=r"t.jsonl:4: arrival_s: 1.0 is earlier than the "
                                         r"previous line's 2.0"):
        _read(tmp_path, _line(request_id="a", arrival_s=0), "",
              _line(request_id="b", arrival_s=2), _line(request_id="c", arrival_s=1))
    with pytest.raises(TraceError, match=r"t.jsonl:2: request_id: 'a' repeats"):
        _read(tmp_path, _line(request_id="a"), _line(request_id="a"))


def test_constructor_refuses_bad_requests():
    with pytest.raises(TraceError, match="request 'x': prompt_tokens/prompt: exactly one"):
        TraceRequest(0, "x", None, None, [1], "text", 1)
    with pytest.raises(TraceError, match="output_len"):
        TraceRequest(0, "x", None, None, [1], None, 0)


_ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
               max_size=12)
_req = st.builds(
    lambda i, sid, grp, toks, text, n: (sid, grp, toks, text, n, i),
    st.integers(0, 10**6), st.none() | _ids, st.none() | _ids,
    st.none() | st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    _ids, st.integers(1, 10**5))


@settings(max_examples=40)
@given(st.lists(_req, min_size=1, max_size=8), st.lists(st.floats(0, 1e6), min_size=8,
                                                            max_size=8))
def test_round_trip_any_valid_trace(tmp_path_factory, drafts, times):
    times = sorted(times)
    reqs = [TraceRequest(times[k], f"{k}-{i}", sid, grp, toks, None if toks else text, n)
            for k, (sid, grp, toks, text, n, i) in enumerate(drafts)]
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_trace(path, reqs)
    assert list(read_trace(path)) == reqs
