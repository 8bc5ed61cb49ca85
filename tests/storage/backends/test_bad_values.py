"""A value another process rewrote, on every read path of every tier that reads bytes another
process wrote (Redis, the ``lmc://`` daemon, the disk), attacked as a writer to the store
would: the header's dtype or shape rewritten so that every checksum still holds.

Threat model: ``docs/threats/tiers.md``. What each path must do with such a value is the
same: count it, delete it, serve a miss; so the reader recomputes, the writer's next store
puts the right value back (its key is no longer "present"), and nothing of the wrong shape
reaches L1. Before this change the layer-wise read missed for ever (neither counted nor
deleted) and the whole-chunk read promoted the wrong-shaped chunk into L1, where it made the
writer's re-store skip the key.

The engine gives its tiers its geometry with :func:`lmc.storage.integrity.expect_geometry`
(``_wire`` below does what ``CacheEngine.__init__`` is to do, see the module's docstring).
"""

from __future__ import annotations

import os
import struct
import time
import uuid
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmc import CacheConfig, CacheEngine
from lmc.layerwise import LoadError
from lmc.storage.integrity import Geometry, expect_geometry
from lmc.storage.serde import DTYPE_CODES, HEADER_SIZE, CorruptValue, decode_header
from tests.kvutil import assert_bits_equal, make_caches, random_tokens, spec_for, token_kv
from tests.server.daemon_proc import DaemonProc

from .conftest import redis_server  # noqa: F401 - a real redis-server

pytestmark = pytest.mark.integration

CHUNK = 16
LAYERS = 4
N = 3 * CHUNK + 5
SLOTS = torch.arange(N) + 8
FIELDS = struct.Struct("<4sHH16sB3x4IIQQ")  # lmc.storage.serde's header layout


def _caches(zeros: bool = False):
    return make_caches("vllm_flash", layers=LAYERS, heads=2, dim=16, blocks=64, block_size=4,
                       seed=7, zeros=zeros)


SPEC = spec_for("vllm_flash", _caches())


# ------------------------------------------------------------------------ rewriting
def rewrite_header(head: bytes, how: str) -> bytes:
    """The 72 header bytes with dtype or shape rewritten, payload length and both checksums
    kept consistent (what anyone who can write to the store can do)."""
    magic, ver, flags, key, code, s0, s1, s2, s3, ntok, plen, csum = FIELDS.unpack(
        head[:FIELDS.size])
    if how == "dtype":  # float32 -> float16 with twice the width: the same bytes
        code, s3 = DTYPE_CODES[torch.float16], s3 * 2
    elif how == "shape":  # planes and width swapped
        s1, s3 = s3, s1
    else:
        raise ValueError(how)
    body = FIELDS.pack(magic, ver, flags, key, code, s0, s1, s2, s3, ntok, plen, csum)
    return body + xxhash.xxh3_64_digest(body)


class Store:
    """One lower tier as an attacker and a test see it: config, rewrite, presence, count."""

    kind = "?"

    def lower(self) -> dict:
        raise NotImplementedError

    def rewrite(self, key: bytes, how: str) -> None:
        raise NotImplementedError

    def present(self, key: bytes) -> bool:
        raise NotImplementedError

    def refused(self, eng: CacheEngine) -> float:
        raise NotImplementedError


class RedisStore(Store):
    kind = "redis"

    def __init__(self, server) -> None:
        self.server = server
        self.prefix = f"bad{uuid.uuid4().hex[:8]}"

    def lower(self) -> dict:
        return {"remote_url": self.server.url, "remote_timeout": 5.0,
                "remote_key_prefix": self.prefix}

    def _rk(self, key: bytes) -> bytes:
        return f"{self.prefix}:{key.hex()}".encode()

    def rewrite(self, key: bytes, how: str) -> None:
        with self.server.client() as c:
            raw = c.get(self._rk(key))
            c.set(self._rk(key), rewrite_header(raw[:HEADER_SIZE], how) + raw[HEADER_SIZE:])

    def present(self, key: bytes) -> bool:
        with self.server.client() as c:
            return bool(c.exists(self._rk(key)))

    def refused(self, eng: CacheEngine) -> float:
        return eng.stats().get("redis.corrupt", 0)


