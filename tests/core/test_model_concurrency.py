"""The model workload concurrently: 16 threads against one engine with a small pool, and two
processes sharing a disk directory or a daemon. Every hit is checked bit for bit by whoever
gets it (the KV is a function of the token prefix), and every retrieve must leave the rest of
that caller's cache untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid

import pytest

from tests.core.model_kv import GEOMETRIES, PagedCache, make_engine, prompt, slots_for
from tests.core.model_proc import run_workload
from tests.server.conftest import shared_daemon  # noqa: F401 - a real daemon, reused
from tests.server.daemon_proc import ROOT

THREADS = 16


@pytest.mark.parametrize("geom", sorted(GEOMETRIES))
def test_sixteen_threads_one_engine(geom):
    caches = [PagedCache(GEOMETRIES[geom], seed=t) for t in range(THREADS)]
    eng = make_engine(caches[0], 24 * 4096, {}, uuid.uuid4().hex[:8])
    errors: list[BaseException] = []
    totals: list[dict] = []
    start = threading.Barrier(THREADS)

    def work(t: int) -> None:
        try:
            start.wait()
            totals.append(run_workload(eng, caches[t], 1000 + t, 100, owner=t))
        except BaseException as e:  # reported below, with the thread's seed in the message
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    pool = eng.pool
    try:
        assert not errors, f"{len(errors)} thread(s) failed; first: {errors[0]!r}"
        assert len(totals) == THREADS
        assert sum(t["retrieved_tokens"] for t in totals) > 0, "no thread ever hit"
        assert eng.stats()["pinned_chunks"] == 0, "pins left after every owner retrieved"
    finally:
        eng.close()
    assert pool.used_bytes == 0, f"{pool.used_bytes} B still referenced after close"


def _procs(cfg: dict, seeds: list[int], ops: int, together: bool = True) -> list[dict]:
    """Run one worker process per seed, all at once or one after another; their results."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # pool invariants on there too

    def spawn(seed: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tests.core.model_proc", json.dumps(cfg),
                                 str(seed), str(ops)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(p: subprocess.Popen) -> dict:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"worker failed:\n{stderr[-3000:]}"
        return json.loads(stdout.strip().splitlines()[-1])

    if together:
        return [result(p) for p in [spawn(s) for s in seeds]]
    return [result(spawn(s)) for s in seeds]


def _verify_all(cfg: dict) -> int:
    """A fresh engine on the shared tier: every base prompt's hit is bit-exact; returns the
    tokens it found (the workers' stores must be visible to a third process's engine)."""
    cfg = dict(cfg)
    cache = PagedCache(GEOMETRIES[cfg.pop("geom")], seed=99)
    cfg.pop("pool_bytes")
    tenant = cfg.pop("tenant")
    found = 0
    with make_engine(cache, 64 * 4096, cfg, tenant) as eng:
        for base in range(5):
            for n in (16, 40, 96):
                tokens = prompt(base, n)
                slots = slots_for(n, base * 7 + n, True)
                snap = cache.snapshot()
                got = eng.retrieve(tokens, cache.caches, slots)
                cache.check_retrieved(snap, tokens, slots, 0, got, f"verify base {base} n {n}")
                found += got
    return found


@pytest.mark.integration
def test_processes_take_turns_on_a_disk_directory(tmp_path):
    """One disk tier per directory at a time (a second live process is refused by the tier's
    lock, by design), so processes take turns: each one's hits include the previous one's
    chunks, read from files it did not write, and are checked bit for bit."""
    cfg = {"geom": "unit", "pool_bytes": 24 * 4096, "tenant": uuid.uuid4().hex[:8],
           "local_disk": str(tmp_path / "disk")}
    res = _procs(cfg, [1, 2, 3], 100, together=False)
    for r in res:
        assert r["flushed"] and r["pinned_left"] == 0, r
    assert res[2]["disk_hits"] > 0, "later processes never read what earlier ones wrote"
    assert _verify_all(cfg) > 0, "nothing the workers stored was found on the shared disk"


@pytest.mark.integration
def test_two_processes_share_a_daemon(shared_daemon):  # noqa: F811
    cfg = {"geom": "mixed", "pool_bytes": 32 * 4096, "tenant": uuid.uuid4().hex[:8],
           "remote_url": shared_daemon.url, "remote_timeout": 5.0}
    res = _procs(cfg, [3, 4], 120)
    for r in res:
        assert r["flushed"] and r["pinned_left"] == 0, r
    assert _verify_all(cfg) > 0, "nothing the workers stored was found in the daemon"
