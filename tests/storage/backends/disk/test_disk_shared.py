"""One disk directory, several tiers: the second (same process or another) is refused with the
holder's PID and the fix, the size limit holds, and a holder killed with SIGKILL frees the
directory (the kernel drops its flock).

Threat model: ``docs/threats/tiers.md``."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.backends.disk.backend import LOCK, MARKER, DirectoryInUse, DiskBackend

REPO = Path(__file__).resolve().parents[4]  # the repository root
CAPACITY = 8 << 20

_WRITER = textwrap.dedent("""
    import os, sys, time, torch
    from lmc import CacheConfig
    from lmc.memory.pool import MemoryPool
    from lmc.storage.backends.disk.backend import DirectoryInUse, DiskBackend
    pool = MemoryPool(16 << 20, pin_memory=False)
    sys.stdout.write("started\\n"); sys.stdout.flush()
    sys.stdin.readline()  # both writers start opening at the same moment
    try:
        tier = DiskBackend(config=CacheConfig(local_disk=sys.argv[1], local_disk_size="8MiB"),
                           pool=pool, io_threads=2)
    except DirectoryInUse as e:
        print("refused", e, flush=True)
        sys.exit(3)
    for i in range(48):  # 48 MiB of 1 MiB values into an 8 MiB tier: evicting all along
        o = pool.allocate((2, 2, 64, 1024), torch.float32, 64)
        o.tensor.fill_(i)
        assert tier.put([(os.getpid() * 1000 + i).to_bytes(16, "little")], [o]) == 1
        o.release()
    print("holding", os.getpid(), flush=True)
    time.sleep(600)
