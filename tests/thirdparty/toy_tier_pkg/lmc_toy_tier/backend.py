"""``toyfiles:///DIR``: one file per KV chunk in directory ``DIR``.

A third-party tier as small as the contract allows: each value is an ``lmc.storage.serde`` header and
its payload, written to a temporary name and renamed into place (a reader never sees half a
value); a read checks the header and the payload checksum, and a value failing them is a miss,
deleted. The directory outlives the tier (a second tier over it serves the same values); a
directory gone (a lost device) makes every call a miss or 0, never an error.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryObj
from lmc.storage.serde import (
    HEADER_SIZE,
    CorruptValue,
    decode_header,
    encodable,
    encode_header,
    verify_payload,
)
from lmc.storage.tier import (
    Key,
    Medium,
    StorageBackend,
    TierCapabilities,
    register_backend,
)


@register_backend("toyfiles", schemes=("toyfiles",))
class FileTier(StorageBackend):
    """Values as files named by their key; no index, no capacity (a toy)."""

    medium = Medium.LOCAL_STORAGE
    capabilities = TierCapabilities(existence_without_reading=True, durable=True)

    def __init__(self, spec: str, *, config: CacheConfig, pool: Any) -> None:
        """``spec``: the URL, or the name ``toyfiles`` with the URL in ``remote_url``."""
        url = spec if "://" in spec else config.remote_url or ""
        path = urlsplit(url).path
        if not url.startswith("toyfiles://") or not path:
            raise ValueError(f"toyfiles: want a URL toyfiles:///DIR, got {url!r}")
        self.pool = pool  # reads allocate their destinations here
        self.path = path
        self._closed = False
        os.makedirs(path, exist_ok=True)

    def _file(self, key: Key) -> str:
        return os.path.join(self.path, key.hex())

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return [not self._closed and os.path.exists(self._file(k)) for k in keys]

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        return [None if self._closed else self._load(k) for k in keys]

    def _load(self, key: Key) -> MemoryObj | None:
        try:
            with open(self._file(key), "rb") as f:
                value = f.read()
        except OSError:  # absent, or the directory is gone: a miss
            return None
        try:
            header = decode_header(value, expected_key=key)
            verify_payload(header, memoryview(value)[HEADER_SIZE:])
        except CorruptValue:
            self.delete([key])  # verified or deleted: never served, never kept
            return None
        obj = self.pool.allocate(header.shape, header.dtype, header.num_tokens)
        if obj is not None:  # a full pool is a miss
            obj.byte_view()[:] = memoryview(value)[HEADER_SIZE:]
        return obj

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        pairs = list(zip(keys, objs, strict=True))  # mismatched lengths: ValueError
        return sum(self._store(k, o) for k, o in pairs)

    def _store(self, key: Key, obj: MemoryObj) -> bool:
        """Written (or already present), and the caller's object is left as it was."""
        if self._closed or not encodable(obj):  # no header describes it: skipped
            return False
        if os.path.exists(self._file(key)):  # content-addressed: same key, same bytes
            return True
        payload = bytes(obj.byte_view())
        tmp = os.path.join(self.path, f".{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(encode_header(key, obj.shape, obj.dtype, obj.num_tokens, payload))
                f.write(payload)
            os.replace(tmp, self._file(key))
        except OSError:  # the directory is gone: not stored
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        return True

    def delete(self, keys: Sequence[Key]) -> int:
        if self._closed:
            return 0
        gone = 0
        for k in dict.fromkeys(keys):
            with contextlib.suppress(OSError):
                os.unlink(self._file(k))
                gone += 1
        return gone

    def close(self) -> None:
        self._closed = True  # the files stay: they are the store
