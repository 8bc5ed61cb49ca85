"""Lower-tier hits read layer by layer (``get_layers``, :mod:`lmc.storage.layered_read`) through the
engine's layer-wise retrieve, over a real disk directory and a real redis-server:

* the KV is bit-exact and the chunks are promoted into L1 only after they verified;
* layer 0 is handed over while a later layer's read is still held back (the point of it);
* a bit flipped in the *last* layer of a stored value (in the file, in Redis) is never
  reported loaded: the last layer's load fails (``LoadError``: the engine recomputes), the
  retrieve reports 0 tokens, the value is deleted and counted, nothing reaches L1, and the
  next lookup misses;
* with a keyed integrity secret the tag is checked the same way.
"""

from __future__ import annotations

import glob
import os
import threading
import uuid

import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.layerwise import LoadError
from lmc.storage.backends.disk import disk_layered_read as disk_layers
from lmc.storage.serde import HEADER_SIZE, decode_header
from tests.kvutil import assert_bits_equal, make_caches, random_tokens, spec_for, token_kv
from tests.storage.backends.conftest import redis_server  # noqa: F401 - real redis-server

CHUNK = 16
LAYERS = 4
N = 3 * CHUNK + 5  # three whole chunks and a partial one
SLOTS = torch.arange(N) + 8


def _caches(zeros=False):
    # 4 layers x 2 planes x 16 tokens x 32 floats: 4 KiB per layer and chunk, so the
    # layer windows fall on 4 KiB units; dim 24 below makes them straddle units
    return make_caches("vllm_flash", layers=LAYERS, heads=2, dim=16, blocks=64, block_size=4,
                       seed=7, zeros=zeros)


def _odd_caches(zeros=False):
    return make_caches("vllm_flash", layers=LAYERS, heads=3, dim=8, blocks=64, block_size=4,
                       seed=9, zeros=zeros)


def _engine(lower: dict, **kw) -> CacheEngine:
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size="4MiB", debug_leaks=True,
                      save_unfull_chunk=True, **lower, **kw)
    return CacheEngine(cfg, spec_for("vllm_flash", _caches()), "m")


def _lower(kind: str, tmp_path, redis) -> dict:
    if kind == "disk":
        return {"local_disk": str(tmp_path / "disk")}
    return {"remote_url": redis.url, "remote_timeout": 5.0,
            "remote_key_prefix": f"lay{uuid.uuid4().hex[:8]}"}


def _store_below(lower: dict, src, toks, caches_fn=_caches, **kw) -> None:
    spec = spec_for("vllm_flash", caches_fn())
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size="4MiB", save_unfull_chunk=True,
                      **lower, **kw)
    with CacheEngine(cfg, spec, "m") as eng:
        assert eng.store(toks, src, SLOTS) == N
        assert eng.flush(10)


def _retrieve_layerwise(eng, toks, dst):
    """Load every layer in order; returns (tokens reported, the layer that failed or None)."""
    rt = eng.retrieve_layer(toks, dst, SLOTS)
    failed = None
    try:
        for layer in range(LAYERS):
            try:
                rt.load(layer)
            except LoadError:
                failed = layer
                break
    finally:
        got = rt.close()
    return got, failed


@pytest.fixture(params=["disk", "redis"])
def kind(request):
    return request.param


@pytest.mark.parametrize("caches_fn", [_caches, _odd_caches], ids=["aligned", "straddling"])
def test_a_lower_hit_loads_layer_by_layer_bit_exact(kind, caches_fn, tmp_path,
                                                    redis_server):  # noqa: F811
    lower = _lower(kind, tmp_path, redis_server)
    src, toks = caches_fn(), random_tokens(N)
    spec = spec_for("vllm_flash", src)
    _store_below(lower, src, toks, caches_fn)
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size="4MiB", debug_leaks=True,
                      save_unfull_chunk=True, **lower)
    with CacheEngine(cfg, spec, "m") as eng:
        assert not eng.contains_chunks(toks).any()
        dst = caches_fn(zeros=True)
        rt = eng.retrieve_layer(toks, dst, SLOTS)
        assert rt.gate.pending or rt.gate.parts, "the hit did not take the layered path"
        assert rt.tiers == (kind,) * 4
        rt.start()
        for layer in range(LAYERS):
            rt.wait(layer)
        assert rt.close() == N
        assert_bits_equal(token_kv(spec, dst, SLOTS), token_kv(spec, src, SLOTS), kind)
        assert eng.contains_chunks(toks).all(), "verified chunks are promoted into L1"
        st = eng.stats()
        assert st[f"{kind}.get_hits"] == 4 and st[f"{kind}.promoted"] == 4


