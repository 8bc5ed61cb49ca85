"""The weights' digests kept across restarts (``lmc/connectors/core/digest_cache.py``).

Reads are counted, never timed: ``rchar`` of ``/proc/self/io`` is every byte this process
read through a system call, so a warm start that does not re-read the weights shows as a
delta far below their size. The cache file decides which KV a model is served, so it is also
attacked: garbage, nesting 200 KB deep, entries not in lmc's format, a forged entry in a
file others may write, a symlink, another owner: each is "not used" (the weights are hashed
again, one WARNING), never a crash and never a wrong identity.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import stat
from pathlib import Path

import pytest

from lmc.connectors.core import digest_cache
from lmc.connectors.core.digest_cache import DigestCache
from lmc.connectors.core.model_id import model_identity

WEIGHTS = 24 << 20


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own cache folder; files written a moment ago are cached (the racy
    window is tested on its own below)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(digest_cache, "RACY_NS", 0)
    digest_cache._warned.clear()


def cache_file(tmp_path: Path) -> Path:
    return tmp_path / "xdg" / "lmc" / "identity" / "weight-digests.json"


def checkpoint(where: Path, nbytes: int = WEIGHTS, files: int = 1) -> Path:
    where.mkdir(parents=True)
    (where / "config.json").write_text('{"model_type": "llama"}')
    for i in range(files):
        (where / f"model-{i}.safetensors").write_bytes(os.urandom(nbytes))
    return where


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def read_by(fn) -> tuple[object, int]:
    before = rchar()
    out = fn()
    return out, rchar() - before


def test_a_warm_start_reads_no_weights(tmp_path):
    ckpt = checkpoint(tmp_path / "m")
    cold, cold_read = read_by(lambda: model_identity(ckpt))
    warm, warm_read = read_by(lambda: model_identity(ckpt))
    assert cold == warm
    assert cold_read >= WEIGHTS
    assert warm_read < WEIGHTS // 20, f"a warm start read {warm_read} bytes"
    mode = stat.S_IMODE(cache_file(tmp_path).stat().st_mode)
    assert mode == 0o600, oct(mode)
    assert stat.S_IMODE(cache_file(tmp_path).parent.stat().st_mode) == 0o700


def test_a_file_changed_moments_before_it_is_hashed_is_not_cached(tmp_path, monkeypatch,
                                                                  caplog):
    """Where timestamps are coarse, a same-size rewrite in the same tick keeps every field of
    a file's state: a digest is stored only for a file unchanged for RACY_NS."""
    monkeypatch.setattr(digest_cache, "RACY_NS", 3_600 * 10**9)  # an hour: everything is new
    ckpt = checkpoint(tmp_path / "m")
    with caplog.at_level(logging.INFO, "lmc.connectors.core.model_id"):
        first = model_identity(ckpt)
    assert "but for 1 file(s) changed in the last seconds" in caplog.text
    again, n = read_by(lambda: model_identity(ckpt))
    assert again == first and n >= WEIGHTS
    assert not cache_file(tmp_path).exists()
    monkeypatch.setattr(digest_cache, "RACY_NS", 0)
    model_identity(ckpt)
    _, n = read_by(lambda: model_identity(ckpt))
    assert n < WEIGHTS // 20


def test_a_touch_a_rewrite_or_a_replacement_is_read_again(tmp_path):
    ckpt = checkpoint(tmp_path / "m")
    path = ckpt / "model-0.safetensors"
    first = model_identity(ckpt)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touch
    same, n = read_by(lambda: model_identity(ckpt))
    assert same == first and n >= WEIGHTS
    # new bytes, same size, the old mtime put back: ctime moved, so it is read again
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed, n = read_by(lambda: model_identity(ckpt))
    assert changed != first and n >= WEIGHTS
    # another file renamed into its place (same bytes, another inode)
    other = ckpt / "other.tmp"
    shutil.copy2(path, other)
    os.replace(other, path)
    again, n = read_by(lambda: model_identity(ckpt))
    assert again == changed and n >= WEIGHTS


def test_several_processes_on_one_checkpoint_read_each_file_once(tmp_path):
    """Tensor-parallel ranks starting together: each file is hashed by one of them, the
    others wait for its digest (claims), instead of every rank reading everything."""
    ckpt = checkpoint(tmp_path / "m", nbytes=32 << 20, files=4)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(str(ckpt), os.environ["XDG_CACHE_HOME"], barrier,
                                             results)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    assert len({ident for ident, _ in got}) == 1
    total = sum(n for _, n in got)
    assert total < 1.5 * (4 * (32 << 20)), f"3 ranks read {total} bytes of 128 MiB of weights"


def _rank(ckpt: str, xdg: str, barrier, results) -> None:
    os.environ["XDG_CACHE_HOME"] = xdg
    digest_cache.RACY_NS = 0  # the files were written a moment ago
    barrier.wait()
    ident, n = read_by(lambda: model_identity(ckpt))
    results.put((ident, n))


