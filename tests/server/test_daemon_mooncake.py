"""The daemon with a Mooncake Store as its lower tier, against a real ``mooncake_master``.

Engine A stores a prompt through ``lmc server``; the daemon's small memory is then pushed
full of other chunks, so the prompt is served (if at all) from Mooncake; engine B, another
process with an empty L1, retrieves it bit-exact through the daemon. Killing the master then
makes the daemon's lower tier a miss within its ``remote_timeout``: no hang, no crash.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from lmc.storage.tier import create_backend
from tests.deadlines import SLACK_S
from tests.kvutil import random_bits
from tests.server.daemon_proc import client_pool
from tests.server.test_engines import _engine, _keys, _wait
from tests.storage.backends.mooncake.mooncake_cluster import MooncakeMaster, Peer, require_mooncake

pytestmark = pytest.mark.integration
TIMEOUT = 1.0  # the daemon's remote_timeout for its Mooncake tier
SLACK = SLACK_S  # scheduling on a loaded machine (tests/deadlines.py)


@pytest.fixture
def master(tmp_path):
    require_mooncake()
    m = MooncakeMaster(tmp_path / "mc", client_ttl=3).start()
    yield m
    m.stop()


def _mooncake_stats(d) -> dict:
    """The daemon's counters of its Mooncake tier (``mooncake.*`` under ``tiers``)."""
    return {k.split(".", 1)[1]: v for k, v in d.stats()["tiers"].items()
            if k.startswith("mooncake.")}


def _fill(pool, n: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    objs = []
    for _ in range(n):
        o = pool.allocate((4, 2, 64, 1024), torch.bfloat16, 64)  # 1 MiB each
        o.tensor.copy_(random_bits((4, 2, 64, 1024), torch.bfloat16, gen))
        objs.append(o)
    return objs


def _evict(d, tier, objs, rounds: range) -> None:
    """Push ``len(rounds)`` batches of other chunks through the daemon's memory."""
    before = d.stats()["tiers"]["cpu.evictions"]
    for r in rounds:
        assert tier.put(_keys(r, len(objs)), objs) == len(objs)
    assert d.stats()["tiers"]["cpu.evictions"] > before, "the daemon's memory kept everything"


def test_engines_share_kv_through_a_daemon_over_mooncake(start_daemon, master, tmp_path):
    holder = Peer("holder", master, segment=64 << 20)  # a second node contributing memory
    try:
        conf = tmp_path / "server.yaml"
        conf.write_text(json.dumps({"cache": {
            "tiers": ["memory", {"backend": master.url, "segment": "64MiB"}],
            "remote_timeout": TIMEOUT}}))
        d = start_daemon("--config", str(conf), "--size", "16MiB")
        assert _mooncake_stats(d).get("connected"), d.log()[-2000:]

        n = 100  # six full chunks of 16 tokens and a partial one
        a = _engine("store", d.url, seed=21, n=n)
        assert a["stored"] == n and a["flushed"] and a["remote_stored"] == 7, a

        cfg, pool = client_pool("64MiB")
        other = create_backend(d.url, cfg.replace(remote_timeout=5.0), pool)
        filler = _fill(pool, 4, seed=3)
        _evict(d, other, filler, range(2, 10))  # 32 MiB through a 16 MiB daemon
        _wait(lambda: d.stats()["tiers"].get("mooncake.queue_chunks", 1) == 0, 20,
              "the write-behind to Mooncake")
        hits0 = _mooncake_stats(d).get("get_hit", 0)

        b = _engine("load", d.url, seed=21, n=n)
        assert b["lookup"] == n and b["retrieved"] == n and b["bit_exact"], b
        assert _mooncake_stats(d).get("get_hit", 0) >= hits0 + 7, (
            "engine B's chunks were not read from Mooncake", _mooncake_stats(d))

        # empty memory again, then kill the master: the daemon misses within its deadline
        _evict(d, other, filler, range(10, 18))
        _wait(lambda: d.stats()["tiers"].get("mooncake.queue_chunks", 1) == 0, 20,
              "the write-behind to Mooncake")
        master.kill()
        t0 = time.monotonic()
        got = other.get(_keys(2, 4))  # evicted to Mooncake in the first round
        took = time.monotonic() - t0
        assert got == [None] * 4, "a chunk was served with the master dead"
        assert took < 2 * TIMEOUT + SLACK, f"a miss took {took:.2f} s"
        c = _engine("load", d.url, seed=21, n=n)
        assert c["lookup"] == 0 and c["retrieved"] == 0, c
        assert d.alive(), "the daemon died with the master"
        for o in filler:
            o.release()
        other.close()
        # a clean stop: exit waits for calls still inside the library (about 4 s each on a
        # dead master, then its unmount), bounded by the library, never cut short
        assert d.terminate(timeout=60) == 0, d.log()[-2000:]
    finally:
        holder.kill()  # its close() would wait on the dead master
