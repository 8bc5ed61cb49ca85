"""The lmc cache-server wire protocol, version 1: frame header, opcodes, status codes, and the
validation of everything read from the wire (see ``docs/protocol.md``).

Every frame is a fixed 24-byte little-endian header, then ``meta_len`` bytes of msgpack
metadata, then ``payload_len`` bytes of raw payload::

    magic "LMCP" | version u8 | op u8 | status u16 | req_id u32 | meta_len u32 | payload_len u64

Why this shape: the header is enough to bound every allocation before reading anything else
(``check_header``), msgpack keeps the metadata schema-flexible without ever running code, and
a raw payload can be received straight into pool memory. Values inside a payload are
described by ``lmc.storage.serde`` headers (key, dtype, shape, tokens, length, xxh3), the same bytes
the disk and Redis tiers store, so both ends verify checksums with code they already share.

Functions here are pure (bytes in, objects or :class:`ProtocolError` out), which is what the
fuzz tests hammer.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from lmc.storage.serde import HEADER_SIZE as VALUE_HEADER_SIZE
from lmc.storage.serde import CorruptValue, Header, decode_header

MAGIC = b"LMCP"
VERSION = 1
DEFAULT_PORT = 7451  # lmc server's TCP port when an address names none
FRAME = struct.Struct("<4sBBHIIQ")
FRAME_SIZE = FRAME.size  # 24
KEY_SIZE = 16
RESPONSE = 0x80  # a response's op is the request's op | RESPONSE

# ---- opcodes
HELLO, PING, STATS = 0x01, 0x02, 0x03
PUT, GET, EXISTS, DELETE = 0x10, 0x11, 0x12, 0x13
OPS = {HELLO: "hello", PING: "ping", STATS: "stats", PUT: "put", GET: "get",
       EXISTS: "exists", DELETE: "delete"}
# cache control (lmc.server.control): clear a namespace, pin with a TTL, retention priority
CLEAR, PIN, UNPIN, PRIORITY = 0x14, 0x15, 0x16, 0x17
CONTROL_OPS = {CLEAR: "clear", PIN: "pin", UNPIN: "unpin", PRIORITY: "priority"}
OPS.update(CONTROL_OPS)
# the peer-to-peer tier's directory of who holds which chunk (lmc/server/p2p/ops.py)
P2P_JOIN, P2P_ADVERTISE, P2P_WITHDRAW, P2P_LOCATE, P2P_PEER = 0x20, 0x21, 0x22, 0x23, 0x24
P2P_OPS = {P2P_JOIN: "p2p_join", P2P_ADVERTISE: "p2p_advertise", P2P_WITHDRAW: "p2p_withdraw",
           P2P_LOCATE: "p2p_locate", P2P_PEER: "p2p_peer"}
OPS.update(P2P_OPS)

# ---- status codes (header field of responses)
OK = 0
BAD_FRAME = 1       # framing broken (magic, version, lengths): the connection is closed
BAD_REQUEST = 2     # metadata malformed: answered, the connection stays usable
AUTH_FAILED = 3     # missing or wrong token: answered, then closed
TOO_LARGE = 4       # a length past a configured bound: answered, then closed
UNKNOWN_OP = 5
SHUTTING_DOWN = 6
INTERNAL = 7
FORBIDDEN = 8       # the token does not grant that namespace: answered, the connection stays
REFUSED = 9         # a control op past a bound (pins, TTL, priority): answered with the rule's
                    # "code" (lmc.storage.control), the connection stays
STATUS_NAMES = {OK: "ok", BAD_FRAME: "bad_frame", BAD_REQUEST: "bad_request",
                AUTH_FAILED: "auth_failed", TOO_LARGE: "too_large", UNKNOWN_OP: "unknown_op",
                SHUTTING_DOWN: "shutting_down", INTERNAL: "internal", FORBIDDEN: "forbidden",
                REFUSED: "refused"}

# ---- per-item results of a PUT (one byte each in the response's "results")
STORED, BAD_CHECKSUM, NO_MEMORY, OVER_QUOTA = 0, 1, 2, 3


class ProtocolError(Exception):
    """Something read from the wire broke the protocol. ``fatal``: the stream is no longer
    framed (or must not be trusted), so the connection is closed after the answer."""

    def __init__(self, status: int, message: str, fatal: bool = False, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.fatal = fatal
        self.code = code  # a refused control op: the rule (lmc.storage.control's codes)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on everything a peer can make us allocate."""

    max_meta: int = 1 << 20          # bytes of msgpack metadata in one frame
    max_payload: int = 256 << 20     # bytes of payload in one frame
    max_value: int = 256 << 20       # bytes of one value
    max_batch: int = 4096            # keys or values in one request
    max_namespace: int = 64          # bytes of a namespace name (UTF-8)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class FrameHeader:
    op: int
    status: int
    req_id: int
    meta_len: int
    payload_len: int