class DiskStore(Store):
    kind = "disk"

    def __init__(self, path: Path) -> None:
        self.path = path

    def lower(self) -> dict:
        return {"local_disk": str(self.path)}

    def _file(self, key: bytes) -> Path | None:
        found = list(self.path.glob(f"{key.hex()}.*.kv"))
        return found[0] if found else None

    def rewrite(self, key: bytes, how: str) -> None:
        f = self._file(key)
        with open(f, "r+b") as fh:
            head = fh.read(HEADER_SIZE)
            fh.seek(0)
            fh.write(rewrite_header(head, how))

    def present(self, key: bytes) -> bool:
        return self._file(key) is not None

    def refused(self, eng: CacheEngine) -> float:
        return eng.stats().get("disk.checksum_failures", 0)


class DaemonStore(Store):
    """A tenant with write access to the namespace replaces the value with a chunk of the
    same bytes and another shape (the daemon re-encodes headers from what it is sent)."""

    kind = "server"

    def __init__(self, daemon: DaemonProc) -> None:
        self.url = f"{daemon.url}?ns=bad{uuid.uuid4().hex[:8]}"

    def lower(self) -> dict:
        return {"remote_url": self.url, "remote_timeout": 10.0}

    def _tier(self):
        from lmc.memory.pool import MemoryPool
        from lmc.storage.tier import create_backend

        cfg = CacheConfig(remote_url=self.url, remote_timeout=10.0)
        return create_backend(self.url, cfg, MemoryPool(16 << 20, pin_memory="false"))

    def rewrite(self, key: bytes, how: str) -> None:
        t = self._tier()
        try:
            (got,) = t.get([key])
            s = list(got.shape)
            dtype = torch.float16 if how == "dtype" else got.dtype
            shape = [s[0], s[1], s[2], s[3] * 2] if how == "dtype" else [s[0], s[3], s[2], s[1]]
            forged = t.pool.allocate(shape, dtype, s[2])
            forged.byte_view()[:] = got.byte_view()
            got.release()
            assert t.delete([key]) == 1 and t.put([key], [forged]) == 1
            forged.release()
        finally:
            t.close()
            t.pool.close()

    def present(self, key: bytes) -> bool:
        t = self._tier()
        try:
            return t.contains([key]) == [True]
        finally:
            t.close()
            t.pool.close()

    def refused(self, eng: CacheEngine) -> float:
        return eng.stats().get("server.corrupt", 0)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProc(tmp_path_factory.mktemp("daemon"), ["--size", "64MiB"])
    d.start()
    yield d
    d.kill()


@pytest.fixture
def store(request, tmp_path, redis_server, daemon):  # noqa: F811
    kind = request.param
    if kind == "redis":
        return RedisStore(redis_server)
    if kind == "disk":
        return DiskStore(tmp_path / "disk")
    return DaemonStore(daemon)


# ------------------------------------------------------------------------ the engine
def _wire(eng: CacheEngine) -> CacheEngine:
    """What ``CacheEngine.__init__`` is to do once built: its tiers learn its geometry."""
    assert expect_geometry(eng.storage.lower, Geometry.of(eng.spec, CHUNK)) == len(
        eng.storage.lower)
    return eng


def _engine(store: Store, **kw) -> CacheEngine:
    kw = {"chunk_size": CHUNK, "local_cpu_size": "4MiB", "save_unfull_chunk": True,
          "debug_leaks": True, **store.lower(), **kw}
    return _wire(CacheEngine(CacheConfig(**kw), SPEC, "m"))


def _layerwise(eng: CacheEngine, toks, dst) -> int:
    rt = eng.retrieve_layer(toks, dst, SLOTS)
    try:
        for layer in range(LAYERS):
            rt.load(layer)
    except LoadError:
        pass
    return rt.close()


