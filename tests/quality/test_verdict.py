"""Verdict files: written atomically, read strictly, bound to their key, signed with a
secret when one is configured."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from lmc.quality.verdict import (
    MAX_VERDICT_BYTES,
    VerdictRefused,
    VerdictStore,
    read_verdict,
)
from lmc.storage.integrity import Integrity
from tests.quality.helpers import verdict

SECRET = Integrity("s" * 32)
OTHER = Integrity("t" * 32)


def test_a_verdict_round_trips_and_is_named_by_its_key(tmp_path: Path) -> None:
    store = VerdictStore(tmp_path / "v")
    v = verdict("0.15")
    path = store.write(v)
    assert path == tmp_path / "v" / "blend@0.15@float32.json"
    assert store.read("blend", "0.15", "float32") == v
    assert store.read("blend", "0.3", "float32") is None
    assert [p.name for p in (tmp_path / "v").iterdir()] == [path.name]  # no temporary left
    failing = verdict("0", kl=0.4)
    assert not failing.passed and failing.failed == ["KL 0.4000 > 0.01"]
    store.write(failing)
    entries = dict(store.entries("blend", "float32"))
    assert set(entries) == {path, tmp_path / "v" / "blend@0@float32.json"}


def test_a_file_under_another_key_is_refused(tmp_path: Path) -> None:
    """A verdict for one setting, dtype or feature copied under another's name would vouch
    for what was never measured."""
    store = VerdictStore(tmp_path)
    src = store.write(verdict("0.5"))
    for feature, setting, dtype in (("blend", "0", "float32"), ("blend", "0.5", "bfloat16"),
                                    ("kv-cast", "0.5", "float32")):
        dst = store.path(feature, setting, dtype)
        dst.write_bytes(src.read_bytes())
        with pytest.raises(ValueError, match="it is for blend/0.5/float32"):
            store.read(feature, setting, dtype)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format=1), "format 1, expected 2"),
    (lambda d: d.update(extra=1), "fields do not match"),
    (lambda d: d["measurement"].update(kl_mean="0.01"), "kl_mean must be a finite number"),
    (lambda d: d["measurement"].pop("top1"), "fields do not match"),
    (lambda d: d.update(passed="yes"), "passed must be true or false"),
    # passing figures under "passed: false", or the reverse, is not what lmc quality writes
    (lambda d: d.update(passed=False), "disagree with its own figures"),
    (lambda d: d["measurement"].update(kl_mean=3.0), "disagree with its own figures"),
])
def test_malformed_verdicts_are_named(tmp_path: Path, edit, message: str) -> None:
    store = VerdictStore(tmp_path)
    path = store.write(verdict("0.15"))
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        store.read("blend", "0.15", "float32")


def test_garbage_nesting_and_size_are_refused_by_name(tmp_path: Path) -> None:
    store = VerdictStore(tmp_path)
    path = store.path("blend", "0", "float32")
    path.write_bytes(b"\xff\x00 not json")
    with pytest.raises(ValueError, match=str(path)):
        store.read("blend", "0", "float32")
    path.write_text("[" * 200_000)
    with pytest.raises(ValueError, match="nested deeper than 32 levels"):
        store.read("blend", "0", "float32")
    path.write_text(" " * (MAX_VERDICT_BYTES + 1))
    with pytest.raises(ValueError, match=str(path)):
        store.read("blend", "0", "float32")


def test_with_a_secret_only_verdicts_it_signed_are_read(tmp_path: Path) -> None:
    signed = VerdictStore(tmp_path, SECRET)
    path = signed.write(verdict("0.15", kl=0.4))  # a failing one
    doc = json.loads(path.read_text())
    assert len(doc["tag"]) == 64 and not doc["passed"]
    assert signed.read("blend", "0.15", "float32") == verdict("0.15", kl=0.4)
    # re-indented: the tag covers the content, not the layout
    path.write_text(json.dumps(doc, indent=7, sort_keys=True))
    assert signed.read("blend", "0.15", "float32") is not None
    # edited to pass (figures and verdict consistent): the tag no longer verifies
    edited = asdict(verdict("0.15"))
    path.write_text(json.dumps({**edited, "tag": doc["tag"]}))
    with pytest.raises(VerdictRefused, match="does not verify"):
        signed.read("blend", "0.15", "float32")
    path.write_text(json.dumps(edited))
    with pytest.raises(VerdictRefused, match="unsigned"):
        signed.read("blend", "0.15", "float32")
    VerdictStore(tmp_path, OTHER).write(verdict("0.15"))
    with pytest.raises(VerdictRefused, match="does not verify"):
        signed.read("blend", "0.15", "float32")
    # without a secret, a signed verdict reads as any other
    assert VerdictStore(tmp_path).read("blend", "0.15", "float32") == verdict("0.15")


def test_names_that_cannot_key_a_verdict_are_refused(tmp_path: Path) -> None:
    store = VerdictStore(tmp_path)
    for bad in ("../x", "a b", "", "x" * 65):
        with pytest.raises(ValueError, match="cannot name a verdict"):
            store.path("blend", bad, "float32")
    with pytest.raises(ValueError, match="cannot name a verdict"):
        store.path("Blend/..", "0", "float32")
    assert read_verdict(store.write(verdict("0"))).setting == "0"
