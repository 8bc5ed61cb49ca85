"""The ``mooncake://`` tier when the cluster fails or lies: real ``mooncake_master`` and client
processes on loopback, killed and paused by PID.

What must hold (``docs/threats/mooncake.md``): a dead master, a hung master, a dead holder of
the segment, a value evicted or removed under a reader, a full cluster, a restarted master
(every key lost), a value another client wrote (short, of another key, of an absurd shape)
are each a miss or a refused store within ``remote_timeout`` -- counted, never an exception,
a hang, wrong bytes or a crash of the reader. Readers that could meet a library crash run in
a process of their own, so a segfault fails the test instead of killing pytest.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.settings import ConfigError
from lmc.storage.backends.mooncake.backend import STARTUP_TIMEOUT
from lmc.storage.serde import encode_header
from lmc.storage.tier import create_backend
from lmc.testing.harness import SHAPE, check_hit, fill, key_of
from tests.deadlines import SLACK_S

from .mooncake_cluster import ROOT, MooncakeMaster, Peer, quiet_env, require_mooncake

pytestmark = pytest.mark.integration
TIMEOUT = 1.0   # remote_timeout of every tier here
SLACK = SLACK_S  # scheduling on a loaded machine (tests/deadlines.py)
SECRET = "faults-suite-secret-0123456789ab"


@pytest.fixture
def master(tmp_path):
    """A master of the test's own (client_ttl 3 s: a dead holder's segment goes in ~3 s)."""
    require_mooncake()
    import lmc.storage.backends.mooncake  # noqa: F401  (registers mooncake://)
    m = MooncakeMaster(tmp_path / "mc", client_ttl=3).start()
    yield m
    m.stop()


@pytest.fixture
def peers():
    made: list[Peer] = []
    yield made
    for p in made:
        p.stop()


@pytest.fixture
def tiers():
    """``make(url, **options)`` -> an in-process tier over a pool of its own, closed (and
    checked to hold no pool memory) after the test."""
    made = []

    def make(url: str, pool_size: int = 16 << 20, config: dict | None = None, **options):
        cfg = {"remote_key_prefix": f"f{uuid.uuid4().hex[:10]}", "remote_timeout": TIMEOUT,
               **(config or {})}
        pool = MemoryPool(pool_size, pin_memory="false")
        t = create_backend(url, CacheConfig(**cfg), pool, **options)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()
        deadline = time.monotonic() + 10  # an abandoned call releases when the library returns
        while t.pool.used_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.pool.used_bytes == 0, "the tier kept pool memory"
        t.pool.close()


def _chunks(tier, names):
    keys = [key_of(n) for n in names]
    objs = tier.pool.allocate_many(SHAPE, torch.float16, len(keys), SHAPE[2])
    return keys, [fill(o, k) for o, k in zip(objs, keys)]


def _store(tier, names) -> int:
    keys, objs = _chunks(tier, names)
    try:
        return tier.put(keys, objs)
    finally:
        for o in objs:
            o.release()


def _get(tier, names):
    """(hits, seconds); every hit checked bit for bit and released."""
    keys = [key_of(n) for n in names]
    t0 = time.monotonic()
    got = tier.get(keys)
    took = time.monotonic() - t0
    try:
        for k, o in zip(keys, got):
            if o is not None:
                check_hit(o, k)
        return sum(o is not None for o in got), took
    finally:
        for o in got:
            if o is not None:
                o.release()


# --------------------------------------------------------------------------- processes
def test_another_process_reads_bit_exact_and_a_dead_holder_is_a_timely_miss(master, peers):
    """A (a tier contributing the segment) stores; B (a pure client, its own process) reads
    every chunk bit for bit. SIGKILL A: B's reads are misses within the deadline through the
    window where the master still lists A's values (reads fail with TRANSFER_FAIL) and after
    it drops them; B never hangs or dies."""
    names = [f"ab{i}" for i in range(16)]
    prefix = f"ab{uuid.uuid4().hex[:8]}"
    cfg = {"remote_key_prefix": prefix, "remote_timeout": TIMEOUT}
    a = Peer("tier", master, config=cfg, options={"segment": 64 << 20})
    peers.append(a)
    b = Peer("tier", master, config=cfg, options={"segment": 0})
    peers.append(b)
    assert a.ask(op="put", names=names)["stored"] == len(names)
    got = b.ask(op="get", names=names)
    assert got["hits"] == [True] * len(names) and got["exact"] == [True] * len(names)

    a.kill()
    killed = time.monotonic()
    stale = False
    while time.monotonic() - killed < master.client_ttl + 4:
        got = b.ask(op="get", names=names, timeout=TIMEOUT + 30)
        assert got["hits"] == [False] * len(names), "a dead holder's value was served"
        assert got["seconds"] <= TIMEOUT + SLACK, f"a read took {got['seconds']:.2f} s"
        present = b.ask(op="contains", names=names)["present"]
        stale |= any(present)
        assert b.alive()
        time.sleep(0.3)
    assert b.ask(op="contains", names=names)["present"] == [False] * len(names), \
        "the master still lists a dead holder's values after its client_ttl"
    assert stale, "the master never listed the dead holder's values: the window went untested"
    stats = b.ask(op="stats")["stats"]
    # the library spends about a second per key on a dead holder: reads end as counted
    # transfer failures or, past the deadline, as counted timeouts (the call goes on alone)
    failed = stats.get("get_transfer_failed", 0) + stats.get("timeouts", 0)
    assert failed >= 1, " ".join(f"{k}={v}" for k, v in stats.items())
    assert b.ask(op="put", names=["after"])["stored"] == 0, "stored with no segment left"
    assert b.alive()


def test_close_while_calls_are_inside_a_hung_master_does_not_crash(master):
    """Calls stuck inside the library (the master SIGSTOPped), close() from another thread,
    more calls after it, then interpreter exit: the process exits 0 (the library segfaults
    on a close racing a call; the guard must never let that happen)."""
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time, torch
        sys.path.insert(0, {str(ROOT)!r})
        from lmc.config import CacheConfig
        from lmc.memory.pool import MemoryPool
        from lmc.storage.backends.mooncake import MooncakeBackend
        from lmc.testing.harness import SHAPE, fill, key_of
        pool = MemoryPool(16 << 20, pin_memory="false")
        tier = MooncakeBackend({master.url!r}, config=CacheConfig(remote_timeout={TIMEOUT}),
                               pool=pool, segment=32 << 20)
        keys = [key_of(f"k{{i}}") for i in range(8)]
        objs = [fill(o, k) for o, k in zip(pool.allocate_many(SHAPE, torch.float16, 8, 16),
                                           keys)]
        assert tier.put(keys, objs) == 8
        os.kill({master.proc.pid}, signal.SIGSTOP)
        stop = time.monotonic() + 4
        def hammer():
            while time.monotonic() < stop:
                got = tier.get(keys)
                for o in got:
                    if o is not None:
                        o.release()
                tier.contains(keys)
                tier.put(keys, objs)
        threads = [threading.Thread(target=hammer) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        t0 = time.monotonic()
        tier.close()
        took = time.monotonic() - t0
        for t in threads:
            t.join()
        for o in objs:
            o.release()
        os.kill({master.proc.pid}, signal.SIGCONT)
        print("CLOSE", round(took, 3), "INFLIGHT", tier.guard.inflight(), flush=True)
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=quiet_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=90)
    finally:
        master.resume()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    took = float(proc.stdout.split("CLOSE")[1].split()[0])
    assert took <= TIMEOUT + SLACK, f"close() took {took:.2f} s with calls stuck in a hung master"


# ------------------------------------------------------------------------------ master
def test_dead_master_misses_within_the_deadline_opens_the_breaker_and_comes_back_empty(
        master, tiers):
    tier = tiers(master.url, segment=32 << 20)
    names = [f"m{i}" for i in range(8)]
    assert _store(tier, names) == 8
    master.kill()
    for _ in range(5):
        hits, took = _get(tier, names)
        assert hits == 0 and took <= TIMEOUT + SLACK, f"{hits} hits in {took:.2f} s"
        t0 = time.monotonic()
        assert _store(tier, ["while-dead"]) == 0
        assert tier.contains([key_of("m0")]) == [False]
        assert time.monotonic() - t0 <= 2 * (TIMEOUT + SLACK)
    breaker = tier.stats()["breaker"]
    assert breaker["trips"] >= 1, f"the breaker never opened: {breaker}"
    assert tier.stats().get("rejected_open", 0) > 0, "calls still went to a dead master"

    master.start()  # without HA every key is gone; the clients re-mount by themselves
    deadline = time.monotonic() + 20
    while _store(tier, ["again"]) != 1:
        assert time.monotonic() < deadline, "the tier did not store again after a restart"
        time.sleep(0.2)
    assert _get(tier, names)[0] == 0, "keys survived a master restart: not the real master?"
    assert _get(tier, ["again"])[0] == 1


def test_a_master_that_never_answers_bounds_setup_and_every_call(tmp_path, tiers):
    """Set up against a port nobody serves, then against a SIGSTOPped master: the
    constructor returns within the deadline (setup would block 4.4 s a try), calls are
    misses, and once a master answers the tier connects by itself."""
    require_mooncake()
    import lmc.storage.backends.mooncake  # noqa: F401
    m = MooncakeMaster(tmp_path / "late")
    t0 = time.monotonic()
    tier = tiers(m.url, segment=16 << 20)
    assert time.monotonic() - t0 <= TIMEOUT + SLACK
    assert not tier.guard.ready
    assert _get(tier, ["x"])[0] == 0 and _store(tier, ["x"]) == 0
    m.start()
    try:
        deadline = time.monotonic() + 30
        while _store(tier, ["x"]) != 1:
            assert time.monotonic() < deadline, "the tier never connected to a late master"
            time.sleep(0.3)
        assert _get(tier, ["x"])[0] == 1
        m.pause()
        t0 = time.monotonic()
        hung = tiers(m.url, segment=16 << 20)  # the constructor waits for its set-up
        assert time.monotonic() - t0 <= STARTUP_TIMEOUT + SLACK, "setup against a hung master"
        assert _get(hung, ["x"])[0] == 0
        m.resume()
    finally:
        m.stop()


def test_calls_beyond_the_workers_wait_in_line_and_expire(master, tiers):
    """16 readers on a hung master and 2 workers: every read ends within the deadline, no
    more than 2 threads are ever inside the library."""
    tier = tiers(master.url, segment=16 << 20, workers=2, breaker_threshold=1000)
    assert _store(tier, ["w"]) == 1
    master.pause()
    took: list[float] = []
    try:
        def read() -> None:
            took.append(_get(tier, ["w"])[1])

        threads = [threading.Thread(target=read) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(tier.guard._workers) <= 2
    finally:
        master.resume()
    assert len(took) == 16 and max(took) <= TIMEOUT + SLACK, took
    assert tier.stats()["guard_timed_out"] >= 1


# ------------------------------------------------------------------------------ values
def test_values_written_by_another_client_are_checked_before_they_are_served(master, tiers,
                                                                              peers):
    """Another client (no lmc code, the raw store API) writes under this tier's names: a
    value shorter than a head, another key's value, a head claiming more bytes than the
    value holds, one claiming more than the whole pool, and garbage: each is a miss,
    counted and deleted; nothing stays allocated; a good value beside them is served."""
    raw = Peer("raw", master)
    peers.append(raw)
    tier = tiers(master.url, segment=32 << 20)
    good, other = "good", "other"
    assert _store(tier, [good, other]) == 2
    forged = {}
    name_of = lambda n: tier.remote_key(key_of(n))  # noqa: E731
    forged["short"] = b"\x01" * 10
    other_value = bytes.fromhex(raw.ask(op="read", key=name_of(other))["hex"])
    forged["of-another-key"] = other_value
    for n, tokens in (("truncated", 1536), ("larger-than-the-pool", 4096)):
        shape = (2, 2, tokens, 1024)  # 12 MiB fits the 16 MiB pool, 32 MiB does not
        head = encode_header(key_of(n), shape, torch.float16, tokens,
                             bytes(2 * 2 * tokens * 1024 * 2))
        forged[n] = head + b"\0" * 64
    forged["garbage"] = bytes(range(256)) * 64
    for n, v in forged.items():
        assert raw.ask(op="write", key=name_of(n), hex=v.hex())["code"] == 0
    names = [good, *forged]
    used = tier.pool.used_bytes
    hits, took = _get(tier, names)
    assert hits == 1 and took <= TIMEOUT + SLACK
    assert tier.pool.used_bytes == used
    assert tier.stats()["corrupt"] == len(forged)
    for n in forged:  # deleted: a second read does not meet them again
        assert raw.ask(op="read", key=name_of(n))["code"] == -704, n
    assert tier.contains([key_of(n) for n in forged]) == [False] * len(forged)


def test_other_prefixes_never_see_or_change_each_others_values(master, tiers):
    a = tiers(master.url, segment=16 << 20)
    b = tiers(master.url, segment=0)
    assert _store(a, ["t0", "t1"]) == 2
    assert b.contains([key_of("t0"), key_of("t1")]) == [False, False]
    assert _get(b, ["t0"])[0] == 0
    assert b.delete([key_of("t0")]) == 0
    assert _get(a, ["t0", "t1"])[0] == 2


def test_a_full_cluster_refuses_stores_and_evicts_without_wrong_bytes(master, tiers):
    """A 16 MiB segment (the smallest there is): a chunk larger than it is refused (-200) at
    once; 3,000 chunks (24 MiB) all return as stored or not, then reads serve exactly the
    survivors, bit for bit."""
    tier = tiers(master.url, pool_size=48 << 20, segment=16 << 20)
    big = tier.pool.allocate((2, 2, 2048, 2048), torch.float16, 2048)  # 32 MiB
    try:
        t0 = time.monotonic()
        assert tier.put([key_of("big")], [big]) == 0
        assert time.monotonic() - t0 <= TIMEOUT + SLACK
    finally:
        big.release()
    assert tier.stats().get("put_no_space", 0) >= 1
    names = [f"full{i}" for i in range(3000)]
    for i in range(0, len(names), 100):
        _store(tier, names[i:i + 100])
    hits = sum(_get(tier, names[i:i + 100])[0]  # every hit checked bit for bit
               for i in range(0, len(names), 100))
    assert 0 < hits < len(names), f"{hits} of {len(names)} 8 KiB chunks in a 16 MiB segment"


def test_a_value_removed_between_contains_and_get_is_a_miss(master, tiers):
    a = tiers(master.url, segment=16 << 20)
    b = tiers(master.url, segment=0, config={"remote_key_prefix": a.prefix.rstrip("/")})
    assert _store(a, ["gone"]) == 1
    assert b.contains([key_of("gone")]) == [True]
    assert a.delete([key_of("gone")]) == 1  # forced: b's contains leased it
    assert _get(b, ["gone"])[0] == 0


def test_bad_settings_are_named():
    require_mooncake()
    import lmc.storage.backends.mooncake  # noqa: F401
    pool = MemoryPool(1 << 20, pin_memory="false")
    try:
        for url, opts, words in [
            ("mooncake://", {}, "names no master"),
            ("mooncake://h:notaport", {}, "bad port"),
            ("mooncake://h:1/db?x=1", {}, "a path, a query"),
            ("mooncake://127.0.0.1:1", {"protocol": "udp"}, "protocol"),
            ("mooncake://127.0.0.1:1", {"segmnet": 1}, "did you mean 'segment'"),
            ("mooncake://127.0.0.1:1", {"metadata": "ftp://x"}, "metadata"),
            ("mooncake://127.0.0.1:1", {"segment": "4MiB"}, "smallest segment"),
        ]:
            cfg = CacheConfig(remote_url=url, remote_options=opts, remote_timeout=0.2)
            with pytest.raises((ConfigError, ValueError), match=words):
                create_backend(url, cfg, pool).close()
    finally:
        pool.close()


# ------------------------------------------------------------------------------- chain
def test_a_tiers_chain_serves_from_mooncake_after_memory_and_disk_are_emptied(master,
                                                                             tmp_path):
    """``tiers: [memory, disk, mooncake://]`` as config builds it: stores flow down, a fetch
    after L1 was cleared and the disk's copies deleted comes from Mooncake bit for bit, and
    a second chain (another engine, a pure client) loads the same chunks from it."""
    from lmc.storage.chain import build_storage
    from tests.kvutil import assert_bits_equal, random_bits

    shape = (2, 2, 16, 64)

    def chain(segment: int, disk: str) -> object:
        cfg = CacheConfig(local_cpu_size="2MiB", tiers=[
            "memory", {"backend": "disk", "path": disk, "capacity": "16MiB"},
            {"backend": master.url, "segment": segment, "remote_timeout": TIMEOUT,
             "remote_key_prefix": "chain"}])
        return build_storage(cfg, MemoryPool(2 << 20, pin_memory=False))

    a = chain(32 << 20, str(tmp_path / "a"))
    b = chain(0, str(tmp_path / "b"))
    keys = [bytes([7, i]) * 8 for i in range(4)]
    gen = torch.Generator().manual_seed(5)
    try:
        assert [t.name for t in a.tiers] == ["cpu", "disk", "mooncake"]
        objs = a.allocate_many(shape, torch.bfloat16, len(keys), 16)
        want = []
        for o in objs:
            o.tensor.copy_(random_bits(shape, torch.bfloat16, gen))
            want.append(o.tensor.clone())
        assert a.put(keys, objs) == len(keys)
        for o in objs:
            o.release()
        assert a.flush(20)
        a.clear_l1()
        assert a.tiers[1].delete(keys) == len(keys)
        for sm, what in ((a, "the writer, from Mooncake"), (b, "another engine")):
            got, where = sm.fetch_prefix(keys)
            assert where == [2] * len(keys), what
            for g, w in zip(got, want):
                assert_bits_equal(g.tensor, w, what)
                g.release()
    finally:
        b.close()
        a.close()


# ------------------------------------------------------------------------- first calls
class SlowSetup:
    """The library's real client whose ``setup()`` starts ``delay`` seconds late (a loaded
    machine: set-ups took 0.25-2.4 s here); every other call goes straight to it."""

    def __init__(self, delay: float) -> None:
        from mooncake.store import MooncakeDistributedStore

        self._store = MooncakeDistributedStore()
        self._delay = delay

    def setup(self, *args):
        time.sleep(self._delay)
        return self._store.setup(*args)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_fresh_clients_first_lookup_waits_for_its_set_up_not_a_miss(master, tiers, caplog):
    """The README's second node asked before its client was set up and printed "cached
    tokens: 0" with nothing said. A set-up 2 s long, four times ``remote_timeout``: the
    constructor waits for it, and the first lookup hits; nothing is warned."""
    import logging

    a = tiers(master.url, segment=16 << 20)
    assert _store(a, ["first", "second"]) == 2
    with caplog.at_level(logging.WARNING, logger="lmc.storage.backends.mooncake"):
        b = tiers(master.url, segment=0, store_factory=lambda: SlowSetup(2.0),
                  config={"remote_key_prefix": a.prefix.rstrip("/"), "remote_timeout": 0.5})
        assert b.contains([key_of("first"), key_of("second")]) == [True, True], b.stats()
    assert _get(b, ["first", "second"])[0] == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_miss_the_store_caused_is_said_once_in_a_plain_script(master):
    """A script with no logging set up: its tier's master hangs after set-up, every lookup
    times out: one WARNING on stderr says so (the rest are counted), and the lookups miss
    within their deadline."""
    script = textwrap.dedent(f"""
        import os, signal, time
        from lmc.config import CacheConfig
        from lmc.memory.pool import MemoryPool
        from lmc.storage.tier import create_backend
        from lmc.testing.harness import key_of
        import lmc.storage.backends.mooncake
        pool = MemoryPool(16 << 20, pin_memory="false")
        tier = create_backend("{master.url}", CacheConfig(remote_timeout=0.5), pool,
                              segment=16 << 20)
        assert tier.guard.ready
        os.kill({master.proc.pid}, signal.SIGSTOP)
        try:
            for _ in range(3):
                assert tier.contains([key_of("x")]) == [False]
        finally:
            os.kill({master.proc.pid}, signal.SIGCONT)
        print("timeouts", tier.stats().get("timeouts"), flush=True)
        os._exit(0)
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=quiet_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    finally:
        master.resume()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    said = [ln for ln in proc.stderr.splitlines() if "longer than remote_timeout" in ln]
    assert len(said) == 1, proc.stderr[-3000:]
    assert "lookups miss" in said[0] and master.url in said[0]
