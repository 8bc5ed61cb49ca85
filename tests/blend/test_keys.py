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
