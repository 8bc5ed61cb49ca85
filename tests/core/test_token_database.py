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
