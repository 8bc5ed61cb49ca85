"""Adding a tier, shown on a toy: a dict of bytes, registered in this module, runs the whole
contract classes it should pass (:mod:`lmc.testing`) with one fixture and one line. docs/extending.md ("A storage
tier") walks through it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryObj, MemoryPool
from lmc.storage.serde import (
    HEADER_SIZE,
    CorruptValue,
    decode_header,
    encodable,
    encode_header,
    verify_payload,
)
from lmc.storage.tier import Key, StorageBackend, register_backend
from lmc.testing import (
    BasicContract,
    BatchContract,
    ConcurrencyContract,
    IntegrityContract,
    ModelContract,
    ReferenceContract,
    TierSpec,
)


@register_backend("contract-toy")
class DictTier(StorageBackend):
    """Each value as ``lmc.storage.serde`` header + payload bytes in a dict: the bytes leave the pool
    (as a real tier's would), so every read is checked, and a bad value is a miss, deleted."""

    def __init__(self, spec: str, *, config: CacheConfig, pool: MemoryPool, **_: Any) -> None:
        self.pool = pool  # reads allocate their destinations here
        self.values: dict[Key, bytes] = {}
        self._lock = threading.Lock()
        self._closed = False

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        with self._lock:
            return [k in self.values for k in keys]

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        with self._lock:
            found = [None if self._closed else self.values.get(k) for k in keys]
        return [None if v is None else self._load(k, v) for k, v in zip(keys, found)]

    def _load(self, key: Key, value: bytes) -> MemoryObj | None:
        payload = memoryview(value)[HEADER_SIZE:]
        try:
            h = decode_header(value, expected_key=key)
            verify_payload(h, payload)
        except CorruptValue:
            with self._lock:  # verify or delete: never served, never kept
                if self.values.get(key) is value:
                    del self.values[key]
            return None
        obj = self.pool.allocate(h.shape, h.dtype, h.num_tokens)
        if obj is not None:  # a full pool is a miss
            obj.byte_view()[:] = payload
        return obj

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        pairs = list(zip(keys, objs, strict=True))  # mismatched lengths: ValueError
        new = {}
        for k, o in pairs:  # copied now: the caller keeps its own reference
            if not encodable(o):  # no header describes it: skipped, as every tier does
                continue
            payload = bytes(o.byte_view())
            new[k] = encode_header(k, o.shape, o.dtype, o.num_tokens, payload) + payload
        with self._lock:
            if self._closed:
                return 0
            for k, v in new.items():
                self.values.setdefault(k, v)  # content-addressed: same key, same bytes
        return sum(k in new for k, _ in pairs)

    def delete(self, keys: Sequence[Key]) -> int:
        with self._lock:
            return sum(self.values.pop(k, None) is not None for k in keys)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.values.clear()


def _flip_a_payload_bit(tier: DictTier, key: Key) -> None:
    value = bytearray(tier.values[key])
    value[HEADER_SIZE + 3] ^= 0x01
    tier.values[key] = bytes(value)


@pytest.fixture
def tier_spec():
    return TierSpec("contract-toy", corrupt=_flip_a_payload_bit)


class TestDictTierContract(BasicContract, BatchContract, ModelContract, ReferenceContract,
                           ConcurrencyContract, IntegrityContract):
    """What an in-process store of bytes can keep: no backend to share, kill or hang."""