""")


def _tier(d: Path) -> DiskBackend:
    return DiskBackend(config=CacheConfig(local_disk=str(d), local_disk_size=CAPACITY),
                       pool=MemoryPool(4 << 20, pin_memory=False))


def _disk_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.name not in (MARKER, LOCK))


def test_second_tier_in_one_process_is_refused_until_the_first_closes(tmp_path):
    a = _tier(tmp_path)
    with pytest.raises(DirectoryInUse, match="another disk tier in this process") as e:
        _tier(tmp_path)
    assert str(tmp_path) in str(e.value) and "its own directory" in str(e.value)
    a.close()
    b = _tier(tmp_path)
    del b  # dropped without close(): collecting it frees the directory too
    gc.collect()
    _tier(tmp_path).close()


@pytest.mark.integration
def test_two_processes_one_directory_one_wins_limit_holds_kill_frees(tmp_path):
    """Two writer processes open one directory at the same moment: exactly one gets it and
    fills it (48 MiB through an 8 MiB limit) while the other is refused with the winner's PID;
    the directory never exceeds the limit; after SIGKILL of the winner the directory opens."""
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline() == "started\n"
        for p in procs:  # release both at once
            p.stdin.write("go\n")
            p.stdin.flush()
        lines = {p.pid: p.stdout.readline() for p in procs}
        winners = [pid for pid, line in lines.items() if line.startswith("holding")]
        losers = [pid for pid, line in lines.items() if line.startswith("refused")]
        assert len(winners) == 1 and len(losers) == 1, lines
        refusal = lines[losers[0]]
        assert f"PID {winners[0]}" in refusal and str(tmp_path) in refusal, refusal
        assert next(p for p in procs if p.pid == losers[0]).wait(30) == 3
        assert _disk_bytes(tmp_path) <= CAPACITY
        with pytest.raises(DirectoryInUse, match=f"PID {winners[0]}"):
            _tier(tmp_path)
        winner = next(p for p in procs if p.pid == winners[0])
        winner.send_signal(signal.SIGKILL)
        winner.wait(30)
        deadline = time.monotonic() + 10
        while True:  # the lock goes with the process; nothing to clean up by hand
            try:
                tier = _tier(tmp_path)
                break
            except DirectoryInUse:
                assert time.monotonic() < deadline, "a killed holder left the directory locked"
                time.sleep(0.05)
        assert 0 < tier.used_bytes <= CAPACITY and tier.used_bytes == _disk_bytes(tmp_path)
        tier.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
            for f in (p.stdin, p.stdout):
                if f:
                    f.close()
    assert os.path.exists(tmp_path / LOCK)  # kept (unlinking a lock file races with lockers)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_forked_child_does_not_keep_the_directory_locked(tmp_path):
    """A child forked while the tier is open (a helper process of the engine) must not hold the
    lock once the parent closes the tier: the child closes its inherited copy at fork."""
    import multiprocessing as mp

    a = _tier(tmp_path)
    child = mp.get_context("fork").Process(target=_sleep, args=(30,))
    child.start()
    try:
        a.close()
        _tier(tmp_path).close()  # opens although the child still lives
    finally:
        child.kill()
        child.join(10)


def _hold_like_a_forked_child(d: Path, pid: int) -> int:
    """What a child forked a moment ago holds: another open copy of the lock, written by this
    process (``pid``), that no tier here owns. Returns its fd (closing it lets go)."""
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, f"{pid}\n".encode(), 0)
    return fd


def test_a_lock_a_just_forked_child_still_holds_is_waited_for(tmp_path):
    """Between fork and the child's at-fork handler, the child's inherited copy still holds the
    lock the parent just let go; a tier opened in that window waits for it, not fails."""
    import threading

    fd = _hold_like_a_forked_child(tmp_path, os.getpid())
    threading.Timer(0.2, os.close, args=(fd,)).start()
    _tier(tmp_path).close()


def test_a_lock_a_forked_child_never_lets_go_is_refused_naming_it(tmp_path, monkeypatch):
    from lmc.storage.backends.disk import backend

    monkeypatch.setattr(backend, "FORK_RELEASE_WAIT_S", 0.2)
    fd = _hold_like_a_forked_child(tmp_path, os.getpid())
    try:
        with pytest.raises(DirectoryInUse, match="a process forked from this one"):
            _tier(tmp_path)
    finally:
        os.close(fd)


def test_another_tier_in_this_process_is_refused_without_waiting(tmp_path, monkeypatch):
    """Only an inherited copy is waited for: a tier of this process is refused at once."""
    from lmc.storage.backends.disk import backend

    monkeypatch.setattr(backend, "FORK_RELEASE_WAIT_S", 60.0)
    a = _tier(tmp_path)
    t0 = time.monotonic()
    try:
        with pytest.raises(DirectoryInUse, match="another disk tier in this process"):
            _tier(tmp_path)
        assert time.monotonic() - t0 < 30  # not the 60 s wait for a forked child
    finally:
        a.close()


def test_another_process_is_refused_without_waiting(tmp_path, monkeypatch):
    from lmc.storage.backends.disk import backend

    monkeypatch.setattr(backend, "FORK_RELEASE_WAIT_S", 60.0)
    fd = _hold_like_a_forked_child(tmp_path, 1)  # the lock file names another process
    t0 = time.monotonic()
    try:
        with pytest.raises(DirectoryInUse, match="another lmc process \\(PID 1\\)"):
            _tier(tmp_path)
        assert time.monotonic() - t0 < 30
    finally:
        os.close(fd)


# ------------------------------------------------------------ crashes in a PID namespace
# Threat model: docs/threats/tiers.md (the disk tier: processes that share a directory over
# time, killed at any point).
_NS_WRITER = textwrap.dedent("""
    import os, sys, torch
    from lmc import CacheConfig
    from lmc.memory.pool import MemoryPool
    from lmc.storage.backends.disk.backend import DiskBackend
    d, first = sys.argv[1], int(sys.argv[2])
    pool = MemoryPool(8 << 20, pin_memory=False)
    tier = DiskBackend(config=CacheConfig(local_disk=d, local_disk_size="8MiB"), pool=pool,
                       io_threads=2)
    # a write in flight when the process dies: a temporary file named with our PID
    with open(tier._tmp_path(), "wb") as f:
        f.write(b"\\0" * (2 << 20))
    for i in range(first, first + 4):
        o = pool.allocate((2, 2, 64, 1024), torch.float32, 64)
        o.tensor.fill_(i)
        assert tier.put([i.to_bytes(16, "little")], [o]) == 1
        o.release()
    with open(tier._tmp_path(), "wb") as f:
        f.write(b"\\0" * (2 << 20))
    print("pid", os.getpid(), flush=True)
    sys.stdin.readline()  # killed here
