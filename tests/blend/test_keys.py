"""Segment keys depend on the segment's own tokens and the namespace, nothing else."""

from __future__ import annotations

import pytest

from lmc.blend.keys import SegmentKeys, segment_namespace
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
