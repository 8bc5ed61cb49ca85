"""vLLM 0.32's KV-cache event wire format, written with msgpack only (no vLLM, no msgspec).

Why our own encoder: lmc must publish from processes that have no vLLM (the reference engine,
SGLang, the daemon), and msgpack of plain lists and maps is byte-identical to vLLM's msgspec
encoder for the same values (``tests/events/test_vllm_decoder.py`` decodes it with vLLM's own
typed decoder). The facts it follows are in ``../shared/KV_EVENTS.md``:

* a ZMQ message is ``[topic, seq (8-byte big-endian), payload]``; the payload is a 3-element
  array ``[ts, events, data_parallel_rank]`` (Dynamo refuses 2 elements);
* an event is a map tagged ``"type"``; vLLM's decoder needs every required field present (null
  allowed), so :func:`block_stored` / :func:`block_removed` always write them;
* block hashes are unsigned 64-bit ints (Dynamo drops a batch carrying ``bytes``);
* ``medium`` is exactly ``GPU``, ``CPU`` or ``STORAGE`` (other spellings are dropped).

:func:`decode_batch` is the router's reader: it accepts the map and the older positional form
and refuses anything else with :class:`WireError` naming what was wrong, within fixed bounds
(an event stream is input from another process).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"
MEDIA = (GPU, CPU, STORAGE)
U64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end marker (vLLM's)."""

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window", "locality", "ownership", "session_id")
"""vLLM 0.32's ``BlockStored`` fields in wire order; the first 7 are required."""
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
"""``BlockRemoved``'s, the first 2 required."""

# Bounds on what the reader accepts from a peer (a batch is one scheduler step's events)
MAX_PAYLOAD = 64 << 20
MAX_EVENTS = 1 << 16
MAX_BLOCKS = 1 << 16


class WireError(ValueError):
    """A payload that is not a vLLM event batch; the message names what was wrong."""


def block_stored(block_hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
                 block_size: int, medium: str, *, lora_name: str | None = None,
                 cache_salt: str | None = None) -> dict[str, Any]:
    """One ``BlockStored``: ``len(token_ids) == len(block_hashes) * block_size``, ``parent``
    the hash of the block before the first (None only at a prompt's start). A salted
    request's ``cache_salt`` is a top-level key (Dynamo namespaces on it; vLLM's decoder
    ignores keys it does not know)."""
    ev: dict[str, Any] = {
        "type": "BlockStored", "block_hashes": list(block_hashes), "parent_block_hash": parent,
        "token_ids": list(token_ids), "block_size": block_size, "lora_id": None,
        "medium": medium, "lora_name": lora_name,
        "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    if cache_salt is not None:
        ev["cache_salt"] = cache_salt
    return ev


def block_removed(block_hashes: Sequence[int], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium,
            "group_idx": 0}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[dict[str, Any]], dp_rank: int | None = 0,
                 ts: float | None = None) -> bytes:
    """The payload of one batch (vLLM's map form)."""
    return msgpack.packb([time.time() if ts is None else float(ts), list(events), dp_rank])


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


# ------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class Stored:
    hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def _hash(v: Any, what: str) -> int:
    """A block hash as u64: vLLM's int form, or its bytes form (last 8 bytes, big-endian)."""
    if isinstance(v, bool):
        raise WireError(f"{what}: a bool is not a block hash")
    if isinstance(v, int):
        if not -(1 << 63) <= v <= U64:
            raise WireError(f"{what}: {v} is outside 64 bits")
        return v & U64
    if isinstance(v, bytes) and 0 < len(v) <= 64:
        return int.from_bytes(v[-8:], "big")
    raise WireError(f"{what}: expected an int or bytes, got {type(v).__name__}")


def _medium(v: Any, what: str) -> str:
    if v is None:
        return GPU
    if v not in MEDIA:
        raise WireError(f"{what}: medium {str(v)[:40]!r} is not one of {', '.join(MEDIA)}")
    return str(v)


def _opt_str(v: Any, what: str) -> str | None:
    if v is None or (isinstance(v, str) and len(v) <= 1024):
        return v
    raise WireError(f"{what}: expected a string of at most 1024 characters or null")


def _fields(raw: Any, names: tuple[str, ...], i: int) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:]))


def _event(raw: Any, i: int) -> Event:
    where = f"event {i}"
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise WireError(f"{where}: expected a map or an array, got {type(raw).__name__}")
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag == "BlockRemoved":
        f = _fields(raw, REMOVED_FIELDS, i)
        hashes = f.get("block_hashes")
        if not isinstance(hashes, list) or len(hashes) > MAX_BLOCKS:
            raise WireError(f"{where}: block_hashes must be a list of at most {MAX_BLOCKS}")
        return Removed(tuple(_hash(h, where) for h in hashes), _medium(f.get("medium"), where))
    if tag != "BlockStored":
        raise WireError(f"{where}: unknown type {str(tag)[:40]!r}")
    f = _fields(raw, STORED_FIELDS, i)
    hashes, toks, bs = f.get("block_hashes"), f.get("token_ids"), f.get("block_size")
    if not isinstance(hashes, list) or len(hashes) > MAX_BLOCKS:
        raise WireError(f"{where}: block_hashes must be a list of at most {MAX_BLOCKS}")
    if not isinstance(bs, int) or isinstance(bs, bool) or not 0 <= bs <= 1 << 20:
        raise WireError(f"{where}: block_size must be an int in [0, 2**20]")
    if not isinstance(toks, list) or len(toks) != len(hashes) * bs:
        raise WireError(f"{where}: token_ids must hold block_size x blocks "
                        f"= {len(hashes) * bs} ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= 0xFFFFFFFF
               for t in toks):
        raise WireError(f"{where}: token_ids must be unsigned 32-bit ints")
    parent = f.get("parent_block_hash")
    return Stored(tuple(_hash(h, where) for h in hashes),
                  None if parent is None else _hash(parent, where), tuple(toks), bs,
                  _medium(f.get("medium"), where), _opt_str(f.get("lora_name"), where),
                  _opt_str(f.get("cache_salt") if isinstance(raw, dict) else None, where))


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """``(ts, events, dp_rank)`` of one payload; :class:`WireError` for anything else."""
    if len(payload) > MAX_PAYLOAD:
        raise WireError(f"payload of {len(payload)} bytes is over {MAX_PAYLOAD}")
    try:
        arr = msgpack.unpackb(payload, strict_map_key=False, max_array_len=max(
            MAX_EVENTS, MAX_BLOCKS * 64), max_map_len=64)
    except (ValueError, msgpack.UnpackException, RecursionError) as e:
        raise WireError(f"payload is not msgpack: {type(e).__name__}: {str(e)[:100]}") from None
    if not isinstance(arr, list) or len(arr) not in (2, 3):
        raise WireError("payload must be an array [ts, events, data_parallel_rank]")
    ts, events = arr[0], arr[1]
    dp = arr[2] if len(arr) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise WireError("payload's ts must be a number")
    if not isinstance(events, list) or len(events) > MAX_EVENTS:
        raise WireError(f"payload's events must be a list of at most {MAX_EVENTS}")
    if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool)):
        raise WireError("payload's data_parallel_rank must be an int or null")
    return float(ts), [_event(e, i) for i, e in enumerate(events)], dp
