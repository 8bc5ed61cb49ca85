"""Attacks on the daemon's KV events through the PUT's block info (docs/threats/daemon.md):
forged tokens, malformed and extreme fields, huge lists, another tenant's namespace. Each is
refused with a named error or bounded; the daemon keeps serving; no tenant's events speak
for another namespace."""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
import pytest
import xxhash
import yaml

from lmc.events import wire
from lmc.router.index import PrefixIndex
from lmc.router.policy import PromptKeys
from lmc.storage.backends.server import protocol as P
from tests.events.helpers import Collector
from tests.server import wire as W
from tests.server.daemon_proc import DaemonProc

pytestmark = pytest.mark.integration
BS, CS = 4, 8
EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
          "replay_endpoint": "tcp://127.0.0.1:*", "block_size": BS, "heartbeat": 0.3}
NS0 = b"\x11" * 16  # a prompt's first "prev": the engine's key namespace


def chunk(tokens: list[int], prev: bytes = NS0, ns: str = "alpha"
          ) -> tuple[bytes, bytes, bytes, bytes]:
    """(key, value header, payload, token bytes) of an 8-token chunk keyed as lmc keys."""
    tb = b"".join(t.to_bytes(4, "little") for t in tokens)
    key = xxhash.xxh3_128_digest(prev + tb)
    hdr, payload = W.value_bytes(ns, key, tokens=len(tokens))
    return key, hdr, payload, tb


def put(ns: str, values: list[tuple[bytes, bytes]], blocks: Any, req_id: int = 1) -> bytes:
    meta: dict[str, Any] = {"ns": ns, "items": [h for h, _ in values]}
    if blocks is not None:
        meta["blocks"] = blocks
    return W.frame(P.PUT, meta, b"".join(p for _, p in values), req_id)


def info(items: list[Any], **kw: Any) -> dict[str, Any]:
    return {"bs": BS, "cs": CS, "lora": None, "items": items, **kw}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evattack")
    secrets = {n: f"{n}-{os.urandom(8).hex()}" for n in ("alpha", "beta", "ops")}
    files = {}
    for n, sec in secrets.items():
        files[n] = tmp / f"{n}.token"
        files[n].write_text(sec + "\n")
    cfg = tmp / "d.yaml"
    cfg.write_text(yaml.safe_dump({
        "tokens": [{"token_file": str(files["alpha"]), "namespaces": ["alpha"]},
                   {"token_file": str(files["beta"]), "namespaces": ["beta"]},
                   {"token_file": str(files["ops"]), "admin": True, "name": "ops"}],
        "kv_events": EVENTS}))
    d = DaemonProc(tmp / "d", ["--config", str(cfg), "--size", "64MiB"]).start()
    sub = Collector(d.info["kv_events"]["endpoint"])
    yield d, secrets, sub
    sub.close()
    d.kill()


def authed(d: DaemonProc, secret: str) -> W.RawClient:
    c = W.RawClient(d.port)
    status, meta, _ = c.call(W.hello(secret))
    assert status == P.OK and meta["kv_events"] == {"block_size": BS}, meta
    return c


def drain(sub: Collector, wait: float = 1.0) -> list[wire.Event]:
    return sub.events(wait=wait)


def test_tokens_of_another_chunk_are_refused_and_nothing_is_published(daemon):
    d, sec, sub = daemon
    c = authed(d, sec["alpha"])
    drain(sub, 0.5)
    key, hdr, payload, tb = chunk(list(range(8)))
    _, _, _, other = chunk(list(range(100, 108)))
    for bad, why in ((other, "do not hash to the chunk's key"),      # another chunk's tokens
                     (tb, "do not hash to the chunk's key")):        # the right tokens, wrong prev
        prev = NS0 if bad is other else b"\x22" * 16
        status, meta, _ = c.call(put("alpha", [(hdr, payload)], info([[prev, bad, 0]])))
        assert status == P.BAD_REQUEST and why in meta["error"], meta
    # the connection stays usable, the value was not stored, nothing was published
    status, meta, _ = c.call(W.frame(P.EXISTS, {"ns": "alpha", "keys": [key]}))
    assert status == P.OK and not any(meta["present"]), meta
    assert not [e for e in drain(sub) if isinstance(e, wire.Stored)]
    c.close()
    assert d.alive() and d.stats(sec["ops"])["kv_events"]["kv_events.refused"] >= 2
    assert "kv_events" not in d.stats(sec["alpha"])  # a tenant sees no daemon-wide counts


MALFORMED = [
    ("not a map", [1, 2], "blocks: expected a map"),
    ("unknown field", info([None], evil=1), "unknown field 'evil'"),
    ("zero block size", info([None], bs=0), "blocks.bs"),
    ("bool block size", info([None], bs=True), "blocks.bs"),
    ("huge block size", info([None], bs=1 << 40), "blocks.bs"),
    ("chunk not a multiple", info([None], cs=10), "not a multiple of the block size"),
    ("lora too long", info([None], lora="x" * 300), "blocks.lora"),
    ("lora not a string", info([None], lora=7), "blocks.lora"),
    ("items of another count", info([None, None]), "expected a list of 1 entries"),
    ("items not a list", info({"a": 1}), "blocks.items"),
    ("item not a triple", info([[b"x"]]), "expected [prev, tokens, start]"),
    ("short prev", "PREV15", "prev: expected 16 bytes"),
    ("tokens not uint32", "TOK7", "expected uint32 little-endian bytes"),
    ("more tokens than the value", "TOK12", "12 tokens, the value holds 8"),
    ("negative start", "START-4", ".start"),
    ("start past 2**40", "START_HUGE", ".start"),
    ("start off the blocks", "START3", "not a multiple of the block size 4"),
    ("tokens not bytes", "TOKLIST", "expected uint32 little-endian bytes"),
]