""")

_NS_READER = textwrap.dedent("""
    import json, os, sys, torch
    from lmc import CacheConfig
    from lmc.memory.pool import MemoryPool
    from lmc.storage.backends.disk.backend import DiskBackend
    d, upto = sys.argv[1], int(sys.argv[2])
    pool = MemoryPool(8 << 20, pin_memory=False)
    tier = DiskBackend(config=CacheConfig(local_disk=d, local_disk_size="8MiB"), pool=pool,
                       io_threads=2)
    temps = [n for n in os.listdir(d) if n.startswith(".tmp.")]
    keys = [i.to_bytes(16, "little") for i in range(upto)]
    exact = wrong = 0
    for i, o in enumerate(tier.get(keys)):
        if o is not None:
            ok = bool((o.tensor == i).all())
            exact, wrong = exact + ok, wrong + (not ok)
            o.release()
    tier.close()
    print(json.dumps({"pid": os.getpid(), "temps": temps, "exact": exact, "wrong": wrong,
                      "stale": tier.metrics.get("errors_scan_stale_temp")}), flush=True)
""")


def _unshare() -> list[str]:
    """``unshare --pid --fork`` when this process may make PID namespaces (root), else skip."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "true"],
                           capture_output=True, timeout=30) if shutil.which("unshare") else None
    if probe is None or probe.returncode:
        pytest.skip("cannot make a PID namespace here (unshare --pid needs root)")
    return ["unshare", "--pid", "--fork", "--kill-child"]


@pytest.mark.integration
def test_a_writer_killed_in_a_pid_namespace_leaves_no_debris_the_next_one_keeps(tmp_path):
    """A container restart: a writer running as PID 1 of its PID namespace is SIGKILLed with
    writes in flight, and the next one, PID 1 too, opens the directory. Its start-up must
    remove the dead writer's ``.tmp.1.*`` files (it holds the directory's lock, so no live
    writer owns them; before, ``_pid_alive(1)`` was true for itself and they stayed, so the
    directory exceeded ``local_disk_size``), and every value it serves is bit-exact. Three
    SIGKILL rounds."""
    ns = _unshare()
    d = tmp_path / "disk"
    for rnd in range(3):
        w = subprocess.Popen([*ns, sys.executable, "-c", _NS_WRITER, str(d), str(4 * rnd)],
                             cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert w.stdout.readline() == "pid 1\n", "the writer is not PID 1 of its namespace"
            assert any(p.name.startswith(".tmp.1.") for p in d.iterdir())
            w.send_signal(signal.SIGKILL)  # --kill-child: the namespace's PID 1 dies with it
            w.wait(30)
        finally:
            if w.poll() is None:
                w.kill()
                w.wait()
            w.stdin.close()
            w.stdout.close()
        r = subprocess.run([*ns, sys.executable, "-c", _NS_READER, str(d), str(4 * rnd + 4)],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["pid"] == 1
        assert out["temps"] == [], f"round {rnd}: the dead writer's temp files were kept"
        assert out["stale"] == 2 and out["wrong"] == 0 and out["exact"] >= 4, out
        assert _disk_bytes(d) <= CAPACITY


def test_temp_files_named_with_our_own_pid_are_debris_once_we_hold_the_lock(tmp_path):
    """The same without namespaces: a previous writer whose PID equals ours (what a container
    restart gives) left 3 MiB of temporary files; a tier opened on the directory removes
    them, counts them, and filling it keeps the directory within the limit."""
    tier = _tier(tmp_path)
    tier.close()
    for i in range(3):
        (tmp_path / f".tmp.{os.getpid()}.dead{i:x}").write_bytes(b"\0" * (1 << 20))
    tier = _tier(tmp_path)
    try:
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp.")]
        assert tier.metrics.get("errors_scan_stale_temp") == 3
        for i in range(12):  # 12 MiB of 1 MiB values through the 8 MiB limit
            o = tier.pool.allocate((2, 2, 64, 1024), torch.float32, 64)
            o.tensor.fill_(i)
            assert tier.put([i.to_bytes(16, "little")], [o]) == 1
            o.release()
        assert _disk_bytes(tmp_path) <= CAPACITY
        assert tier.used_bytes == _disk_bytes(tmp_path)
    finally:
        tier.close()
        tier.pool.close()
