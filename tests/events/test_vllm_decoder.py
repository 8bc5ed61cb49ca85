"""Every batch a real engine publishes (stores, evictions, promotions, deletes, a clear)
decodes with vLLM 0.32's own typed decoder (``msgspec`` ``Decoder(type=KVEventBatch)``, in
the vLLM venv, a subprocess) to the same events lmc's reader sees, and vLLM's encoder writes
those events back byte for byte."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import msgpack
import pytest
import torch

from lmc.events import wire
from tests.events.helpers import CHUNK, engine_with_events, request, store, vllm_python
from tests.kvutil import random_tokens

pytestmark = pytest.mark.integration

DECODE = r'''
import json, sys
import msgpack, msgspec
from vllm.distributed.kv_events import KVEventBatch
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
enc = msgspec.msgpack.Encoder()
out = []
for payload in msgpack.unpackb(open(sys.argv[1], "rb").read()):
    batch = dec.decode(payload)
    evs = [{"type": type(e).__name__, **msgspec.to_builtins(e)} for e in batch.events]
    out.append({"rank": batch.data_parallel_rank, "events": evs,
                "same_bytes": enc.encode(batch) == payload})
print(json.dumps(out))
'''


def ours(ev: wire.Event) -> dict:
    if isinstance(ev, wire.Stored):
        return {"type": "BlockStored", "block_hashes": list(ev.hashes),
                "parent_block_hash": ev.parent, "token_ids": list(ev.token_ids),
                "block_size": ev.block_size, "medium": ev.medium, "lora_name": ev.lora_name}
    if isinstance(ev, wire.Removed):
        return {"type": "BlockRemoved", "block_hashes": list(ev.hashes), "medium": ev.medium}
    return {"type": "AllBlocksCleared"}


def test_vllm_decodes_every_published_batch(tmp_path: Path):
    py = vllm_python()
    a = random_tokens(4 * CHUNK + 20, seed=21)
    b = random_tokens(12 * CHUNK, seed=22)
    with engine_with_events(tmp_path / "disk", pool="256KiB") as (eng, ev, caches):
        store(eng, caches, a)
        store(eng, caches, b)
        eng.retrieve(a, caches, torch.arange(len(a)))
        eng.storage.delete(eng.db.keys(a)[:1])
        eng.storage.clear_l1()
        eng.flush()
        # the publisher's thread turns the last items into batches after flush() returns:
        # ask the replay socket again until the removal and the clear have been published
        deadline = time.monotonic() + 30
        while True:
            frames = request(ev.replay_endpoint, [b"", wire.seq_bytes(0)])
            seen = {type(e).__name__ for f in frames[:-1] for e in wire.decode_batch(f[3])[1]}
            if {"Removed", "Cleared"} <= seen or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        dump = request(ev.replay_endpoint, [b"", b"dump"])
    payloads = [f[3] for f in frames[:-1]] + [f[3] for f in dump[:-1]]
    kinds = {type(e).__name__ for p in payloads for e in wire.decode_batch(p)[1]}
    assert kinds == {"Stored", "Removed", "Cleared"}, kinds
    path = tmp_path / "batches.msgpack"
    path.write_bytes(msgpack.packb(payloads))
    run = subprocess.run([py, "-c", DECODE, str(path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    decoded = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(decoded) == len(payloads)
    for payload, theirs in zip(payloads, decoded):
        mine = [ours(e) for e in wire.decode_batch(payload)[1]]
        got = [{k: e.get(k) for k in m} for m, e in zip(mine, theirs["events"])]
        assert got == mine
        assert theirs["rank"] == 0
        assert theirs["same_bytes"], "vLLM's encoder writes these events differently"