# ----------------------------------------------------------------- the file attacked
GARBAGE = {
    "binary": b"\x00\xff" * 100,
    "not json": b"{digests: yes",
    "nested 200 KB": b"[" * 200_000,
    "a list": b"[]",
    "another format": json.dumps({"format": 99, "digest": "x", "entries": {}}).encode(),
    "an extra field": None,  # made from a real file below
    "a short digest": None,
    "a negative size": None,
    "a key twice": None,
}


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_a_corrupt_cache_file_is_not_used_and_is_rewritten(tmp_path, kind, caplog):
    ckpt = checkpoint(tmp_path / "m")
    truth = model_identity(ckpt)
    path = cache_file(tmp_path)
    raw = GARBAGE[kind]
    if raw is None:
        doc = json.loads(path.read_text())
        entry = next(iter(doc["entries"].values()))
        if kind == "an extra field":
            entry["trusted"] = True
        elif kind == "a short digest":
            entry["digest"] = entry["digest"][:8]
        elif kind == "a negative size":
            entry["size"] = -1
        raw = json.dumps(doc).encode()
        if kind == "a key twice":
            raw = raw.replace(b'"format": 1', b'"format": 1, "format": 1')
    path.write_bytes(raw)
    with caplog.at_level(logging.WARNING, "lmc.connectors.core.digest_cache"):
        ident, n = read_by(lambda: model_identity(ckpt))
    assert ident == truth and n >= WEIGHTS
    assert "weight digest cache not used" in caplog.text and str(path) in caplog.text
    _, n = read_by(lambda: model_identity(ckpt))
    assert n < WEIGHTS // 20  # rewritten in lmc's format: warm again


def _forge(tmp_path: Path, ckpt: Path, digest: str = "0" * 32) -> Path:
    path = cache_file(tmp_path)
    doc = json.loads(path.read_text())
    for entry in doc["entries"].values():
        entry["digest"] = digest
    path.write_text(json.dumps(doc))
    return path


def test_a_forged_entry_in_a_file_others_may_write_is_not_trusted(tmp_path, caplog):
    ckpt = checkpoint(tmp_path / "m")
    truth = model_identity(ckpt)
    path = _forge(tmp_path, ckpt)
    os.chmod(path, 0o666)
    with caplog.at_level(logging.WARNING, "lmc.connectors.core.digest_cache"):
        ident, n = read_by(lambda: model_identity(ckpt))
    assert ident == truth and n >= WEIGHTS
    assert "writable by group or others" in caplog.text


def test_a_forged_entry_in_a_file_of_this_user_is_what_the_threat_model_trusts(tmp_path):
    """The documented boundary: the file is the user's own (0600 in a 0700 folder); whoever
    can write it as this user chooses the identity (and could as well rewrite the weights)."""
    ckpt = checkpoint(tmp_path / "m")
    truth = model_identity(ckpt)
    _forge(tmp_path, ckpt)
    assert model_identity(ckpt) != truth


def test_a_symlinked_cache_file_is_not_followed(tmp_path, caplog):
    ckpt = checkpoint(tmp_path / "m")
    truth = model_identity(ckpt)
    path = cache_file(tmp_path)
    elsewhere = tmp_path / "planted.json"
    shutil.copy(path, elsewhere)
    _forge(tmp_path, ckpt)
    shutil.move(path, elsewhere)
    path.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, "lmc.connectors.core.digest_cache"):
        assert model_identity(ckpt) == truth
    assert "weight digest cache not used" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_cache_file_or_folder_of_another_user_is_not_used(tmp_path, caplog):
    ckpt = checkpoint(tmp_path / "m")
    truth = model_identity(ckpt)
    path = _forge(tmp_path, ckpt)
    os.chown(path, 4242, 4242)
    with caplog.at_level(logging.WARNING):
        assert model_identity(ckpt) == truth
    assert "owned by uid 4242" in caplog.text
    os.chown(path.parent, 4242, 4242)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert model_identity(ckpt) == truth
    assert "lmc cache not used" in caplog.text and "owned by uid 4242" in caplog.text


def test_a_folder_others_may_write_is_not_used(tmp_path, caplog):
    ckpt = checkpoint(tmp_path / "m")
    truth = model_identity(ckpt)
    _forge(tmp_path, ckpt)
    os.chmod(cache_file(tmp_path).parent, 0o777)
    with caplog.at_level(logging.WARNING):
        ident, n = read_by(lambda: model_identity(ckpt))
    assert ident == truth and n >= WEIGHTS
    assert "writable by group or others" in caplog.text


def test_entries_are_bounded_and_vanished_files_go_first(tmp_path, monkeypatch):
    monkeypatch.setattr(digest_cache, "MAX_ENTRIES", 3)
    ckpts = [checkpoint(tmp_path / f"m{i}", nbytes=1 << 16) for i in range(3)]
    for c in ckpts:
        model_identity(c)
    shutil.rmtree(ckpts[1])
    model_identity(checkpoint(tmp_path / "m3", nbytes=1 << 16))
    entries = json.loads(cache_file(tmp_path).read_text())["entries"]
    assert len(entries) == 3
    assert not any("/m1/" in p for p in entries)
    for i in (4, 5):
        model_identity(checkpoint(tmp_path / f"m{i}", nbytes=1 << 16))
    entries = json.loads(cache_file(tmp_path).read_text())["entries"]
    assert sorted(Path(p).parent.name for p in entries) == ["m3", "m4", "m5"]


def test_an_unusable_cache_folder_still_gives_the_identity(tmp_path, monkeypatch, caplog):
    ckpt = checkpoint(tmp_path / "m")
    blocker = tmp_path / "xdg"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING):
        first = model_identity(ckpt)
        second, n = read_by(lambda: model_identity(ckpt))
    assert first == second and n >= WEIGHTS
    assert "lmc cache not used" in caplog.text
    assert DigestCache().path is None
