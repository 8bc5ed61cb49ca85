"""Engines sharing KV through one daemon, and a daemon killed with SIGKILL mid-transfer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from lmc.storage.tier import create_backend
from tests.kvutil import assert_bits_equal, random_bits
from tests.server.daemon_proc import ROOT, client_pool

pytestmark = pytest.mark.integration


def _engine(mode: str, url: str, seed: int, n: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.server.engine_proc", mode, url,
                          str(seed), str(n)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_engine_processes_share_kv(start_daemon):
    """Engine A (over TCP) stores a prompt; engine B, another process with an empty L1 (over
    the Unix socket), finds all of it by lookup and retrieves it bit-exact."""
    d = start_daemon("--size", "64MiB", unix=True)
    n = 100  # six full chunks of 16 tokens and a partial one
    a = _engine("store", d.url, seed=11, n=n)
    assert a == {"stored": n, "flushed": True, "remote_stored": 7}
    b = _engine("load", d.unix_url, seed=11, n=n)
    assert b["lookup"] == n and b["retrieved"] == n and b["bit_exact"], b
    assert b["remote_hits"] == 7


def _objs(pool, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        o = pool.allocate((4, 2, 64, 1024), torch.bfloat16, 64)  # 1 MiB
        o.tensor.copy_(random_bits((4, 2, 64, 1024), torch.bfloat16, gen))
        out.append(o)
    return out


def _keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_kill_9_mid_transfer_misses_then_recovers_with_disk_data(start_daemon, tmp_path):
    disk = tmp_path / "disk"
    d = start_daemon("--size", "64MiB", "--disk", str(disk))
    cfg, pool = client_pool("128MiB")
    cfg = cfg.replace(remote_timeout=1.0)
    tier = create_backend(d.url, cfg, pool)
    before = _objs(pool, 8, seed=1)
    assert tier.put(_keys(1, 8), before) == 8
    _wait(lambda: d.stats()["tiers"].get("disk.chunks", 0) >= 8, 20, "the disk write-behind")

    # a second client keeps 8 MiB batches in flight while the daemon is killed
    busy = create_backend(d.url, cfg, pool)
    traffic = _objs(pool, 8, seed=2)
    stop, errors, rounds = threading.Event(), [], [0]

    def churn() -> None:
        r = 0
        while not stop.is_set():
            try:
                keys = _keys(100 + r % 50, 8)
                busy.put(keys, traffic)
                got = busy.get(keys)
                for g, o in zip(got, traffic):  # whatever comes back is whole and exact
                    if g is not None:
                        if not torch.equal(g.tensor.view(torch.int16), o.tensor.view(torch.int16)):
                            errors.append("a torn or wrong value was served")
                        g.release()
            except Exception as e:  # the tier must never raise
                errors.append(f"{type(e).__name__}: {e}")
            r += 1
            rounds[0] = r

    t = threading.Thread(target=churn)
    t.start()
    _wait(lambda: rounds[0] >= 3, 20, "traffic")
    d.kill()  # SIGKILL: no drain, no flush
    t0 = time.monotonic()
    assert tier.get(_keys(1, 8)) == [None] * 8  # misses, quickly, no exception
    assert tier.contains(_keys(1, 8)) == [False] * 8
    assert time.monotonic() - t0 < 2 * cfg.remote_timeout
    assert tier.stats()["breaker"] in ("open", "half_open")

    d.start()  # same port, same disk directory
    def served() -> bool:
        got = tier.get(_keys(1, 8))
        ok = all(g is not None for g in got)
        for g in got:
            if g is not None:
                g.release()
        return ok

    _wait(served, 15, "the tier to recover by itself")
    got = tier.get(_keys(1, 8))
    for g, o in zip(got, before):
        assert_bits_equal(g.tensor, o.tensor, "served from disk after kill -9")
        g.release()
    _wait(lambda: busy.put(_keys(99, 2), traffic[:2]) == 2, 15, "the busy client to recover")
    stop.set()
    t.join(30)
    assert not errors, errors[:3]
    assert tier.stats()["breaker"] == "closed"
    for o in before + traffic:
        o.release()
    tier.close()
    busy.close()
