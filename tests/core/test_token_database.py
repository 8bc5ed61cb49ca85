"""Content addressing: chained, namespaced, input-type independent, stable across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash

from lmc.token_database import ChunkedTokenDatabase, namespace_digest
from tests.requirements import missing, under_ci

NS = namespace_digest("llama", {"layers": 2}, 0, 1, 4)


def test_chain_definition():
    db = ChunkedTokenDatabase(4, True, NS)
    toks = [1, 2, 3, 4, 5, 6]
    k0 = xxhash.xxh3_128_digest(NS + np.array([1, 2, 3, 4], "<u4").tobytes())
    k1 = xxhash.xxh3_128_digest(k0 + np.array([5, 6], "<u4").tobytes())
    assert db.keys(toks) == [k0, k1]
    assert db.process_tokens(toks) == [(0, 4, k0), (4, 6, k1)]
    assert ChunkedTokenDatabase(4, False, NS).process_tokens(toks) == [(0, 4, k0)]


def test_input_types_agree():
    db = ChunkedTokenDatabase(16, True, NS)
    toks = list(range(1000, 1100))
    ref = db.keys(toks)
    for form in (np.array(toks, np.int64), np.array(toks, np.int32), np.array(toks, np.uint32),
                 torch.tensor(toks), torch.tensor(toks, dtype=torch.int32), tuple(toks)):
        assert db.keys(form) == ref


def test_keys_identify_the_whole_prefix():
    db = ChunkedTokenDatabase(4, True, NS)
    a = db.keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = db.keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1], "same chunk after a different prefix must get a different key"
    assert db.keys([1, 2, 3, 4, 5, 6, 7, 8, 9])[:2] == a


@pytest.mark.parametrize("field,value", [
    ("model", "qwen"), ("kv", {"layers": 3}), ("rank", 1), ("chunk", 8), ("tenant", "t1"),
])
def test_namespace_fields_give_disjoint_keys(field, value):
    args = {"model": "llama", "kv": {"layers": 2}, "rank": 0, "chunk": 4, "tenant": None}
    args[field] = value
    ns = namespace_digest(args["model"], args["kv"], args["rank"], 2, args["chunk"],
                          args["tenant"])
    base = namespace_digest("llama", {"layers": 2}, 0, 2, 4, None)
    assert ns != base
    toks = list(range(32))
    assert set(ChunkedTokenDatabase(4, True, ns).keys(toks)).isdisjoint(
        ChunkedTokenDatabase(4, True, base).keys(toks))


def test_bad_tokens_are_named():
    db = ChunkedTokenDatabase(4)
    with pytest.raises(TypeError, match="integer tensor"):
        db.keys(torch.zeros(4))
    with pytest.raises(ValueError, match="1-D"):
        db.keys(np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        db.keys(np.array([1, -1]))
    with pytest.raises(ValueError, match=r"token ids"):
        db.keys([1, 2**40])
    with pytest.raises(TypeError, match="got str"):
        db.keys("abc")
    with pytest.raises(ValueError, match="tp_rank"):
        namespace_digest("m", {}, 2, 2)


def test_keys_equal_across_processes_with_different_hash_seeds():
    code = ("from lmc.token_database import ChunkedTokenDatabase, namespace_digest;"
            "ns = namespace_digest('m', {'layers': 4, 'dtype': 'bfloat16'}, 1, 2, 16, 't');"
            "print(b''.join(ChunkedTokenDatabase(16, True, ns).keys(list(range(100)))).hex())")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout)
    assert len(outs) == 1 and len(next(iter(outs)).strip()) == 7 * 32


# ------------------------------------------------------- list packing and request keys
def test_list_packing_native_and_fallback_agree():
    from lmc import token_database as tdb

    if under_ci():  # CI builds the C helper: its absence is a build bug
        assert tdb._native_u32le is not None, "lmc._tokens was not built by pip install -e ."
    rng = np.random.default_rng(3)
    toks = [int(x) for x in rng.integers(0, 2**32, 1000, dtype=np.uint64)] + [0, 2**32 - 1]
    want = np.array(toks, dtype="<u4").tobytes()
    assert tdb._list_u32le(toks) == want
    assert tdb._list_u32le(tuple(toks)) == want
    assert tdb.tokens_to_bytes(toks) == want
    if tdb._native_u32le is not None:
        assert tdb._native_u32le(toks) == want
        assert tdb._native_u32le(tuple(toks)) == want
        assert tdb._native_u32le([]) == b""


def test_native_chain_equals_python_chain(monkeypatch):
    from lmc import token_database as tdb

    if tdb._native_chain is None:
        missing("lmc._tokens (the C helper) is not built: pip install -e . builds it")
    rng = np.random.default_rng(5)
    toks = rng.integers(0, 150_000, 1000)
    for unfull in (True, False):
        db = ChunkedTokenDatabase(16, unfull, NS)
        for n in (0, 1, 15, 16, 17, 1000):
            native = db.keys(toks[:n])
            with monkeypatch.context() as m:
                m.setattr(tdb, "_native_chain", None)
                assert native == db.keys(toks[:n]), (unfull, n)
    with pytest.raises(ValueError, match="past the data"):
        tdb._native_chain(NS, b"1234", 4, 8, xxhash.xxh3_128_digest)
    with pytest.raises(TypeError, match="must return bytes"):
        tdb._native_chain(NS, b"1234", 4, 4, lambda b: 1)
    with pytest.raises(ValueError, match="another size"):
        tdb._native_chain(NS, b"12345678", 4, 8, lambda b: b"short")


@pytest.mark.parametrize("bad, err, where", [
    ([1, 2, -1], ValueError, "token 2 is -1"),
    ([2**32], ValueError, "token 0 is 4294967296"),
    ([0, 1.5], TypeError, "token 1"),
    ([0, "7"], TypeError, "token 1"),
])
def test_list_packing_names_the_bad_token(bad, err, where):
    from lmc import token_database as tdb

    packers = [tdb._list_u32le] + ([tdb._native_u32le] if tdb._native_u32le else [])
    for pack in packers:
        with pytest.raises(err, match=where):
            pack(bad)


def test_request_keys_extend_and_match_full_hash():
    rng = np.random.default_rng(4)
    toks = [int(x) for x in rng.integers(0, 150_000, 704)]
    for unfull in (True, False):
        db = ChunkedTokenDatabase(16, unfull, NS)
        rk = db.request_keys()
        # grow the sequence in uneven steps, as a scheduler sees a prompt then decode tokens
        n = 0
        for step in [1, 15, 16, 17, 100, 3, 256, 1, 295]:
            n += step
            assert rk.keys(toks[:n]) == db.keys(toks[:n]), (unfull, n)
            assert rk.hashed_tokens == n // 16 * 16
        # a tensor of the same ids continues the same chain
        assert rk.keys(torch.tensor(toks)) == db.keys(toks)


def test_request_keys_hash_only_new_chunks(monkeypatch):
    from lmc import token_database as tdb

    db = ChunkedTokenDatabase(16, True, NS)
    rk = db.request_keys()
    toks = list(range(1, 1001))
    rk.keys(toks[:800])
    packed: list[int] = []
    real = tdb.tokens_to_bytes
    monkeypatch.setattr(tdb, "tokens_to_bytes", lambda t: packed.append(len(t)) or real(t))
    got = rk.keys(toks)
    monkeypatch.undo()
    assert got == db.keys(toks)
    # the check of the last kept chunk (784..800), then only chunks 50..62 (new full
    # chunks: 800..992) and the 8-token tail were packed
    assert packed == [16, 192, 8]


def test_request_keys_serve_a_shorter_prefix_from_the_kept_keys(monkeypatch):
    from lmc import token_database as tdb

    db = ChunkedTokenDatabase(16, True, NS)
    rk = db.request_keys()
    toks = list(range(1, 1001))
    rk.keys(toks)
    packed: list[int] = []
    real = tdb.tokens_to_bytes
    monkeypatch.setattr(tdb, "tokens_to_bytes", lambda t: packed.append(len(t)) or real(t))
    got = rk.keys(toks[:520])  # a load cut inside the sequence seen
    monkeypatch.undo()
    assert got == db.keys(toks[:520]) and rk.restarts == 0
    assert packed == [16, 8], "only the checked chunk and the tail were packed"
    assert rk.hashed_tokens == 992, "the longer keys are kept for the next step"
    assert rk.keys(toks) == db.keys(toks)


def test_request_keys_restart_on_a_different_sequence():
    db = ChunkedTokenDatabase(16, True, NS)
    rk = db.request_keys()
    rk.keys(list(range(100)))
    other = list(range(500, 540))  # shorter and different
    assert rk.keys(other) == db.keys(other) and rk.restarts == 1
    longer = list(range(7, 300))  # longer and different (a reused request id)
    assert rk.keys(longer) == db.keys(longer) and rk.restarts == 2


def test_precomputed_keys_are_checked_against_the_prompt():
    db = ChunkedTokenDatabase(4, True, NS)
    toks = list(range(10))
    keys = db.keys(toks)
    assert db.process_tokens(toks, keys=keys) == db.process_tokens(toks)
    with pytest.raises(ValueError, match="2 precomputed keys for 10 tokens, expected 3"):
        db.process_tokens(toks, keys=keys[:2])
    with pytest.raises(ValueError, match="must be 16 bytes"):
        db.process_tokens(toks, keys=[b"x"] * 3)
    assert ChunkedTokenDatabase(4, False, NS).num_chunks(10) == 2 and db.num_chunks(10) == 3