def _eventually(cond, what: str, timeout: float = 10.0) -> None:
    """A layer-wise read counts and deletes from its own thread, after the retrieve returned."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.01)


@pytest.mark.parametrize("how", ["dtype", "shape"])
@pytest.mark.parametrize("store,path", [("redis", "whole"), ("redis", "layered"),
                                        ("disk", "whole"), ("disk", "layered"),
                                        ("server", "whole")], indirect=["store"])
def test_a_rewritten_header_is_counted_deleted_and_missed_on_every_read_path(store, path, how):
    src, toks = _caches(), random_tokens(N)
    with _engine(store) as eng:
        assert eng.store(toks, src, SLOTS) == N and eng.flush(10)
        key = eng.db.keys(toks)[0]
    store.rewrite(key, how)
    with _engine(store) as eng:
        dst = _caches(zeros=True)
        got = eng.retrieve(toks, dst, SLOTS) if path == "whole" else _layerwise(eng, toks, dst)
        assert got == 0, "a chunk of another shape was served"
        _eventually(lambda: store.refused(eng) == 1 and not store.present(key),
                    f"{store.kind} {path}: the bad value was not counted and deleted "
                    f"(refused={store.refused(eng)}, present={store.present(key)})")
        assert not eng.contains_chunks(toks)[0], "the bad chunk reached L1"
        # the writer's next store is not skipped as 'present': the value is back, right
        assert eng.store(toks, src, SLOTS) >= CHUNK and eng.flush(10)
        assert store.present(key)
    with _engine(store) as eng:
        dst = _caches(zeros=True)
        got = eng.retrieve(toks, dst, SLOTS) if path == "whole" else _layerwise(eng, toks, dst)
        assert got == N
        assert_bits_equal(token_kv(SPEC, dst, SLOTS), token_kv(SPEC, src, SLOTS), store.kind)
        assert store.refused(eng) == 0


@pytest.mark.parametrize("store", ["server"], indirect=True)
def test_a_daemon_value_larger_than_any_chunk_is_refused_before_allocating(store):
    """A forged 5 MiB "chunk" under a key of a 16 KiB-chunk engine with a 4 MiB pool would
    evict all of L1 to make room for it (and still not fit): refused from its header,
    counted, a miss; L1 keeps every chunk it had."""
    src, toks = _caches(), random_tokens(N)
    with _engine(store) as eng:
        assert eng.store(toks, src, SLOTS) == N and eng.flush(10)
        key = eng.db.keys(toks)[0]
    t = DaemonStore._tier(store)
    try:
        big = t.pool.allocate((LAYERS, 2, 5120, 32), torch.float32, 5120)
        big.byte_view()[:] = b"\x01" * big.nbytes
        assert t.delete([key]) == 1 and t.put([key], [big]) == 1
        big.release()
    finally:
        t.close()
        t.pool.close()
    with _engine(store) as eng:
        other = [(t * 7 + 1) % 30000 for t in toks]
        assert eng.store(other, src, SLOTS) == N
        held = eng.contains_chunks(other).sum()
        assert eng.retrieve(toks, _caches(zeros=True), SLOTS) == 0
        assert store.refused(eng) == 1
        assert eng.contains_chunks(other).sum() == held, "L1 was evicted for a forged value"


@pytest.mark.parametrize("store", ["disk"], indirect=True)
def test_the_engine_gives_its_tiers_its_geometry(store):
    cfg = CacheConfig(chunk_size=CHUNK, local_cpu_size="4MiB", **store.lower())
    with CacheEngine(cfg, SPEC, "m") as eng:
        assert [t.expected_geometry for t in eng.storage.lower] == [Geometry.of(SPEC, CHUNK)]


# ------------------------------------------------------------------------ properties
def test_geometry_names_what_differs():
    g = Geometry.of(SPEC, CHUNK)
    g.check((LAYERS, 2, CHUNK, 32), torch.float32)
    g.check((LAYERS, 2, 1, 32), torch.float32)
    with pytest.raises(CorruptValue, match=r"\[4, 32, 16, 2\] float32.*\[4, 2, 1\.\.16, 32\] "
                                           r"float32"):
        g.check((LAYERS, 32, CHUNK, 2), torch.float32)
    with pytest.raises(CorruptValue, match="float16"):
        g.check((LAYERS, 2, CHUNK, 64), torch.float16)
    with pytest.raises(CorruptValue):
        g.check((LAYERS, 2, CHUNK + 1, 32), torch.float32)
    with pytest.raises(CorruptValue):
        g.check((LAYERS, 2, 0, 32), torch.float32)
    assert g.max_bytes == SPEC.chunk_nbytes(CHUNK)


@settings(max_examples=300, deadline=None)
@given(st.tuples(*[st.integers(0, 70)] * 4), st.sampled_from(sorted(DTYPE_CODES, key=str)))
def test_geometry_accepts_exactly_the_engines_chunks(shape, dtype):
    g = Geometry.of(SPEC, CHUNK)
    want = (shape[0], shape[1], shape[3]) == (LAYERS, 2, 32) and 1 <= shape[2] <= CHUNK \
        and dtype == torch.float32
    try:
        g.check(shape, dtype)
        ok = True
    except CorruptValue:
        ok = False
    assert ok == want


FUZZ_FIELDS = ["ver", "flags", "code", "s0", "s1", "s2", "s3", "ntok", "plen", "csum"]


def _fuzz_store(kind: str, server, root: Path) -> Store:
    if kind == "redis":
        return RedisStore(server)
    return DiskStore(root / uuid.uuid4().hex)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _consistent_rewrite(data, plen: int) -> dict:
    """Header fields of another chunk of the same payload length: a dtype, a shape whose
    product fills the payload exactly, the token count equal to the shape's (what passes
    every check ``decode_header`` makes, so only the geometry can refuse it)."""
    dtype = data.draw(st.sampled_from(sorted(DTYPE_CODES, key=str)), "dtype")
    left = plen // dtype.itemsize
    dims = []
    for i in range(3):
        d = data.draw(st.sampled_from(_divisors(left)), f"s{i}")
        dims.append(d)
        left //= d
    dims.append(left)
    return {"code": DTYPE_CODES[dtype], "s0": dims[0], "s1": dims[1], "s2": dims[2],
            "s3": dims[3], "ntok": dims[2]}


def _rewrite_fields(store: Store, key: bytes, data) -> bool:
    """Rewrite the stored header: either one field set to anything, or a whole consistent
    other chunk; the header checksum recomputed. Returns whether the header changed."""
    names = ["magic", "ver", "flags", "key", "code", "s0", "s1", "s2", "s3", "ntok", "plen",
             "csum"]
    if isinstance(store, RedisStore):
        with store.server.client() as c:
            raw = c.get(store._rk(key))
    else:
        raw = store._file(key).read_bytes()
    parts = dict(zip(names, FIELDS.unpack(raw[:FIELDS.size])))
    if data.draw(st.booleans(), "consistent"):
        parts.update(_consistent_rewrite(data, parts["plen"]))
    else:
        parts[data.draw(st.sampled_from(FUZZ_FIELDS), "field")] = data.draw(
            st.integers(0, 255), "value")
    body = FIELDS.pack(*parts.values())
    head = body + xxhash.xxh3_64_digest(body)
    if isinstance(store, RedisStore):
        with store.server.client() as c:
            c.set(store._rk(key), head + raw[HEADER_SIZE:])
    else:
        with open(store._file(key), "r+b") as fh:
            fh.write(head)
    return body != raw[:FIELDS.size]


@pytest.mark.parametrize("kind", ["redis", "disk"])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_consistent_header_rewrite_is_served_exactly_or_refused_and_deleted(
        redis_server, tmp_path, kind, data):  # noqa: F811
    """Fuzz: a stored value's header rewritten (one field set to anything, or a whole other
    chunk of the same length: dtype, shape, token count), its checksum recomputed; the whole
    and the layer-wise read either serve the original bytes (a rewrite that changed nothing
    or only ``flags``, which nothing reads) or miss, and then the value is counted and gone.
    Never other KV, never a miss that stays."""
    store = _fuzz_store(kind, redis_server, tmp_path)
    src, toks = _caches(), random_tokens(N)
    with _engine(store) as eng:
        assert eng.store(toks[:CHUNK], src, SLOTS[:CHUNK]) == CHUNK and eng.flush(10)
        key = eng.db.keys(toks[:CHUNK])[0]
    _rewrite_fields(store, key, data)
    for path in ("whole", "layered"):
        with _engine(store) as eng:
            dst = _caches(zeros=True)
            if path == "whole":
                got = eng.retrieve(toks[:CHUNK], dst, SLOTS[:CHUNK])
            else:
                rt = eng.retrieve_layer(toks[:CHUNK], dst, SLOTS[:CHUNK])
                try:
                    for layer in range(LAYERS):
                        rt.load(layer)
                except LoadError:
                    pass
                got = rt.close()
            if got:
                assert got == CHUNK
                assert_bits_equal(token_kv(SPEC, dst, SLOTS[:CHUNK]),
                                  token_kv(SPEC, src, SLOTS[:CHUNK]), "served")
                continue
            _eventually(lambda e=eng: store.refused(e) == 1 and not store.present(key),
                        f"{kind}: not counted and deleted on the {path} read")
            break  # deleted: the layer-wise read has nothing left to refuse


def test_decode_then_geometry_is_what_every_tier_checks():
    """The rewrites above pass ``decode_header`` (so only the geometry can catch them)."""
    from lmc.storage.serde import encode_header

    payload = os.urandom(LAYERS * 2 * CHUNK * 32 * 4)
    head = encode_header(b"k" * 16, (LAYERS, 2, CHUNK, 32), torch.float32, CHUNK, payload)
    for how in ("dtype", "shape"):
        h = decode_header(rewrite_header(head, how), b"k" * 16)
        with pytest.raises(CorruptValue):
            Geometry.of(SPEC, CHUNK).check(h.shape, h.dtype)