def test_layer_zero_is_handed_over_before_later_layers_land(tmp_path, monkeypatch):
    """The disk read of layer 1 and later is held back: layer 0 must load meanwhile."""
    src, toks = _caches(), random_tokens(N)
    spec = spec_for("vllm_flash", src)
    lower = {"local_disk": str(tmp_path / "disk")}
    _store_below(lower, src, toks)
    gate = threading.Event()
    real = disk_layers.DiskLayeredRead._read_window

    def held(self, v, obj, lo, hi):
        if lo >= v.hdr.payload_len // LAYERS:  # any window past layer 0 waits
            assert gate.wait(10), "never released"
        return real(self, v, obj, lo, hi)

    monkeypatch.setattr(disk_layers.DiskLayeredRead, "_read_window", held)
    with _engine(lower) as eng:
        dst = _caches(zeros=True)
        rt = eng.retrieve_layer(toks, dst, SLOTS).start()
        rt.wait(0)  # returns although layers 1.. are not read yet
        assert rt.gate.pending
        want, got = token_kv(spec, src, SLOTS), token_kv(spec, dst, SLOTS)
        assert_bits_equal(got[0], want[0], "layer 0 before the rest landed")
        assert not eng.contains_chunks(toks).any(), "promoted before verification"
        gate.set()
        for layer in range(1, LAYERS):
            rt.wait(layer)
        assert rt.close() == N
        assert_bits_equal(token_kv(spec, dst, SLOTS), want, "all layers")


def _flip_disk(lower: dict) -> None:
    """Flip one bit in the last layer of every stored file (payload starts at 4096)."""
    files = sorted(glob.glob(os.path.join(lower["local_disk"], "*.kv")))
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            off = 4096 + decode_header(fh.read(HEADER_SIZE)).payload_len - 5
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 0x10]))


def _flip_redis(lower: dict, redis) -> None:
    """Flip one bit in the last layer of every stored value (SETRANGE in place)."""
    c = redis.client()
    keys = [k for k in c.scan_iter(match=f"{lower['remote_key_prefix']}:*")]
    assert keys
    for k in keys:
        n = c.strlen(k)
        off = n - 5
        b = c.getrange(k, off, off)
        c.setrange(k, off, bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("secret", [None, "s" * 32], ids=["checksum", "keyed_tag"])
def test_a_bit_flip_in_the_last_layer_is_never_loaded(kind, secret, tmp_path,
                                                      redis_server):  # noqa: F811
    if secret and kind == "disk":
        pytest.skip("the disk tier carries no keyed tag (integrity_secret is for shared tiers)")
    lower = _lower(kind, tmp_path, redis_server)
    extra = {"integrity_secret": secret} if secret else {}
    src, toks = _caches(), random_tokens(N)
    _store_below(lower, src, toks, **extra)
    if kind == "disk":
        _flip_disk(lower)
    else:
        _flip_redis(lower, redis_server)
    with _engine(lower, **extra) as eng:
        dst = _caches(zeros=True)
        got, failed = _retrieve_layerwise(eng, toks, dst)
        assert got == 0, "a retrieve over a corrupted chunk reported tokens loaded"
        assert failed == LAYERS - 1, f"the failure must come at the last layer, got {failed}"
        assert not eng.contains_chunks(toks).any(), "a corrupted chunk reached L1"
        st = eng.stats()
        assert st[f"{kind}.checksum_failures"] >= 1
        assert eng.lookup(toks) == 0, "the corrupted values must be deleted"
        got, _ = _retrieve_layerwise(eng, toks, _caches(zeros=True))
        assert got == 0


def test_a_whole_retrieve_still_reads_whole_chunks(tmp_path):
    """``retrieve`` (not layer-wise) keeps the whole-chunk path: a corrupt value is a miss
    before anything is written."""
    src, toks = _caches(), random_tokens(N)
    lower = {"local_disk": str(tmp_path / "disk")}
    _store_below(lower, src, toks)
    _flip_disk(lower)
    with _engine(lower) as eng:
        dst = _caches(zeros=True)
        before = dst[0].clone()
        assert eng.retrieve(toks, dst, SLOTS) == 0
        assert torch.equal(dst[0], before)