def pack_header(op: int, req_id: int, meta_len: int, payload_len: int = 0, status: int = 0
                ) -> bytes:
    return FRAME.pack(MAGIC, VERSION, op, status, req_id & 0xFFFFFFFF, meta_len, payload_len)


def unpack_header(buf: Any) -> FrameHeader:
    """Parse the fixed header; magic and version are checked, lengths are not (see
    :func:`check_header`)."""
    if len(buf) < FRAME_SIZE:
        raise ProtocolError(BAD_FRAME, f"frame header needs {FRAME_SIZE} bytes, got {len(buf)}",
                            fatal=True)
    magic, version, op, status, req_id, meta_len, payload_len = FRAME.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(BAD_FRAME, "bad magic", fatal=True)
    if version != VERSION:
        raise ProtocolError(BAD_FRAME, f"unsupported protocol version {version} "
                            f"(this build speaks {VERSION})", fatal=True)
    return FrameHeader(op, status, req_id, meta_len, payload_len)


def check_header(h: FrameHeader, limits: Limits) -> None:
    """Bound the lengths of a request before anything is read or allocated for it."""
    if h.meta_len > limits.max_meta:
        raise ProtocolError(TOO_LARGE, f"metadata of {h.meta_len} B exceeds max_meta "
                            f"{limits.max_meta} B", fatal=True)
    if h.op == PUT:
        if h.payload_len > limits.max_payload:
            raise ProtocolError(TOO_LARGE, f"payload of {h.payload_len} B exceeds max_payload "
                                f"{limits.max_payload} B", fatal=True)
    elif h.payload_len:
        raise ProtocolError(BAD_FRAME, f"op {h.op:#x} carries no payload, header says "
                            f"{h.payload_len} B", fatal=True)


