"""A trace's prompts as lmc chunk keys, computed once and interned to small ints.

Why: every grid point replays the same prompts, so their keys are computed once, here, with
lmc's own :class:`~lmc.token_database.ChunkedTokenDatabase` (the real xxh3 chain, the real
chunk size and partial-tail rule), and each distinct key becomes an int (a dict lookup on an
int is cheaper than on 16 bytes, and a million requests' keys fit in one ``array``). The
turns of a session extend one another, so a session keeps a
:class:`~lmc.token_database.RequestKeys` and each turn hashes only its new chunks; since
``RequestKeys`` trusts its caller that the sequence only grew, the new prompt is first
compared with the part already hashed (a C-speed list compare) and a session whose prompt
did not extend the last one starts afresh.
"""

from __future__ import annotations

import os
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from lmc.token_database import ChunkedTokenDatabase, RequestKeys
from lmc.workloads.trace import Encoder, TraceRequest, read_trace

MAX_OPEN_SESSIONS = 4096  # sessions whose last prompt is kept for incremental hashing


@dataclass
class KeyedTrace:
    """Per request: prompt length, output length, arrival, and its chunk keys as interned ids
    (``key_ids[offsets[i]:offsets[i + 1]]``)."""

    chunk_size: int
    save_unfull_chunk: bool
    num_tokens: array
    output_len: array
    arrival_s: array
    key_ids: array
    offsets: array
    num_keys: int
    hashed_tokens: int = 0  # tokens actually hashed (the rest came from session reuse)

    def __len__(self) -> int:
        return len(self.num_tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.num_tokens)

    def keys(self, i: int) -> list[int]:
        return self.key_ids[self.offsets[i]: self.offsets[i + 1]].tolist()


class _SessionKeys:
    __slots__ = ("tokens", "rk")

    def __init__(self, tokens: list[int], rk: RequestKeys) -> None:
        self.tokens = tokens
        self.rk = rk


def key_trace(requests: Iterable[TraceRequest], *, chunk_size: int = 256,
              save_unfull_chunk: bool = True, tokenizer: Encoder | None = None) -> KeyedTrace:
    """Keys of every request's prompt (see the module doc)."""
    db = ChunkedTokenDatabase(chunk_size, save_unfull_chunk)
    intern: dict[bytes, int] = {}
    ids = array("i")
    offsets = array("q", [0])
    ntok = array("l")
    outlen = array("l")
    arrival = array("d")
    sessions: OrderedDict[str, _SessionKeys] = OrderedDict()
    hashed = 0
    for req in requests:
        toks = req.tokens(tokenizer)
        sid = req.session_id
        if sid is None:
            keys = db.keys(toks)
            hashed += len(toks)
        else:
            s = sessions.get(sid)
            if s is not None:
                done = s.rk.hashed_tokens
                if len(toks) < done or toks[:done] != s.tokens[:done]:
                    s = None  # not a continuation of the session's last prompt
                else:
                    sessions.move_to_end(sid)
            if s is None:
                s = _SessionKeys(toks, db.request_keys())
                sessions[sid] = s
                while len(sessions) > MAX_OPEN_SESSIONS:
                    sessions.popitem(last=False)
            before = s.rk.hashed_tokens
            keys = s.rk.keys(toks)
            s.tokens = toks
            hashed += len(toks) - before
        for k in keys:
            i = intern.get(k)
            if i is None:
                i = intern[k] = len(intern)
            ids.append(i)
        offsets.append(len(ids))
        ntok.append(len(toks))
        outlen.append(req.output_len)
        arrival.append(req.arrival_s)
    return KeyedTrace(chunk_size, save_unfull_chunk, ntok, outlen, arrival, ids, offsets,
                      len(intern), hashed)


def load_trace(path: str | os.PathLike[str], *, chunk_size: int = 256,
               save_unfull_chunk: bool = True, tokenizer: Encoder | None = None,
               limit: int | None = None) -> KeyedTrace:
    """:func:`key_trace` of a JSONL trace file (``limit``: its first requests only)."""
    reqs: Iterator[TraceRequest] = read_trace(path)
    if limit is not None:
        reqs = (r for i, r in zip(range(limit), reqs))
    return key_trace(reqs, chunk_size=chunk_size, save_unfull_chunk=save_unfull_chunk,
                     tokenizer=tokenizer)
