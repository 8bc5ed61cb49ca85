"""A stateful fuzz run against a live daemon (see ``stateful_fuzz``): several driver threads,
each multiplexing a dozen connections through authentication, half frames, silence,
pipelining, forbidden namespaces, quotas, junk namespaces and a disk tier behind memory
(promotions, lower-tier reads on the daemon's I/O threads). Afterwards the daemon must be
back where it started: no connection, fd, pool object or pinned value left behind, RSS flat,
and every GET hit along the way returned exactly the bytes PUT for that namespace and key.

The seed is random per run and printed (``LMC_FUZZ_SEED=<n>`` replays one driver sequence);
``LMC_FUZZ_SECONDS`` sets the length (default 12 s of driving, the whole test < 60 s).
Threat model: docs/threats/daemon.md."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import yaml

from lmc.storage.backends.server import protocol as P
from tests.server import stateful_fuzz as F
from tests.server import wire as W
from tests.server.daemon_proc import DaemonProc

pytestmark = pytest.mark.integration
FRAME_TIMEOUT = 2.0
HELLO_TIMEOUT = 1.5
DRIVERS = 2
ACTORS = 12


def _until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_stateful_fuzz_returns_to_baseline(tmp_path):
    seed = int(os.environ.get("LMC_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
    seconds = float(os.environ.get("LMC_FUZZ_SECONDS", "12"))
    print(f"stateful fuzz seed {seed} (replay: LMC_FUZZ_SEED={seed})")
    secrets = {n: f"{n}-{random.Random(seed).randbytes(8).hex()}" for n in ("a", "b", "ops")}
    for n, sec in secrets.items():
        (tmp_path / f"{n}.token").write_text(sec)
    cfg = tmp_path / "fuzz.yaml"
    cfg.write_text(yaml.safe_dump({
        "size": "8MiB", "disk": str(tmp_path / "disk"), "disk_size": "64MiB",
        "quota_default": "256KiB", "quotas": {"a1": "1MiB"},
        "max_namespaces": 4, "max_connections": 64, "max_payload": "1MiB", "max_batch": 16,
        "frame_timeout": FRAME_TIMEOUT, "hello_timeout": HELLO_TIMEOUT,
        "tokens": [{"token_file": str(tmp_path / "a.token"), "namespaces": ["a1", "a2"]},
                   {"token_file": str(tmp_path / "b.token"), "namespaces": ["b1"]},
                   {"token_file": str(tmp_path / "ops.token"), "admin": True,
                    "name": "ops"}]}))
    d = DaemonProc(tmp_path / "d", ["--config", str(cfg), "--log-level", "WARNING"]).start()
    try:
        _run(d, secrets, seed, seconds)
    except BaseException:
        print(d.log()[-4000:])
        raise
    finally:
        d.kill()


def _run(d: DaemonProc, secrets: dict[str, str], seed: int, seconds: float) -> None:
    junk = [f"j{i}" for i in range(8)]
    all_ns = ["a1", "a2", "b1", *junk]
    tenants = [F.Tenant("a", secrets["a"], ("a1", "a2")), F.Tenant("b", secrets["b"], ("b1",)),
               F.Tenant("ops", secrets["ops"], tuple(all_ns), admin=True),
               F.Tenant("intruder", None, ())]
    ops = secrets["ops"]

    def warm() -> None:  # every path once, so lazily made state is in the baseline
        drv = F.Driver(seed ^ 0x5A5A, d.port, tenants, all_ns, 6, FRAME_TIMEOUT, HELLO_TIMEOUT)
        drv.run(1.5)

    warm()
    assert _until(lambda: d.stats(token=ops)["server"]["connections"] == 1, 10)
    fds0, rss0 = W.fd_count(d.pid), d.rss()

    drivers = [F.Driver(seed + i, d.port, tenants, all_ns, ACTORS, FRAME_TIMEOUT, HELLO_TIMEOUT)
               for i in range(DRIVERS)]
    errors: list[BaseException] = []

    def drive(drv: F.Driver) -> None:
        try:
            drv.run(seconds)
        except BaseException as e:  # reported below with the seed
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(drv,)) for drv in drivers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    if errors:
        raise errors[0]
    total = F.Counts()
    for drv in drivers:
        c = drv.counts
        total.steps += c.steps
        total.hits += c.hits
        total.stored += c.stored
        total.refused += c.refused
        total.silent_dropped += c.silent_dropped
        for k, v in c.by_action.items():
            total.by_action[k] = total.by_action.get(k, 0) + v
    print(f"seed {seed}: {total.steps} steps, {total.stored} values stored, {total.hits} "
          f"verified hits, {total.refused} forbidden, {total.silent_dropped} silent dropped; "
          f"{dict(sorted(total.by_action.items()))}")
    assert total.steps > 200 and total.hits > 20 and total.refused > 0, "the run did too little"
    assert d.alive()

    # back to baseline: connections, fds, pins, memory
    assert _until(lambda: d.stats(token=ops)["server"]["connections"] == 1, 3 * FRAME_TIMEOUT), \
        f"seed {seed}: connections left: {d.stats(token=ops)['server']}"
    assert _until(lambda: not d.stats(token=ops)["tiers"].get("disk.queue_chunks"), 30), \
        "write-behind to the disk tier never drained"
    st = d.stats(token=ops)
    assert st["server"]["unauthenticated"] == 0
    assert st["pool"]["objects"] == st["tiers"]["cpu.chunks"], \
        f"seed {seed}: pool objects not held by the memory tier (pins or leaks): {st['pool']}"
    assert st["pool"]["leaks"] == 0
    for ns, held in st["namespaces"].items():  # no reply left charged, no quota overrun
        assert not held.get("unsent_bytes"), f"seed {seed}: {ns!r} still charged {held}"
        assert not held.get("quota") or held.get("bytes", 0) <= held["quota"], (ns, held)
    assert st["tiers"]["namespaces.tracked"] <= 4 + 3, st["tiers"]  # cap + configured ones
    assert _until(lambda: W.fd_count(d.pid) <= fds0, 5), \
        f"seed {seed}: fds {W.fd_count(d.pid)} > baseline {fds0}"
    c = W.RawClient(d.port)
    assert c.call(W.hello(ops))[0] == P.OK
    keys = [F.key_of(i) for i in range(F.KEYSPACE)]
    for ns in all_ns:
        assert c.call(W.frame(P.DELETE, {"ns": ns, "keys": keys[:16]}))[0] == P.OK
        assert c.call(W.frame(P.DELETE, {"ns": ns, "keys": keys[16:32]}))[0] == P.OK
        assert c.call(W.frame(P.DELETE, {"ns": ns, "keys": keys[32:]}))[0] == P.OK
    c.close()
    st = d.stats(token=ops)
    assert st["pool"]["used"] == 0 and st["pool"]["objects"] == 0, \
        f"seed {seed}: memory left after deleting every key: {st['pool']}"
    growth = d.rss() - rss0
    assert growth < 32 << 20, f"seed {seed}: daemon RSS grew {growth >> 20} MiB"
