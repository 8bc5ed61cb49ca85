"""KV events never describe a tagged request's chunks (a LoRA adapter, a ``cache_salt``): the
published block hashes chain from the engine's namespace, so a chunk keyed from a request's
own root would be announced as the base model's blocks (a router would send base-model
prompts to it), and vLLM's form would carry the salt itself. Such chunks are stored and
served but not published; plain chunks are published as before. The daemon's block info
(an ``lmc://`` tier's PUTs) leaves them out the same way."""

from __future__ import annotations

import torch

from lmc.events import wire
from lmc.events.notes import ChunkNotes
from lmc.token_database import ChunkedTokenDatabase, request_root, request_tag
from tests.events.helpers import CHUNK, Collector, engine_with_events
from tests.kvutil import random_tokens


def stored_tokens(events: list[wire.Event]) -> list[tuple[int, ...]]:
    return [tuple(e.token_ids) for e in events if isinstance(e, wire.Stored)]


def test_tagged_chunks_are_stored_but_never_published(tmp_path):
    plain = random_tokens(2 * CHUNK, seed=1)
    salted = random_tokens(2 * CHUNK, seed=2)
    lora = random_tokens(2 * CHUNK, seed=3)
    with engine_with_events(None) as (eng, ev, caches):
        sub = Collector(ev.endpoint)
        for toks, tag in ((salted, request_tag(None, "tenant-a")),
                          (lora, request_tag("x", None)), (plain, None)):
            # as the connector's worker keys a request: its kept keys, from its root
            keys = eng.db.request_keys(request_root(eng.db.namespace, tag)).keys(toks)
            n = eng.store(toks, caches, torch.arange(len(toks)), keys=keys)
            assert n == len(toks)
            assert eng.lookup(toks, keys=keys) == len(toks)  # stored and served
        eng.flush()
        events = sub.settle(ev.publisher)
        flat = [t for e in stored_tokens(events) for t in e]
        assert flat == plain, "the plain prompt's blocks, and only those"
        assert ev.stats()["kv_events.unknown"] >= 4  # the tagged chunks: never noted
        sub.close()


def test_the_daemon_block_info_leaves_tagged_chunks_out():
    base = ChunkedTokenDatabase(16, True, b"n" * 16)
    notes = ChunkNotes(base.namespace, 16, 4)
    notes.activate()
    base.add_observer(notes)
    db = base
    toks = list(range(100, 148))
    root = request_root(base.namespace, request_tag(None, "s"))
    rooted = db.keys(toks, root=root)
    db.process_tokens(toks, keys=base.request_keys(root).keys(toks))
    assert len(notes) == 0 and notes.items(rooted) == [None] * 3
    plain = db.keys(toks)
    assert len(notes) == 3 and all(notes.items(plain))
