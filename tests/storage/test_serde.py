"""The value header: round trip, and every kind of damage detected."""

from __future__ import annotations

import pytest
import torch

from lmc.storage.serde import (
    HEADER_SIZE,
    CorruptValue,
    decode_header,
    encode_header,
    tensor_bytes,
    verify_payload,
)
from tests.kvutil import DTYPES, random_bits

KEY = bytes(range(16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip(dtype):
    t = random_bits((2, 2, 5, 8), dtype, torch.Generator().manual_seed(0))
    payload = tensor_bytes(t)
    h = encode_header(KEY, t.shape, dtype, 5, payload)
    assert len(h) == HEADER_SIZE
    hdr = decode_header(h + bytes(payload), expected_key=KEY)
    assert (hdr.shape, hdr.dtype, hdr.num_tokens, hdr.payload_len) == (
        (2, 2, 5, 8), dtype, 5, t.numel() * dtype.itemsize)
    verify_payload(hdr, payload)


def _value():
    t = torch.arange(2 * 2 * 4 * 8, dtype=torch.float32).view(2, 2, 4, 8)
    payload = bytes(tensor_bytes(t))
    return encode_header(KEY, t.shape, torch.float32, 4, payload), payload


def test_every_header_bit_flip_is_caught():
    header, _ = _value()
    for i in range(len(header) * 8):
        bad = bytearray(header)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(CorruptValue):
            decode_header(bytes(bad), expected_key=KEY)


def test_payload_damage_is_caught():
    header, payload = _value()
    hdr = decode_header(header, KEY)
    flipped = bytearray(payload)
    flipped[100] ^= 0x10
    with pytest.raises(CorruptValue, match="checksum"):
        verify_payload(hdr, bytes(flipped))
    with pytest.raises(CorruptValue, match="bytes, header says"):
        verify_payload(hdr, payload[:-1])


def test_wrong_key_and_truncation():
    header, _ = _value()
    with pytest.raises(CorruptValue, match="expected"):
        decode_header(header, expected_key=b"x" * 16)
    with pytest.raises(CorruptValue, match="too short"):
        decode_header(header[:40])
    with pytest.raises(CorruptValue, match="checksum"):
        decode_header(b"\0" * HEADER_SIZE)
