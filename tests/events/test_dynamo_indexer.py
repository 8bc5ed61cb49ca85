"""NVIDIA Dynamo 1.6.1's standalone KV indexer (its own venv, a subprocess; no etcd, no NATS)
subscribes to a real engine's publisher and must report, per tier, the prefix lmc's tiers
really hold: stored (memory and disk), evicted from memory (disk only), promoted back,
truncated by a deleted middle chunk, cleared tier by tier, then nothing at all. It joins
after the first store, so it also proves the replay socket (it fills from seq 0)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.events.helpers import BLOCK, CHUNK, dynamo_python, engine_with_events, store
from tests.kvutil import random_tokens
from tests.router.helpers import free_port

pytestmark = pytest.mark.integration
WORKER = 3
MODEL = "tiny"


class Indexer:
    def __init__(self, py: str, log: Path) -> None:
        self.port = free_port()
        self.log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [py, "-c", "import sys, dynamo._core as c; c.run_kv_indexer(sys.argv[1:])",
             "--port", str(self.port), "--threads", "1", "--block-size", str(BLOCK)],
            stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while True:
            try:
                self.http("GET", "/health")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"indexer did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def http(self, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                text = r.read().decode()
                return r.status, json.loads(text) if text else None
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def tiers(self, prompt: list[int]) -> tuple[int, int, int]:
        _, r = self.http("POST", "/query", {"token_ids": prompt, "model_name": MODEL})
        assert isinstance(r, dict), r
        inst = r["instances"].get(str(WORKER), {})
        return inst.get("gpu", 0), inst.get("cpu", 0), inst.get("disk", 0)

    def expect(self, prompt: list[int], want: tuple[int, int, int], what: str) -> None:
        end = time.monotonic() + 10  # the indexer applies events asynchronously
        got = self.tiers(prompt)
        while got != want and time.monotonic() < end:
            time.sleep(0.1)
            got = self.tiers(prompt)
        assert got == want, f"{what}: Dynamo says (gpu, cpu, disk) = {got}, lmc holds {want}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def test_dynamo_indexer_sees_each_tier_prefix(tmp_path):
    py = dynamo_python()
    a = random_tokens(4 * CHUNK, seed=11)
    b = random_tokens(14 * CHUNK, seed=12)
    n = len(a)
    with engine_with_events(tmp_path / "disk", pool="256KiB") as (eng, ev, caches):
        store(eng, caches, a)  # before the indexer exists: it must replay from seq 0
        idx = Indexer(py, tmp_path / "indexer.log")
        try:
            st, body = idx.http("POST", "/register", {
                "instance_id": WORKER, "endpoint": ev.endpoint, "model_name": MODEL,
                "block_size": BLOCK, "replay_endpoint": ev.replay_endpoint})
            assert st == 201, body
            idx.expect(a, (0, n, n), "stored in memory and on disk")
            store(eng, caches, b)  # evicts a from the 256 KiB memory tier
            idx.expect(a, (0, 0, n), "evicted from memory, still on disk")
            assert eng.retrieve(a, caches, torch.arange(n)) == n
            idx.expect(a, (0, n, n), "promoted back into memory")
            eng.storage.delete([eng.db.keys(a)[2]])  # the third chunk, from every tier
            idx.expect(a, (0, 2 * CHUNK, 2 * CHUNK), "a middle chunk deleted")
            eng.storage.clear_l1()
            idx.expect(a, (0, 0, 2 * CHUNK), "memory tier cleared")
            eng.storage.delete(eng.db.keys(a) + eng.db.keys(b))
            eng.storage.clear_l1()
            idx.expect(a, (0, 0, 0), "everything gone")
            store(eng, caches, a)
            idx.expect(a, (0, n, n), "stored again after AllBlocksCleared")
        finally:
            idx.stop()
