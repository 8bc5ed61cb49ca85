"""The daemon's KV events read by real consumers: vLLM 0.32's own typed decoder (its venv, a
subprocess) decodes every batch a real ``lmc server`` published for a real engine's
``lmc://`` PUTs, and NVIDIA Dynamo 1.6.1's standalone KV indexer, subscribed to the daemon,
reports the prefix the daemon holds per tier (memory = cpu, disk) for stored, evicted,
deleted and cleared (restart) chunks, in the tenant's namespace (``cache_salt``) only."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import msgpack
import pytest

from lmc.events import wire
from tests.events.helpers import request, vllm_python
from tests.events.test_dynamo_indexer import MODEL, WORKER, Indexer, dynamo_python
from tests.events.test_vllm_decoder import DECODE, ours
from tests.kvutil import random_tokens
from tests.server.daemon_proc import DaemonProc, free_port
from tests.server.test_daemon_events import BLOCK, CHUNK, EVENTS, engine, store

pytestmark = pytest.mark.integration


def daemon(tmp: Path, endpoint: str | None = None, replay: str | None = None) -> DaemonProc:
    ev = dict(EVENTS)
    if endpoint:
        ev.update(endpoint=endpoint, replay_endpoint=replay)
    return DaemonProc(tmp, ["--size", "2MiB", "--disk", str(tmp / "disk"), "--disk-size",
                            "64MiB", "--kv-events", json.dumps(ev)]).start()


def replayed(rep: str) -> list[bytes]:
    return [f[3] for f in request(rep, [b"", wire.seq_bytes(0)])[:-1]]


def test_vllm_decodes_every_batch_the_daemon_publishes(tmp_path):
    py = vllm_python()
    d = daemon(tmp_path / "d")
    try:
        rep = d.info["kv_events"]["replay_endpoint"]
        with engine(d.url, pool="8MiB") as (eng, caches):
            a = random_tokens(3 * CHUNK + 20, seed=31)
            store(eng, caches, a)
            for i in range(50):  # evicts a from the daemon's 2 MiB memory
                store(eng, caches, random_tokens(2 * CHUNK, seed=400 + i))
            eng.storage.tiers[-1].delete(eng.db.keys(a)[:1])
            deadline = time.monotonic() + 30
            while True:
                payloads = replayed(rep)
                kinds = {(type(e).__name__, getattr(e, "medium", None))
                         for p in payloads for e in wire.decode_batch(p)[1]}
                if {("Removed", wire.CPU), ("Removed", wire.STORAGE)} <= kinds \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        payloads += [f[3] for f in request(rep, [b"", b"dump"])[:-1]]
    finally:
        d.kill()
    assert {("Stored", wire.CPU), ("Stored", wire.STORAGE), ("Removed", wire.CPU),
            ("Removed", wire.STORAGE), ("Cleared", None)} <= kinds, kinds
    path = tmp_path / "batches.msgpack"
    path.write_bytes(msgpack.packb(payloads))
    run = subprocess.run([py, "-c", DECODE, str(path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    decoded = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(decoded) == len(payloads)
    for payload, theirs in zip(payloads, decoded):
        mine = [ours(e) for e in wire.decode_batch(payload)[1]]
        assert [{k: e.get(k) for k in m} for m, e in zip(mine, theirs["events"])] == mine
        # vLLM's structs have no cache_salt (lmc's top-level key for Dynamo): its encoder
        # writes the batch back without it, byte for byte otherwise
        if '"cache_salt"' not in json.dumps([list(wire.decode_batch(payload)[1])],
                                            default=lambda o: o.__dict__):
            assert theirs["same_bytes"]


def test_dynamo_indexer_sees_the_daemons_prefix(tmp_path):
    py = dynamo_python()
    port, rport = free_port(), free_port()
    ep, rep = f"tcp://*:{port}", f"tcp://*:{rport}"
    d = daemon(tmp_path / "d", ep, rep)
    idx = None
    try:
        with engine(d.url, pool="8MiB") as (eng, caches):
            a = random_tokens(4 * CHUNK, seed=41)
            n = len(a)
            store(eng, caches, a)  # before the indexer: it replays from seq 0
            idx = Indexer(py, tmp_path / "indexer.log")
            st, body = idx.http("POST", "/register", {
                "instance_id": WORKER, "endpoint": f"tcp://127.0.0.1:{port}",
                "model_name": MODEL, "block_size": BLOCK,
                "replay_endpoint": f"tcp://127.0.0.1:{rport}"})
            assert st == 201, body

            def tiers(prompt: list[int], salt: str) -> tuple[int, int, int]:
                _, r = idx.http("POST", "/query", {"token_ids": prompt, "model_name": MODEL,
                                                   "cache_salt": salt})
                assert isinstance(r, dict), r
                inst = r["instances"].get(str(WORKER), {})
                return inst.get("gpu", 0), inst.get("cpu", 0), inst.get("disk", 0)

            def expect(want: tuple[int, int, int], what: str, salt: str = "lmc") -> None:
                end = time.monotonic() + 10
                got = tiers(a, salt)
                while got != want and time.monotonic() < end:
                    time.sleep(0.1)
                    got = tiers(a, salt)
                assert got == want, f"{what}: Dynamo says {got}, the daemon holds {want}"

            expect((0, n, n), "stored in the daemon's memory and disk")
            expect((0, 0, 0), "another tenant's namespace", salt="other")
            for i in range(50):
                store(eng, caches, random_tokens(2 * CHUNK, seed=500 + i))
            expect((0, 0, n), "evicted from the daemon's memory, on its disk")
            eng.storage.tiers[-1].delete([eng.db.keys(a)[2]])
            expect((0, 0, 2 * CHUNK), "a middle chunk deleted from the daemon")
            # a restart: AllBlocksCleared first (seq 0 again); what the disk kept has no
            # tokens to publish. Dynamo 1.6.1 drops a restarted publisher's batches as old
            # (seq below the one it expects, not logged), so the daemon is registered again
            d.terminate()
            d.start()
            reg = {"instance_id": WORKER, "model_name": MODEL}
            assert idx.http("POST", "/unregister", reg)[0] == 200
            st, body = idx.http("POST", "/register", {
                **reg, "endpoint": f"tcp://127.0.0.1:{port}", "block_size": BLOCK,
                "replay_endpoint": f"tcp://127.0.0.1:{rport}"})
            assert st == 201, body
            expect((0, 0, 0), "the daemon restarted")
            eng.storage.delete(eng.db.keys(a))  # every tier: the engine's memory too
            store(eng, caches, a)
            expect((0, n, n), "stored again after the restart")
    finally:
        if idx is not None:
            idx.stop()
        d.kill()