@pytest.mark.parametrize("what,blocks,why", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_block_info_is_refused_by_name(daemon, what, blocks, why):
    d, sec, _ = daemon
    key, hdr, payload, tb = chunk(list(range(8)))
    item: list[Any] = [NS0, tb, 0]
    if isinstance(blocks, str):
        if blocks == "PREV15":
            item[0] = b"\x11" * 15
        elif blocks == "TOK7":
            item[1] = tb[:7]
        elif blocks == "TOK12":
            item[1] = tb + tb[:16]
        elif blocks.startswith("START"):
            item[2] = {"START-4": -4, "START_HUGE": 1 << 41, "START3": 3}[blocks]
        elif blocks == "TOKLIST":
            item[1] = list(range(8))
        blocks = info([item])
    c = authed(d, sec["alpha"])
    status, meta, _ = c.call(put("alpha", [(hdr, payload)], blocks))
    assert status == P.BAD_REQUEST and why in meta["error"], (what, meta)
    assert "Traceback" not in meta["error"]
    status, _, _ = c.call(W.frame(P.PING, {}))  # still served on the same connection
    assert status == P.OK
    c.close()


def test_huge_block_info_is_bounded(daemon):
    d, sec, _ = daemon
    key, hdr, payload, tb = chunk(list(range(8)))
    c = authed(d, sec["alpha"])
    # a list longer than max_batch, and a token string past the bin bound: undecodable
    for blocks in (info([None] * 5000), info([[NS0, b"\0" * (1 << 17), 0]])):
        status, meta, _ = c.call(put("alpha", [(hdr, payload)], blocks))
        assert status == P.BAD_REQUEST and "undecodable metadata" in meta["error"], meta
    c.close()
    # metadata past max_meta (1 MiB): refused from the header, before it is read
    c = authed(d, sec["alpha"])
    big = msgpack.packb({"ns": "alpha", "items": [hdr],
                         "blocks": info([[NS0, b"\0" * 60000, 0]] * 20)})
    assert len(big) > 1 << 20
    status, meta, _ = c.call(P.pack_header(P.PUT, 1, len(big), len(payload)) + big + payload)
    assert status == P.TOO_LARGE, meta
    assert c.at_eof()
    assert d.alive() and d.rss() < 1 << 30


def test_a_tenant_never_publishes_for_another_namespace(daemon):
    d, sec, sub = daemon
    drain(sub, 0.5)
    toks = [list(range(200, 208)), list(range(300, 308))]
    a = authed(d, sec["alpha"])
    b = authed(d, sec["beta"])
    # beta cannot write into alpha's namespace at all
    k1, h1, p1, t1 = chunk(toks[0], ns="alpha")
    status, meta, _ = b.call(put("alpha", [(h1, p1)], info([[NS0, t1, 0]])))
    assert status == P.FORBIDDEN, meta
    # both store the same two-chunk prefix in their own namespaces
    for c, ns in ((a, "alpha"), (b, "beta")):
        k1, h1, p1, t1 = chunk(toks[0], ns=ns)
        k2, h2, p2, t2 = chunk(toks[1], prev=k1, ns=ns)
        status, meta, _ = c.call(put(ns, [(h1, p1), (h2, p2)],
                                     info([[NS0, t1, 0], [k1, t2, CS]])))
        assert status == P.OK and meta["results"] == bytes(2), meta
    evs = []
    end = time.monotonic() + 10
    while time.monotonic() < end and len([e for e in evs if isinstance(e, wire.Stored)]) < 4:
        evs += drain(sub, 0.5)
    st = [e for e in evs if isinstance(e, wire.Stored)]
    assert sorted(e.cache_salt for e in st) == ["alpha", "alpha", "beta", "beta"]
    by = {ns: {h for e in st if e.cache_salt == ns for h in e.hashes} for ns in ("alpha", "beta")}
    assert by["alpha"] and by["beta"] and not by["alpha"] & by["beta"]  # equal tokens, own hashes
    index = PrefixIndex()
    index.apply(evs)
    prompt = toks[0] + toks[1]
    for ns in ("alpha", "beta"):
        assert index.match(PromptKeys(prompt, None, ns).at(BS)).storage == 4
    # beta deletes its copy: only beta's blocks are removed, alpha's still route
    status, meta, _ = b.call(W.frame(P.DELETE, {"ns": "beta", "keys": [k1]}))
    assert status == P.OK, meta
    evs = []
    end = time.monotonic() + 10
    while time.monotonic() < end and not any(isinstance(e, wire.Removed) for e in evs):
        evs += drain(sub, 0.5)
    removed = {h for e in evs if isinstance(e, wire.Removed) for h in e.hashes}
    assert removed and removed <= by["beta"], (removed, by)
    index.apply(evs)
    assert index.match(PromptKeys(prompt, None, "alpha").at(BS)).storage == 4
    assert index.match(PromptKeys(prompt, None, "beta").at(BS)).storage == 0
    a.close()
    b.close()


def test_a_client_of_another_block_size_is_stored_and_counted(daemon):
    d, sec, sub = daemon
    drain(sub, 0.5)
    key, hdr, payload, tb = chunk(list(range(400, 408)))
    c = authed(d, sec["alpha"])
    status, meta, _ = c.call(put("alpha", [(hdr, payload)], info([[NS0, tb, 0]], bs=8, cs=8)))
    assert status == P.OK and meta["results"] == bytes(1), meta
    assert not [e for e in drain(sub) if isinstance(e, wire.Stored)]
    c.close()
    assert d.stats(sec["ops"])["kv_events"]["kv_events.other_block_size"] >= 1
