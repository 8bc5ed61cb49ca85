"""The value head (:mod:`lmc.storage.framing`): what a shared tier writes before each
payload and checks on every read. A writer who alters any bit of head or payload, swaps
keys, forges or drops the tag, or describes another model's chunk gets a CorruptValue,
never a value (docs/design.md, "The tier kit")."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmc.memory.pool import MemoryPool
from lmc.storage.framing import ValueFraming
from lmc.storage.integrity import Geometry, Integrity
from lmc.storage.serde import HEADER_SIZE, TAG_SIZE, CorruptValue

SECRET = "a-test-secret-of-32-bytes-length"
KEY = bytes(range(16))
SHAPE = (2, 2, 4, 8)


@pytest.fixture(scope="module")
def chunk():
    pool = MemoryPool(1 << 16, pin_memory=False)
    obj = pool.allocate(SHAPE, torch.float16, 4)
    obj.tensor.copy_(torch.arange(obj.tensor.numel(), dtype=torch.float16).view(SHAPE))
    yield obj
    obj.release()


def _frames():
    return [ValueFraming(None), ValueFraming(Integrity(SECRET))]


@pytest.mark.parametrize("frame", _frames(), ids=["plain", "keyed"])
def test_round_trip(frame, chunk):
    payload = bytes(chunk.byte_view())
    head = frame.encode(KEY, chunk, chunk.byte_view())
    assert len(head) == frame.size == HEADER_SIZE + (TAG_SIZE if frame.integrity else 0)
    geometry = Geometry(2, 2, 8, torch.float16, max_tokens=4)
    hdr = frame.decode(head, KEY, geometry)
    assert (tuple(hdr.shape), hdr.dtype, hdr.num_tokens) == (SHAPE, torch.float16, 4)
    frame.verify(KEY, head, hdr, payload)


@pytest.mark.parametrize("frame", _frames(), ids=["plain", "keyed"])
@given(pos=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_flipped_bit_is_refused(frame, chunk, pos, bit):
    value = bytearray(frame.encode(KEY, chunk, chunk.byte_view()) + bytes(chunk.byte_view()))
    pos %= len(value)
    value[pos] ^= 1 << bit
    head, payload = bytes(value[: frame.size]), bytes(value[frame.size:])
    with pytest.raises(CorruptValue):
        frame.verify(KEY, head, frame.decode(head, KEY), payload)


def test_wrong_key_other_geometry_and_mixed_secrets_are_refused(chunk):
    plain, keyed = _frames()
    other = ValueFraming(Integrity(SECRET[::-1]))
    head = keyed.encode(KEY, chunk, chunk.byte_view())
    with pytest.raises(CorruptValue, match="expected"):
        keyed.decode(head, bytes(16))
    with pytest.raises(CorruptValue):
        keyed.decode(head, KEY, Geometry(3, 2, 8, torch.float16, max_tokens=4))
    with pytest.raises(CorruptValue, match="integrity tag but no integrity_secret"):
        plain.decode(head, KEY)
    with pytest.raises(CorruptValue, match="no integrity tag"):
        keyed.decode(plain.encode(KEY, chunk, chunk.byte_view()), KEY)
    hdr = other.decode(head, KEY)  # the header itself is not secret...
    with pytest.raises(CorruptValue):  # ...but the tag is: another secret refuses it
        other.verify(KEY, head, hdr, bytes(chunk.byte_view()))
