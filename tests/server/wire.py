"""Speaking the protocol byte by byte, for tests that must send what a real client never
would (half frames, silence, wrong tokens, duplicate keys) and see exactly what comes back."""

from __future__ import annotations

import contextlib
import hashlib
import socket
from typing import Any

import torch

from lmc.storage.backends.server import protocol as P
from lmc.storage.serde import encode_header


def value_bytes(ns: str, key: bytes, tokens: int = 8, width: int = 64) -> tuple[bytes, bytes]:
    """A deterministic fp16 value for (ns, key): its 72-byte header and its payload. Distinct
    namespaces get distinct bytes for the same key, so cross-talk cannot go unnoticed."""
    n = 2 * tokens * width * 2
    seed = hashlib.blake2b(ns.encode() + b"\0" + key, digest_size=32).digest()
    payload = (seed * (n // len(seed) + 1))[:n]
    hdr = encode_header(key, (1, 2, tokens, width), torch.float16, tokens, payload)
    return hdr, payload


def frame(op: int, meta: dict[str, Any], payload: bytes = b"", req_id: int = 1) -> bytes:
    m = P.pack_meta(meta)
    return P.pack_header(op, req_id, len(m), len(payload)) + m + payload


def hello(token: str | None = None, client: str = "raw") -> bytes:
    meta: dict[str, Any] = {"client": client}
    if token is not None:
        meta["token"] = token
    return frame(P.HELLO, meta)


def put(ns: str, values: list[tuple[bytes, bytes]], req_id: int = 1) -> bytes:
    """A PUT of ``(header, payload)`` pairs."""
    return frame(P.PUT, {"ns": ns, "items": [h for h, _ in values]},
                 b"".join(p for _, p in values), req_id)


class RawClient:
    """A blocking socket that sends bytes and reads answers by their frame header."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> bool:
        """False when the daemon had already closed the connection."""
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def _exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def answer(self) -> tuple[int, dict[str, Any], bytes] | None:
        """(status, metadata, payload) of the next answer, or None at EOF."""
        raw = self._exact(P.FRAME_SIZE)
        if raw is None:
            return None
        h = P.unpack_header(raw)
        meta = P.unpack_meta(self._exact(h.meta_len) or b"", P.Limits(max_batch=1 << 16),
                             max_map=1 << 12)
        payload = self._exact(h.payload_len) if h.payload_len else b""
        return h.status, meta, payload or b""

    def call(self, data: bytes) -> tuple[int, dict[str, Any], bytes]:
        assert self.send(data), "the daemon closed the connection before the request"
        got = self.answer()
        assert got is not None, "the daemon closed the connection instead of answering"
        return got

    def at_eof(self, timeout: float = 10.0) -> bool:
        """Whether the daemon closes the connection within ``timeout`` (nothing else sent)."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def fd_count(pid: int) -> int:
    import os

    with contextlib.suppress(FileNotFoundError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return -1
