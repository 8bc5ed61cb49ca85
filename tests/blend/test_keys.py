"""Segment keys depend on the segment's own tokens and the namespace, nothing else."""

from __future__ import annotations

import pytest

from lmc.blend.keys import (
    SegmentKeys,
    check_spans,
    encode_pieces,
    segment_namespace,
    split_text,
    split_tokens,
)
from lmc.token_database import ChunkedTokenDatabase, namespace_digest

NS = namespace_digest("model-a", {"dtype": "float32"}, chunk_size=4)


def test_a_segment_has_the_same_keys_wherever_it_sits() -> None:
    keys = SegmentKeys(NS, 4)
    doc = list(range(100, 111))
    assert keys.keys(doc) == keys.keys(list(doc))
    assert len(keys.keys(doc)) == 3  # 4 + 4 + a partial tail of 3
    # a prefix chain over the same tokens after another document gives other keys
    prefix_db = ChunkedTokenDatabase(4, namespace=NS)
    assert prefix_db.keys([7, 8, 9, 10] + doc)[1:] != keys.keys(doc)


def test_segment_keys_never_equal_prefix_keys_of_the_same_tokens() -> None:
    doc = list(range(50, 58))
    assert set(SegmentKeys(NS, 4).keys(doc)).isdisjoint(ChunkedTokenDatabase(4, namespace=NS)
                                                        .keys(doc))


def test_model_dtype_and_tenant_change_the_keys() -> None:
    doc = list(range(20))
    others = [namespace_digest("model-b", {"dtype": "float32"}, chunk_size=4),
              namespace_digest("model-a", {"dtype": "bfloat16"}, chunk_size=4),
              namespace_digest("model-a", {"dtype": "float32"}, chunk_size=4, tenant="t2")]
    base = SegmentKeys(NS, 4).keys(doc)
    for ns in others:
        assert set(SegmentKeys(ns, 4).keys(doc)).isdisjoint(base)
    assert segment_namespace(NS) != NS
    with pytest.raises(ValueError, match="16 bytes"):
        segment_namespace(b"short")


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


def test_a_requests_tag_roots_its_segments() -> None:
    """Issue 33: segment keys ignored the request's tag, so salted and adapter requests
    would share segments. Two salts (or an adapter) share none; the same salt shares all;
    an untagged request's keys are what they always were."""
    from lmc.token_database import request_tag

    keys, doc = SegmentKeys(NS, 4), list(range(300, 311))
    plain = keys.keys(doc)
    assert keys.keys(doc, None) == plain == ChunkedTokenDatabase(
        4, save_unfull_chunk=True, namespace=segment_namespace(NS)).keys(doc)
    a, b = request_tag(cache_salt="alice"), request_tag(cache_salt="bob")
    lora = request_tag(lora_name="adapter-1")
    assert keys.keys(doc, a) == SegmentKeys(NS, 4).keys(doc, a)  # same salt: same segments
    for one, other in ((a, b), (a, None), (b, None), (lora, None), (lora, a)):
        assert set(keys.keys(doc, one)).isdisjoint(keys.keys(doc, other)), (one, other)