def pack_meta(meta: Mapping[str, Any]) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def unpack_meta(buf: Any, limits: Limits, max_map: int = 64) -> dict[str, Any]:
    """Decode metadata with every container and string bounded (no code ever runs: msgpack
    decodes plain data only; ext types are refused). Requests are small maps; a client
    reading STATS passes a larger ``max_map``."""
    if len(buf) == 0:
        return {}
    try:
        meta = msgpack.unpackb(
            buf, raw=False, strict_map_key=True, use_list=True,
            max_str_len=max(limits.max_namespace * 4, 4096),
            # bins: 16-byte keys, 48-byte value headers, a chunk's tokens (block info: up to
            # 16k tokens); the whole frame's metadata is bounded by max_meta before this
            max_bin_len=max(64 << 10, limits.max_batch), max_array_len=limits.max_batch,
            max_map_len=max_map, max_ext_len=0)
    except Exception as e:  # any decoding failure is the peer's fault, never ours
        raise ProtocolError(BAD_REQUEST, f"undecodable metadata ({type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise ProtocolError(BAD_REQUEST, f"metadata must be a map, got {type(meta).__name__}")
    return meta


# ------------------------------------------------------------- request fields
def _field(meta: Mapping[str, Any], name: str, types: type | tuple[type, ...], default: Any
           ) -> Any:
    v = meta.get(name, default)
    if not isinstance(v, types):
        raise ProtocolError(BAD_REQUEST, f"field {name!r} has type {type(v).__name__}")
    return v


def get_namespace(meta: Mapping[str, Any], limits: Limits) -> str:
    ns = _field(meta, "ns", str, "")
    if len(ns.encode()) > limits.max_namespace:
        raise ProtocolError(BAD_REQUEST, f"namespace longer than {limits.max_namespace} bytes")
    return ns


def get_flag(meta: Mapping[str, Any], name: str) -> bool:
    return _field(meta, name, bool, False)


def get_keys(meta: Mapping[str, Any], limits: Limits) -> list[bytes]:
    keys = _field(meta, "keys", list, None)
    if len(keys) > limits.max_batch:
        raise ProtocolError(BAD_REQUEST, f"{len(keys)} keys exceed max_batch {limits.max_batch}")
    for k in keys:
        if not isinstance(k, bytes) or len(k) != KEY_SIZE:
            raise ProtocolError(BAD_REQUEST, f"every key must be {KEY_SIZE} bytes of bin")
    return keys


def get_number(meta: Mapping[str, Any], name: str) -> float:
    """A required finite number (the range is the caller's rule to check)."""
    v = meta.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(BAD_REQUEST, f"field {name!r} must be a number, got "
                            f"{type(v).__name__}")
    return float(v)


def get_opt_int(meta: Mapping[str, Any], name: str) -> int | None:
    v = meta.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(BAD_REQUEST, f"field {name!r} must be an integer, got "
                            f"{type(v).__name__}")
    return v


MAX_OWNER = 64  # bytes of a pin's owner (a session id)


def get_owner(meta: Mapping[str, Any]) -> bytes | None:
    """A pin's owner: up to ``MAX_OWNER`` bytes of bin, or absent."""
    v = _field(meta, "owner", (bytes, type(None)), None)
    if v is not None and not 0 < len(v) <= MAX_OWNER:
        raise ProtocolError(BAD_REQUEST, f"owner must be 1 to {MAX_OWNER} bytes, got {len(v)}")
    return v


def get_token(meta: Mapping[str, Any]) -> bytes:
    tok = _field(meta, "token", (str, type(None)), None)
    return b"" if tok is None else tok.encode()


def get_put_items(meta: Mapping[str, Any], payload_len: int, limits: Limits) -> list[Header]:
    """The value headers of a PUT, each checked, their lengths summing to the payload."""
    items = _field(meta, "items", list, None)
    if len(items) > limits.max_batch:
        raise ProtocolError(BAD_REQUEST, f"{len(items)} values exceed max_batch "
                            f"{limits.max_batch}")
    out: list[Header] = []
    total = 0
    for i, raw in enumerate(items):
        if not isinstance(raw, bytes) or len(raw) != VALUE_HEADER_SIZE:
            raise ProtocolError(BAD_REQUEST, f"item {i}: expected a {VALUE_HEADER_SIZE}-byte "
                                "value header")
        try:
            h = decode_header(raw)
        except CorruptValue as e:
            raise ProtocolError(BAD_REQUEST, f"item {i}: {e}") from None
        if h.payload_len > limits.max_value:
            raise ProtocolError(BAD_REQUEST, f"item {i}: value of {h.payload_len} B exceeds "
                                f"max_value {limits.max_value} B")
        if h.payload_len == 0:
            raise ProtocolError(BAD_REQUEST, f"item {i}: empty value")
        total += h.payload_len
        out.append(h)
    if total != payload_len:
        raise ProtocolError(BAD_REQUEST, f"values add up to {total} B, frame payload is "
                            f"{payload_len} B")
    return out


def check_response(h: FrameHeader, op: int, req_id: int, limits: Limits, max_payload: int
                   ) -> None:
    """Client side: the response answers this request and its lengths are within bounds."""
    if h.op != op | RESPONSE or h.req_id != req_id:
        raise ProtocolError(BAD_FRAME, f"response op {h.op:#x} id {h.req_id} does not answer "
                            f"op {op:#x} id {req_id}", fatal=True)
    if h.meta_len > limits.max_meta:
        raise ProtocolError(TOO_LARGE, f"response metadata of {h.meta_len} B past the bound",
                            fatal=True)
    if h.payload_len > max_payload:
        raise ProtocolError(TOO_LARGE, f"response payload of {h.payload_len} B past the bound "
                            f"{max_payload} B", fatal=True)


def get_value_headers(meta: Mapping[str, Any], keys: Sequence[bytes], payload_len: int
                      ) -> list[Header | None]:
    """Client side: a GET response's items, each matching the key asked for at its place."""
    items = meta.get("items")
    if not isinstance(items, list) or len(items) > len(keys):
        raise ProtocolError(BAD_FRAME, "GET response items malformed", fatal=True)
    out: list[Header | None] = []
    total = 0
    for raw, key in zip(items, keys):
        if raw is None:
            out.append(None)
            continue
        if not isinstance(raw, bytes):
            raise ProtocolError(BAD_FRAME, "GET response item is not a value header", fatal=True)
        try:
            h = decode_header(raw, expected_key=key)
        except CorruptValue as e:
            raise ProtocolError(BAD_FRAME, f"GET response: {e}", fatal=True) from None
        total += h.payload_len
        out.append(h)
    if total != payload_len:
        raise ProtocolError(BAD_FRAME, f"GET response values add up to {total} B, payload is "
                            f"{payload_len} B", fatal=True)
    return out
