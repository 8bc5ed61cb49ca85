"""Disk tier on real directories: bit-exact round trips through the engine, restart, capacity and
LRU, and the faults of issue 3 -- truncated, bit-flipped, renamed and foreign files, a full
disk, a writer killed mid-write -- each ending in correct KV or a miss, never wrong KV.

Threat model: ``docs/threats/tiers.md``."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.memory.pool import MemoryPool
from lmc.storage.backends.disk import backend as disk_mod
from lmc.storage.backends.disk.backend import BLOCK, LOCK, MARKER, DiskBackend
from tests.kvutil import assert_bits_equal, make_caches, random_tokens, spec_for, token_kv

CHUNK = 16
REPO = Path(__file__).resolve().parents[4]  # the repository root


# ------------------------------------------------------------------ helpers
def _cfg(d, **kw) -> CacheConfig:
    return CacheConfig(**{"chunk_size": CHUNK, "local_cpu_size": "4MiB", "local_disk": str(d),
                          "local_disk_size": "16MiB", **kw})


def _tier(d, capacity="16MiB", pool_size=8 << 20, **kw) -> tuple[DiskBackend, MemoryPool]:
    pool = MemoryPool(pool_size, pin_memory=False)
    cfg = CacheConfig(local_disk=str(d), local_disk_size=capacity)
    return DiskBackend(config=cfg, pool=pool, **kw), pool


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def _chunk(pool: MemoryPool, i: int, tokens: int = 8, dtype=torch.float16):
    """A chunk whose every bit derives from ``i`` (so a wrong value is recognisable)."""
    o = pool.allocate((2, 2, tokens, 64), dtype, tokens)
    g = torch.Generator().manual_seed(i)
    o.tensor.view(torch.int16 if dtype.itemsize == 2 else torch.int32).copy_(
        torch.randint(-2**15, 2**15, o.shape, generator=g))
    return o


def _put(tier: DiskBackend, pool: MemoryPool, ids, **kw) -> int:
    objs = [_chunk(pool, i, **kw) for i in ids]
    try:
        return tier.put([_key(i) for i in ids], objs)
    finally:
        for o in objs:
            o.release()


def _check(tier: DiskBackend, pool: MemoryPool, ids, **kw) -> list[bool]:
    """Per id: whether it was served; a served value must be exactly the one written."""
    got = tier.get([_key(i) for i in ids])
    out = []
    for i, o in zip(ids, got):
        if o is not None:
            want = _chunk(pool, i, **kw)
            assert_bits_equal(o.tensor, want.tensor, f"chunk {i}")
            want.release()
            o.release()
        out.append(o is not None)
    return out


def _files(d) -> list[Path]:
    return sorted(p for p in Path(d).iterdir() if p.name not in (MARKER, LOCK))


def _value_path(d, i: int) -> Path:
    return next(Path(d).glob(f"{_key(i).hex()}.*.kv"))


def _disk_bytes(d) -> int:
    total = 0
    for p in Path(d).iterdir():
        if p.name not in (MARKER, LOCK):
            with contextlib.suppress(FileNotFoundError):
                total += p.stat().st_size
    return total


# --------------------------------------------------------------- engine level
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_round_trip_through_engine_and_restart_is_bit_exact(tmp_path, dtype):
    """Stored, flushed, the engine restarted on the same directory: every chunk comes back
    from disk bit for bit (NaN/inf patterns included) under a new slot mapping."""
    n = 5 * CHUNK + 7
    src = make_caches("vllm_flash", dtype=dtype, blocks=32, block_size=4, seed=1)
    dst = make_caches("vllm_flash", dtype=dtype, blocks=32, block_size=4, zeros=True)
    spec = spec_for("vllm_flash", src)
    toks = random_tokens(n)
    s1, s2 = torch.randperm(128)[:n], torch.randperm(128)[:n]
    with CacheEngine(_cfg(tmp_path), spec, "m") as eng:
        assert eng.store(toks, src, s1) == n
        assert eng.flush(10)
        assert eng.stats()["disk.chunks"] == 6
    with CacheEngine(_cfg(tmp_path), spec, "m") as eng:
        assert not eng.contains_chunks(toks).any()  # L1 is empty: everything from disk
        assert eng.lookup(toks) == n
        assert eng.retrieve(toks, dst, s2) == n
        st = eng.stats()
        assert st["disk.get_hits"] == 6 and st["disk.checksum_failures"] == 0
    assert_bits_equal(token_kv(spec, dst, s2), token_kv(spec, src, s1), str(dtype))


def test_tier_round_trip_keeps_shape_dtype_tokens(tmp_path):
    tier, pool = _tier(tmp_path)
    o = _chunk(pool, 3, tokens=5, dtype=torch.float32)
    assert tier.put([_key(3)], [o]) == 1
    (got,) = tier.get([_key(3)])
    assert (got.shape, got.dtype, got.num_tokens) == (o.shape, o.dtype, 5)
    assert_bits_equal(got.tensor, o.tensor)
    size = int(_value_path(tmp_path, 3).name.split(".")[1])
    assert size == BLOCK + -(-o.nbytes // BLOCK) * BLOCK  # header block + padded payload
    o.release()
    got.release()
    assert tier.contains([_key(3), _key(4)]) == [True, False]
    assert tier.delete([_key(3), _key(4)]) == 1 and _files(tmp_path) == []
    tier.close()


def test_buffered_and_direct_files_are_interchangeable(tmp_path):
    """The format does not depend on the I/O mode: a file written buffered reads with O_DIRECT
    and vice versa (a directory moved between filesystems keeps its values)."""
    tier, pool = _tier(tmp_path)
    direct = tier.direct
    tier.direct = False
    _put(tier, pool, [1])
    tier.direct = direct
    _put(tier, pool, [2])
    assert _check(tier, pool, [1, 2]) == [True, True]
    tier.direct = False
    assert _check(tier, pool, [1, 2]) == [True, True]
    tier.close()


# ----------------------------------------------------------- capacity and LRU
def test_capacity_holds_under_a_flood_and_lru_order(tmp_path):
    file_size = BLOCK + 2 * 2 * 8 * 64 * 2  # one _chunk() value on disk: 12 KiB
    tier, pool = _tier(tmp_path, capacity=10 * file_size)
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _disk_bytes(tmp_path))

    w = threading.Thread(target=watch)
    w.start()
    try:
        for start in range(0, 200, 8):  # parallel batches: writes race for the room
            assert _put(tier, pool, range(start, start + 8)) == 8
    finally:
        stop.set()
        w.join()
    assert peak[0] <= 10 * file_size, f"directory reached {peak[0]} B"
    assert len(tier) == 10 and tier.used_bytes == _disk_bytes(tmp_path) == 10 * file_size
    assert _check(tier, pool, range(192, 200)) == [True] * 8  # the last batch is all there

    # LRU, one chunk at a time: touch the two oldest, add two: the next-oldest two go
    for i in range(300, 310):
        _put(tier, pool, [i])
    _check(tier, pool, [300, 301])
    time.sleep(0.05)  # file times are coarse: the restart below orders by them
    _put(tier, pool, [400])
    _put(tier, pool, [401])
    assert tier.contains([_key(i) for i in (300, 301, 302, 303, 304, 400, 401)]) == [
        True, True, False, False, True, True, True]
    tier.close()

    # a restart keeps the values; a smaller capacity evicts down to it, oldest files first
    tier, pool = _tier(tmp_path, capacity=4 * file_size)
    assert len(tier) == 4 and _disk_bytes(tmp_path) == 4 * file_size
    assert tier.contains([_key(400), _key(401)]) == [True, True]
    assert _check(tier, pool, [400, 401]) == [True, True]
    tier.close()


def test_recycled_files_never_serve_stale_bytes(tmp_path):
    """At capacity a same-size victim is overwritten in place; readers racing the writer
    get the right value or a miss, never a mix, and no checksum failure is provoked."""
    file_size = BLOCK + 2 * 2 * 8 * 64 * 2
    tier, pool = _tier(tmp_path, capacity=6 * file_size, pool_size=32 << 20)
    done = threading.Event()
    errors: list[BaseException] = []

    def reader():
        try:
            while not done.is_set():
                _check(tier, pool, range(0, 120, 3))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(0, 120, 4):
        _put(tier, pool, range(i, i + 4))
    done.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert tier.metrics.get("checksum_failures") == 0
    assert _disk_bytes(tmp_path) <= 6 * file_size
    tier.close()


# ------------------------------------------------------------------- faults
def _corrupt(d, how: str) -> None:
    p = _value_path(d, 1)
    if how == "truncate":
        os.truncate(p, p.stat().st_size - BLOCK)
    elif how == "truncate_odd":  # not a multiple of the O_DIRECT block
        os.truncate(p, p.stat().st_size - 1000)
    elif how == "truncate_keep_size":  # size intact, tail zeroed: only the checksum sees it
        with open(p, "r+b") as f:
            f.seek(BLOCK + 100)
            f.write(b"\0" * 200)
    elif how == "flip_payload":
        with open(p, "r+b") as f:
            f.seek(BLOCK + 777)
            b = f.read(1)
            f.seek(BLOCK + 777)
            f.write(bytes([b[0] ^ 0x10]))
    elif how == "flip_header":
        with open(p, "r+b") as f:
            f.seek(30)
            b = f.read(1)
            f.seek(30)
            f.write(bytes([b[0] ^ 1]))
    elif how == "renamed":  # chunk 2's file under chunk 1's name
        os.replace(_value_path(d, 2), p)
    elif how == "foreign":  # garbage under a valid-looking name
        p.write_bytes(os.urandom(p.stat().st_size))


@pytest.mark.parametrize("restart", [False, True], ids=["live", "restart"])
@pytest.mark.parametrize("how", ["truncate", "truncate_odd", "truncate_keep_size", "flip_payload",
                                 "flip_header", "renamed", "foreign"])
def test_damaged_values_are_misses_deleted_and_counted(tmp_path, how, restart):
    tier, pool = _tier(tmp_path)
    assert _put(tier, pool, [0, 1, 2, 3]) == 4
    _corrupt(tmp_path, how)
    if restart:
        tier.close()
        tier, pool = _tier(tmp_path)
    served = _check(tier, pool, [0, 1, 2, 3])  # asserts every served value is exact
    assert served == [True, False, how != "renamed", True]
    assert not list(Path(tmp_path).glob(f"{_key(1).hex()}.*"))  # deleted
    assert tier.metrics.get("checksum_failures") == 1
    assert tier.contains([_key(1)]) == [False]
    assert _put(tier, pool, [1]) == 1 and _check(tier, pool, [1]) == [True]  # rewritable
    tier.close()


def test_foreign_and_temporary_files_are_removed_on_start(tmp_path):
    tier, pool = _tier(tmp_path)
    _put(tier, pool, [0])
    tier.close()
    (tmp_path / "notes.txt").write_text("not lmc's")
    (tmp_path / "0123.kv").write_bytes(b"x")  # malformed name
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / f".tmp.{dead}.7").write_bytes(b"\0" * 100)  # a dead writer's debris
    (tmp_path / "sub").mkdir()  # directories are never touched
    tier, pool = _tier(tmp_path)
    assert sorted(p.name for p in _files(tmp_path)) == sorted(
        [_value_path(tmp_path, 0).name, "sub"])
    assert tier.metrics.get("errors_scan_foreign") == 2
    assert tier.metrics.get("errors_scan_stale_temp") == 1
    assert _check(tier, pool, [0]) == [True]
    tier.close()


def test_refuses_a_non_empty_directory_it_did_not_create(tmp_path):
    (tmp_path / "precious.txt").write_text("user data")
    with pytest.raises(ValueError, match="did not write"):
        _tier(tmp_path)
    assert (tmp_path / "precious.txt").exists()
    assert not (tmp_path / LOCK).exists() and not (tmp_path / MARKER).exists()  # untouched


@pytest.fixture
def full_disk(tmp_path):
    """A directory on a 256 KiB tmpfs (we are root on CI machines), else ``None``."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)],
                       capture_output=True)
    if r.returncode != 0:
        yield None
        return
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.parametrize("mode", ["tmpfs", "injected"])
def test_enospc_skips_and_counts_and_earlier_data_is_served(tmp_path, full_disk, mode,
                                                            monkeypatch):
    """The filesystem fills up before the tier's own limit: stores are skipped and counted,
    earlier values keep being served, and no temporary file is left behind."""
    if mode == "tmpfs" and full_disk is None:
        mode = "injected"  # cannot mount here: fall back to the injected error
        print("tmpfs unavailable; ENOSPC injected at the write call")
    d = full_disk if mode == "tmpfs" else tmp_path / "d"
    tier, pool = _tier(d, capacity="64MiB")
    assert _put(tier, pool, range(4)) == 4
    if mode == "injected":
        real = os.pwritev

        def pwritev(fd, bufs, off):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk_mod.os, "pwritev", pwritev)
    stored = _put(tier, pool, range(4, 40))
    monkeypatch.undo()
    assert stored < 36
    assert tier.metrics.get("errors_put_enospc") == 36 - stored
    assert not [p for p in d.iterdir() if p.name.startswith(".tmp")]
    assert _check(tier, pool, range(4)) == [True] * 4
    assert len(tier) == 4 + stored
    if mode == "injected":
        assert os.pwritev is real and _put(tier, pool, [99]) == 1  # recovers by itself
    tier.close()


