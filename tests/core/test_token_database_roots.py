"""Per-request key roots (lmc.token_database.request_tag / request_root): a request with a
LoRA adapter or a ``cache_salt`` chains its keys from a root of its own; a request with
neither keeps exactly the keys lmc always gave it (stored KV stays valid). The attacker's
view: no salt, adapter or crafted salt reaches another's keys, and a key gives no salt away."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from lmc.token_database import (
    KEY_BYTES,
    ChunkedTokenDatabase,
    RootedKeys,
    namespace_digest,
    request_root,
    request_tag,
)

CS = 16
NS = namespace_digest("m", {"layers": 2}, chunk_size=CS)
TOKENS = list(range(1000, 1000 + 5 * CS + 7))  # 5 chunks and a tail of 7


def reference_chain(namespace: bytes, tokens: list[int], cs: int) -> list[bytes]:
    """The chain as lmc has always keyed it, written out: xxh3_128(prev || uint32 LE)."""
    out, prev = [], namespace
    data = np.asarray(tokens, dtype="<u4").tobytes()
    for off in range(0, len(data), cs * 4):
        prev = xxhash.xxh3_128_digest(prev + data[off:off + cs * 4])
        out.append(prev)
    return out


def db() -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(CS, True, NS)


def keys_for(lora: str | None = None, salt: str | None = None,
             tokens: list[int] = TOKENS) -> list[bytes]:
    d = db()
    return d.keys(tokens, root=request_root(d.namespace, request_tag(lora, salt)))


def test_no_tag_keeps_todays_keys_exactly():
    want = reference_chain(NS, TOKENS, CS)
    d = db()
    assert request_tag(None, None) is None
    assert request_root(NS, None) == NS
    assert d.keys(TOKENS) == want
    assert d.keys(TOKENS, root=None) == want
    assert d.keys(TOKENS, root=NS) == want and not isinstance(d.keys(TOKENS, root=NS),
                                                                RootedKeys)
    assert keys_for() == want
    rk = d.request_keys()
    assert rk.keys(TOKENS[:40]) == reference_chain(NS, TOKENS[:40], CS)  # a partial tail
    assert rk.keys(TOKENS) == want
    assert not isinstance(rk.keys(TOKENS), RootedKeys)


def test_a_tagged_chain_is_the_same_chain_from_its_root():
    root = request_root(NS, request_tag("adapter-x", "salt"))
    got = db().keys(TOKENS, root=root)
    assert got == reference_chain(root, TOKENS, CS)
    assert isinstance(got, RootedKeys) and got.root == root
    # the incremental keys agree with the one-shot ones at every length
    rk = db().request_keys(root)
    for n in (3, CS, CS + 1, 3 * CS, len(TOKENS)):
        part = rk.keys(TOKENS[:n])
        assert part == reference_chain(root, TOKENS[:n], CS), n
        assert isinstance(part, RootedKeys)
    assert rk.keys(TOKENS) == got


VARIANTS = {
    "base": (None, None),
    "salt A": (None, "tenant-a"),
    "salt B": (None, "tenant-b"),
    "salt A, one byte off": (None, "tenant-`"),
    "empty salt": (None, ""),
    "lora X": ("x", None),
    "lora Y": ("y", None),
    "lora X + salt A": ("x", "tenant-a"),
    # field boundaries: a name and a salt can never be read as another split
    "lora 'xS' + salt ''": ("xS", ""),
    "lora 'x' + salt 'S'": ("x", "S"),
    "salt 'xS'": (None, "xS"),
    "NUL salt": (None, "\0"),
    "two NULs": (None, "\0\0"),
    "separators": (None, "a|b\n\t:=,;"),
    "long unicode": (None, "ñ€𝄞" * 50_000),
    "lone surrogate": (None, "\ud800"),
}


def test_no_two_tags_share_any_key_and_none_shares_the_plain_chain():
    """Every pair of variants: disjoint key sets (not only different first keys), so no
    chunk of one is ever a hit for the other; and no tagged key equals any plain key of the
    same tokens at any chunk (a salted prefix is never the base model's)."""
    sets = {name: set(keys_for(*v)) for name, v in VARIANTS.items()}
    for a, b in itertools.combinations(sets, 2):
        assert not sets[a] & sets[b], f"{a} and {b} share keys"
    plain = set(reference_chain(NS, TOKENS, CS))
    # the plain chains of every prefix and every shift of the tokens too
    for shift in range(0, CS):
        plain |= set(reference_chain(NS, TOKENS[shift:], CS))
    for name, keys in sets.items():
        if name != "base":
            assert not keys & plain, name


def test_same_tag_same_keys_in_every_database_and_process_form():
    a = keys_for("x", "tenant-a")
    assert a == keys_for("x", "tenant-a")
    root = request_root(NS, request_tag("x", "tenant-a"))
    assert db().keys(torch.tensor(TOKENS), root=root) == a
    assert db().keys(np.asarray(TOKENS, dtype=np.int64), root=root) == a


def test_the_root_depends_on_the_namespace():
    """Another model, rank or tenant: the same salt gives other keys (the namespace still
    separates everything it separated)."""
    tag = request_tag(None, "tenant-a")
    other = namespace_digest("m", {"layers": 2}, tp_rank=1, tp_size=2, chunk_size=CS)
    assert request_root(NS, tag) != request_root(other, tag)
    assert request_root(NS, tag) not in (NS, other)


def test_the_salt_is_not_in_any_key_byte():
    """A key is a digest: the salt's bytes appear in no tag, root or key (it is never stored
    or sent), and the tag is the same size for any salt."""
    salt = "SECRET-salt-0123456789abcdef" * 4
    tag = request_tag(None, salt)
    root = request_root(NS, tag)
    keys = db().keys(TOKENS, root=root)
    assert tag is not None and len(tag) == KEY_BYTES == len(root)
    blob = tag + root + b"".join(keys)
    for piece in (salt.encode()[i:i + 8] for i in range(0, len(salt), 8)):
        assert piece not in blob


@pytest.mark.parametrize(("lora", "salt", "error", "match"), [
    (None, b"bytes-salt", TypeError, "cache_salt must be a string or None, got bytes"),
    (None, 7, TypeError, "cache_salt must be a string or None, got int"),
    (42, None, TypeError, "LoRA adapter's name must be a string or None, got int"),
    ("", None, ValueError, "LoRA adapter's name must not be empty"),
])
def test_bad_fields_are_named(lora, salt, error, match):
    with pytest.raises(error, match=match):
        request_tag(lora, salt)


def test_bad_roots_are_refused():
    with pytest.raises(ValueError, match="16 bytes, got 3"):
        request_root(NS, b"abc")
    with pytest.raises(ValueError, match="key root must be 16 bytes"):
        db().request_keys(b"short")


def test_a_huge_salt_is_hashed_not_kept():
    """Any length is accepted (it is hashed once, never stored): 8 MiB of salt gives a
    16-byte tag like any other."""
    tag = request_tag(None, "s" * (8 << 20))
    assert tag is not None and len(tag) == KEY_BYTES
    assert tag != request_tag(None, "s" * ((8 << 20) - 1))


_field = st.one_of(st.none(), st.text(max_size=40))


@settings(max_examples=200, deadline=None)
@given(a=st.tuples(_field, _field), b=st.tuples(_field, _field),
       cut=st.integers(min_value=0, max_value=len(TOKENS)))
def test_keys_equal_exactly_when_the_fields_do(a, b, cut):
    """Against the plain model "two requests share keys iff their (LoRA, salt) are equal":
    any two field pairs (names never empty), whole prompts and a request grown in two
    steps (RequestKeys), and no tagged chain ever meets the plain one."""
    a = (a[0] or None, a[1])
    b = (b[0] or None, b[1])
    ka, kb = keys_for(*a), keys_for(*b)
    plain = reference_chain(NS, TOKENS, CS)
    if a == b:
        assert ka == kb
    else:
        assert not set(ka) & set(kb)
    for fields, keys in ((a, ka), (b, kb)):
        if fields == (None, None):
            assert keys == plain
        else:
            assert not set(keys) & set(plain)
        d = db()
        rk = d.request_keys(request_root(d.namespace, request_tag(*fields)))
        rk.keys(TOKENS[:cut])
        assert list(rk.keys(TOKENS)) == keys
