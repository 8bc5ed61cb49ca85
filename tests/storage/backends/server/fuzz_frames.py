"""Malformed frames for the fuzz tests, built from (kind, seed) recipes that hypothesis draws.

Building a frame from a seed with ``random.Random`` costs microseconds, so hypothesis can
drive tens of thousands of frames through a live daemon in seconds; the kind tells the test
what the daemon must do with it:

* ``close``: framing is broken or a bound is exceeded -> an error answer, then EOF;
* ``answer``: the frame is well framed but wrong inside -> an error answer (or, for a bad
  checksum, an OK answer whose item result says so); the connection stays usable;
* ``any``: truncated or mangled -> the test half-closes its side and only requires the
  daemon to answer or close, never to hang or die.
"""

from __future__ import annotations

import random

import msgpack
import torch

from lmc.storage.backends.server import protocol as P
from lmc.storage.serde import encode_header

MAX_META = 64 << 10
MAX_PAYLOAD = 8 << 20
OPS = [P.GET, P.EXISTS, P.DELETE, P.PUT, P.STATS, P.PING]

CLOSE_KINDS = ("magic", "version", "meta_too_long", "payload_too_long", "payload_on_get")
ANSWER_KINDS = ("garbage_meta", "wrong_types", "bad_items", "bad_checksum", "unknown_op",
                "not_a_map")
ANY_KINDS = ("truncated_meta", "truncated_payload", "random_bytes", "flipped")
KINDS = CLOSE_KINDS + ANSWER_KINDS + ANY_KINDS


def expectation(kind: str) -> str:
    return "close" if kind in CLOSE_KINDS else "answer" if kind in ANSWER_KINDS else "any"


def _junk(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


def _wrong_value(rng: random.Random):
    return rng.choice([None, True, 3, -1, 2**63, 1.5, "s", b"\x00" * rng.randint(0, 40),
                       [1, "a"], {"k": 1}, [b"x" * 15], [b"x" * 17], ["0123456789abcdef"]])


def _valid_put(rng: random.Random, corrupt_payload: bool) -> tuple[bytes, bytes]:
    n = rng.randint(1, 32)
    t = torch.zeros(1, 2, n, 8, dtype=torch.float16)
    payload = bytearray(_junk(rng, t.numel() * 2))
    hdr = encode_header(_junk(rng, 16), t.shape, t.dtype, n, bytes(payload))
    if corrupt_payload:
        payload[rng.randrange(len(payload))] ^= 1 + rng.randrange(255)
    return msgpack.packb({"ns": "fuzz", "items": [hdr]}), bytes(payload)


def _meta_for(rng: random.Random) -> bytes:
    return msgpack.packb({"ns": "fuzz", "keys": [_junk(rng, 16) for _ in range(rng.randint(0, 4))]})


def build(kind: str, seed: int) -> bytes:
    """The bytes of one malformed frame of ``kind``."""
    rng = random.Random(seed)
    op = rng.choice(OPS)
    if kind in ("magic", "version", "meta_too_long", "payload_too_long", "payload_on_get"):
        meta = _meta_for(rng)
        head = bytearray(P.pack_header(op, seed, len(meta)))
        if kind == "magic":
            bad = _junk(rng, 4)
            head[:4] = bad if bad != P.MAGIC else b"XXXX"
        elif kind == "version":
            head[4] = rng.choice([0, 2, 3, 255])
        elif kind == "meta_too_long":
            head = bytearray(P.pack_header(op, seed, rng.randint(MAX_META + 1, 2**32 - 1)))
        elif kind == "payload_too_long":
            head = bytearray(P.pack_header(P.PUT, seed, len(meta),
                                           rng.randint(MAX_PAYLOAD + 1, 2**64 - 1)))
        else:
            head = bytearray(P.pack_header(rng.choice([P.GET, P.EXISTS, P.DELETE]), seed,
                                           len(meta), rng.randint(1, 2**40)))
        return bytes(head) + meta
    if kind == "garbage_meta":
        meta = b"\xc1" + _junk(rng, rng.randint(0, 200))  # 0xc1 is never valid msgpack
        return P.pack_header(rng.choice([P.GET, P.EXISTS, P.DELETE]), seed, len(meta)) + meta
    if kind == "not_a_map":
        meta = msgpack.packb(rng.choice([[1, 2], "str", 7, None, b"bin"]))
        return P.pack_header(rng.choice([P.GET, P.EXISTS, P.DELETE]), seed, len(meta)) + meta
    if kind == "wrong_types":
        field = rng.choice(["ns", "keys", "prefix"])
        m = {"ns": "fuzz", "keys": [_junk(rng, 16)], field: _wrong_value(rng)}
        if field == "prefix" and isinstance(m["prefix"], bool):
            m["prefix"] = 1
        if field == "ns" and isinstance(m["ns"], str):
            m["ns"] = 5  # every other drawn value is already wrong for its field
        meta = msgpack.packb(m)
        ops = [P.GET, P.EXISTS] if field == "prefix" else [P.GET, P.EXISTS, P.DELETE]
        return P.pack_header(rng.choice(ops), seed, len(meta)) + meta
    if kind == "bad_items":
        plen = rng.randint(0, 4096)
        items = rng.choice([[_junk(rng, 72)], [_junk(rng, rng.randint(0, 100))], "x", [3],
                            [None]])
        meta = msgpack.packb({"ns": "fuzz", "items": items})
        return P.pack_header(P.PUT, seed, len(meta), plen) + meta + _junk(rng, plen)
    if kind == "bad_checksum":
        meta, payload = _valid_put(rng, corrupt_payload=True)
        return P.pack_header(P.PUT, seed, len(meta), len(payload)) + meta + payload
    if kind == "unknown_op":
        meta = msgpack.packb({})
        bad_op = rng.choice([o for o in range(256) if o not in P.OPS])
        return P.pack_header(bad_op, seed, len(meta)) + meta
    if kind == "truncated_meta":
        meta = _meta_for(rng)
        return P.pack_header(P.GET, seed, len(meta)) + meta[: rng.randrange(max(1, len(meta)))]
    if kind == "truncated_payload":
        meta, payload = _valid_put(rng, corrupt_payload=False)
        return (P.pack_header(P.PUT, seed, len(meta), len(payload)) + meta
                + payload[: rng.randrange(len(payload))])
    if kind == "random_bytes":
        return _junk(rng, rng.randint(1, 120))
    if kind == "flipped":
        meta, payload = _valid_put(rng, corrupt_payload=False)
        data = bytearray(P.pack_header(P.PUT, seed, len(meta), len(payload)) + meta + payload)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(min(len(data), 24 + len(meta)))] ^= 1 + rng.randrange(255)
        return bytes(data)
    raise ValueError(f"unknown kind {kind!r}")