_WRITER = textwrap.dedent("""
    import sys, torch
    from lmc import CacheConfig
    from lmc.memory.pool import MemoryPool
    from lmc.storage.backends.disk.backend import DiskBackend
    pool = MemoryPool(64 << 20, pin_memory=False)
    tier = DiskBackend(config=CacheConfig(local_disk=sys.argv[1], local_disk_size="24MiB"),
                       pool=pool, io_threads=2)
    i = 0
    while True:
        objs = []
        for j in range(i, i + 4):
            o = pool.allocate((4, 2, 64, 1024), torch.float32, 64)
            o.tensor.fill_(j)
            objs.append(o)
        assert tier.put([j.to_bytes(16, "little") for j in range(i, i + 4)], objs) == 4
        for o in objs:
            o.release()
        print(i, flush=True)
        i += 4
""")


def _kill_mid_write(d: Path, batches: int) -> bool:
    """Run the writer until it has written ``batches`` batches and a temporary file exists, then
    SIGKILL it; returns whether temporary files were left behind."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(d)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(batches):
            assert proc.stdout.readline(), "writer died"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(
                n.startswith(".tmp") for n in os.listdir(d)):
            time.sleep(0.0002)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    return any(n.startswith(".tmp") for n in os.listdir(d))


@pytest.mark.integration
def test_writer_killed_mid_write_leaves_nothing_torn(tmp_path):
    """SIGKILL a process writing 2 MiB values in a loop (evicting and recycling as it goes)
    while a temporary file exists, twice; each restart removes the temporary files and
    serves only whole values."""
    torn = 0
    for round_ in range(2):
        torn += _kill_mid_write(tmp_path, 4 + 4 * round_)
        pool = MemoryPool(64 << 20, pin_memory=False)
        tier = DiskBackend(config=CacheConfig(local_disk=str(tmp_path), local_disk_size="24MiB"),
                           pool=pool)
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
        keys = [bytes.fromhex(p.name.split(".")[0]) for p in _files(tmp_path)]
        assert keys and len(keys) == len(tier)
        for k, o in zip(keys, tier.get(keys)):
            if o is not None:  # a value served is whole: every element is its own id
                j = int.from_bytes(k, "little")
                assert bool((o.tensor == j).all()), f"value {j} is torn"
                o.release()
        assert tier.metrics.get("checksum_failures") == 0
        tier.close()
    assert torn, "no kill landed mid-write: the test proved nothing"


@pytest.mark.parametrize("align", [4096, 512], ids=["o_direct_blocks", "unaligned_pool"])
def test_io_never_touches_neighbouring_pool_memory(tmp_path, align):
    """A 5000-byte value is padded to 8 KiB on disk. Neither writing nor reading it touches
    a pool byte past its 5000: not the rest of its own block (the padding comes from the
    tier's buffer, ``MemoryObj.io_spans``), not the object next to it, whatever the pool's
    alignment (512: the object is not 4 KiB-aligned, the buffered path runs)."""
    shape, dtype = (1, 1, 5, 500), torch.float16  # 5000 bytes
    pool = MemoryPool(64 << 10, pin_memory=False, align=align)
    tier = DiskBackend(config=CacheConfig(local_disk=str(tmp_path), local_disk_size="1MiB"),
                       pool=pool)
    value = pool.allocate(shape, dtype, 5)
    after = pool.allocate((16 << 10,), torch.uint8)  # the object right behind the value
    assert after.offset == value.offset + pool.allocator.block_size(value.offset)
    slack = pool.buffer[value.offset + value.nbytes: after.offset]  # the block's own tail
    value.tensor.view(torch.uint8).random_()
    after.tensor.fill_(0xAB)
    slack.fill_(0xCD)
    want = value.tensor.clone()
    assert tier.put([_key(1)], [value]) == 1
    assert bool((after.tensor == 0xAB).all()), "the write spilled past the object"
    assert bool((slack == 0xCD).all()), "the write changed pool bytes past obj.nbytes"
    value.release()  # the read lands in the value's old block (the best fit), as asserted
    slack.fill_(0xCD)  # (a freed block is poisoned in invariant mode)
    (got,) = tier.get([_key(1)])
    assert got is not None and got.offset == value.offset
    assert_bits_equal(got.tensor, want)
    assert bool((after.tensor == 0xAB).all()), "the read spilled past the object"
    assert bool((slack == 0xCD).all()), "the read wrote pool bytes past obj.nbytes"
    got.release()
    after.release()
    tier.close()
