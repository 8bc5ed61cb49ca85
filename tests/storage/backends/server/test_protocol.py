"""The frame parser in-process: round trips, every bound enforced before allocation, and
arbitrary bytes never raising anything but ``ProtocolError``.
Threat model: docs/threats/daemon.md."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmc.storage.backends.server import protocol as P
from lmc.storage.serde import encode_header
from tests.storage.backends.server import fuzz_frames

LIM = P.Limits(max_meta=4096, max_payload=1 << 20, max_value=1 << 19, max_batch=8,
               max_namespace=16)


def _value_header(key: bytes = b"k" * 16, n: int = 4) -> tuple[bytes, bytes]:
    t = torch.arange(2 * 2 * n * 4, dtype=torch.float16).view(2, 2, n, 4)
    payload = t.view(torch.uint8).numpy().tobytes()
    return encode_header(key, t.shape, t.dtype, n, payload), payload


def test_header_round_trip():
    raw = P.pack_header(P.GET, 7, 100, 0)
    assert len(raw) == P.FRAME_SIZE == 24
    h = P.unpack_header(raw)
    assert (h.op, h.req_id, h.meta_len, h.payload_len, h.status) == (P.GET, 7, 100, 0, 0)


@pytest.mark.parametrize("raw,status", [
    (b"XXXX" + P.pack_header(P.PING, 1, 0)[4:], P.BAD_FRAME),
    (P.pack_header(P.PING, 1, 0)[:4] + bytes([9]) + P.pack_header(P.PING, 1, 0)[5:],
     P.BAD_FRAME),
    (P.pack_header(P.PING, 1, 0)[:10], P.BAD_FRAME),
])
def test_bad_headers_are_fatal(raw, status):
    with pytest.raises(P.ProtocolError) as e:
        P.unpack_header(raw)
    assert e.value.status == status and e.value.fatal


@pytest.mark.parametrize("op,meta_len,payload_len,status", [
    (P.GET, 4097, 0, P.TOO_LARGE),
    (P.PUT, 10, (1 << 20) + 1, P.TOO_LARGE),
    (P.GET, 10, 5, P.BAD_FRAME),        # only PUT carries a payload
    (P.PUT, 10, 2**64 - 1, P.TOO_LARGE),
])
def test_lengths_bounded_before_reading(op, meta_len, payload_len, status):
    h = P.unpack_header(P.pack_header(op, 1, meta_len, payload_len))
    with pytest.raises(P.ProtocolError) as e:
        P.check_header(h, LIM)
    assert e.value.status == status and e.value.fatal


def test_put_items_checked():
    hdr, payload = _value_header()
    items = P.get_put_items({"items": [hdr, hdr]}, 2 * len(payload), LIM)
    assert len(items) == 2 and items[0].payload_len == len(payload)
    bad = [
        ({"items": [hdr]}, 2 * len(payload)),             # lengths do not add up
        ({"items": [hdr[:-1] + b"\0"]}, len(payload)),   # header checksum broken
        ({"items": "nope"}, 0),
        ({"items": [1, 2]}, 0),
        ({"items": [hdr] * 9}, 9 * len(payload)),        # past max_batch
        ({}, 0),
    ]
    for meta, plen in bad:
        with pytest.raises(P.ProtocolError) as e:
            P.get_put_items(meta, plen, LIM)
        assert e.value.status == P.BAD_REQUEST and not e.value.fatal


def test_value_past_max_value_refused():
    t = torch.zeros(2, 2, 257, 512, dtype=torch.uint8)  # just past max_value
    hdr = encode_header(b"k" * 16, t.shape, t.dtype, 257, t.numpy().tobytes())
    with pytest.raises(P.ProtocolError, match="max_value"):
        P.get_put_items({"items": [hdr]}, t.numel(), LIM)


def test_keys_and_namespace_checked():
    assert P.get_keys({"keys": [b"a" * 16]}, LIM) == [b"a" * 16]
    for meta in ({"keys": [b"a" * 15]}, {"keys": ["a" * 16]}, {"keys": [b"a" * 16] * 9},
                 {"keys": b"x"}, {}):
        with pytest.raises(P.ProtocolError):
            P.get_keys(meta, LIM)
    assert P.get_namespace({"ns": "team"}, LIM) == "team"
    for meta in ({"ns": 3}, {"ns": "x" * 17}, {"ns": b"team"}):
        with pytest.raises(P.ProtocolError):
            P.get_namespace(meta, LIM)


def test_meta_decoding_refuses_non_maps_and_ext():
    for raw in (msgpack.packb([1, 2]), msgpack.packb(msgpack.ExtType(1, b"x")), b"\xc1",
                msgpack.packb({"a": 1})[:-1], msgpack.packb({1: 2})):
        with pytest.raises(P.ProtocolError) as e:
            P.unpack_meta(raw, LIM)
        assert e.value.status == P.BAD_REQUEST


def _parse_all(data: bytes) -> None:
    """Everything the daemon does with bytes before touching storage."""
    h = P.unpack_header(data)
    P.check_header(h, LIM)
    meta = P.unpack_meta(data[P.FRAME_SIZE:P.FRAME_SIZE + h.meta_len], LIM)
    P.get_namespace(meta, LIM)
    if h.op == P.PUT:
        P.get_put_items(meta, h.payload_len, LIM)
    else:
        P.get_keys(meta, LIM)
        P.get_flag(meta, "prefix")


_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=80),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=5),
    max_leaves=20)


@st.composite
def frames(draw) -> bytes:
    op = draw(st.sampled_from([P.PUT, P.GET, P.EXISTS, P.DELETE, P.HELLO, 0x55]))
    meta_obj = draw(st.dictionaries(st.sampled_from(["ns", "keys", "items", "prefix", "token",
                                                     "x"]), _plain, max_size=4))
    meta = msgpack.packb(meta_obj) if draw(st.booleans()) else draw(st.binary(max_size=64))
    payload_len = draw(st.integers(0, 2**64 - 1) | st.just(0))
    head = P.pack_header(op, 1, draw(st.just(len(meta)) | st.integers(0, 2**32 - 1)),
                         payload_len)
    data = head + meta
    if draw(st.booleans()):  # flip bytes anywhere, header included
        data = bytearray(data)
        for i in draw(st.lists(st.integers(0, len(data) - 1), max_size=4)):
            data[i] ^= draw(st.integers(1, 255))
        data = bytes(data)
    return data[: draw(st.integers(0, len(data)))] if draw(st.booleans()) else data


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(frames() | st.binary(max_size=200))
def test_parser_fuzz_only_raises_protocol_errors(data):
    with contextlib.suppress(P.ProtocolError):
        _parse_all(data)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(fuzz_frames.KINDS), st.integers(0, 2**32 - 1)),
                min_size=50, max_size=50))
def test_parser_fuzz_recipes(recipes):
    """10,000 frames of every malformed kind: each is refused with a ProtocolError (a bad
    checksum is the one kind the parser accepts: the payload is checked after receipt)."""
    for kind, seed in recipes:
        data = fuzz_frames.build(kind, seed)
        try:
            _parse_all(data)
        except P.ProtocolError:
            continue
        assert kind in ("bad_checksum", "flipped", "random_bytes", "truncated_payload"), kind
