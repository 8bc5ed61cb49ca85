"""A prompt's segments: spans checked and named, the text and token separator conventions."""

from __future__ import annotations

import pytest

from lmc.reference.segments import check_spans, encode_pieces, split_text, split_tokens


def test_spans_are_checked_and_named() -> None:
    assert check_spans([(0, 3), [3, 5]], 6) == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match=r"segment 1 \(2, 4\) overlaps"):
        check_spans([(0, 3), (2, 4)], 6)
    with pytest.raises(ValueError, match=r"segment 0 \(4, 9\)"):
        check_spans([(4, 9)], 6)
    with pytest.raises(ValueError, match="segment 0"):
        check_spans([(3, 3)], 6)
    with pytest.raises(ValueError, match="pair of ints"):
        check_spans([("a", None)], 6)


def test_text_separator_convention() -> None:
    pieces = split_text("SYS # # doc one # # doc two # # question?")
    assert pieces == ["SYS", "doc one", "doc two", "question?"]

    def encode(text: str, special: bool) -> list[int]:
        return ([1] if special else []) + [ord(c) for c in text]

    ids, spans = encode_pieces(pieces, encode)
    assert ids[0] == 1 and len(spans) == 3  # the question is not a segment
    assert [bytes(ids[s:e]).decode(errors="ignore") for s, e in spans[1:]] == ["doc one",
                                                                                "doc two"]
    with pytest.raises(ValueError, match="non-empty"):
        split_text("x", "")


def test_token_separator_convention() -> None:
    ids, spans = split_tokens([5, 6, 9, 9, 7, 8, 9, 9, 1], [9, 9])
    assert ids == [5, 6, 7, 8, 1]
    assert spans == [(0, 2), (2, 4)]
    assert split_tokens([1, 2], [9]) == ([1, 2], [])
    with pytest.raises(ValueError, match="at least one token"):
        split_tokens([1], [])
