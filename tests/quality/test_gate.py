"""The gate turns a lossy KV feature on only where a verdict passed for these weights, this
dtype, this feature and a setting that covers the one asked for; anything else is off, with
one line saying why (a warning when a verdict was there but could not be used)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmc.blend.setting import BlendRatios
from lmc.quality.cast import CastFeature
from lmc.quality.gate import decide
from lmc.quality.verdict import VerdictStore
from lmc.storage.integrity import Integrity
from tests.quality.helpers import MODEL, verdict

BLEND = BlendRatios()


@pytest.fixture
def store(tmp_path: Path) -> VerdictStore:
    return VerdictStore(tmp_path / "lmc_quality")


def test_no_verdict_is_off(store: VerdictStore) -> None:
    d = decide(store, BLEND, MODEL, "float32")
    assert not d.on and not d.warn and "no verdict for blend on float32" in d.why


def test_a_passing_verdict_turns_it_on_at_its_setting(store: VerdictStore) -> None:
    store.write(verdict("0.15"))
    d = decide(store, BLEND, MODEL, "float32")
    assert d.on and d.setting == "0.15" and d.verdict == store.path("blend", "0.15", "float32")
    assert decide(store, BLEND, MODEL, "float32", "0.15").setting == "0.15"


def test_a_failing_verdict_keeps_it_off(store: VerdictStore) -> None:
    store.write(verdict("0.15", top1=0.9, ppl_change=0.05))
    d = decide(store, BLEND, MODEL, "float32")
    assert not d.on and not d.warn
    assert "failed (top-1 0.900 < 0.97; perplexity +5.0% > +1.0%)" in d.why
    assert not decide(store, BLEND, MODEL, "float32", "0.15").on


def test_foreign_weights_dtype_feature_or_setting_keep_it_off(store: VerdictStore) -> None:
    store.write(verdict("0.15", model_id="model@ffffffffffffffff"))
    d = decide(store, BLEND, MODEL, "float32")
    assert not d.on and "is for model@ffffffffffffffff, not " + MODEL in d.why
    store.write(verdict("0.15", dtype="bfloat16"))  # passing, for bf16 KV only
    assert not decide(store, BLEND, MODEL, "float32").on
    assert decide(store, BLEND, "model@ffffffffffffffff", "float32").on
    assert decide(store, BLEND, MODEL, "bfloat16").on
    store.write(verdict("bfloat16", feature="kv-cast"))  # another feature's pass
    assert not decide(store, BLEND, MODEL, "float32").on
    assert decide(store, CastFeature(), MODEL, "float32").setting == "bfloat16"
    assert not decide(store, CastFeature(), MODEL, "float32", "float8_e4m3fn").on


def test_a_verdict_copied_under_another_key_is_a_warning_not_a_pass(
        store: VerdictStore) -> None:
    good = store.write(verdict("0.5"))
    fake = store.path("blend", "0", "float32")
    fake.write_bytes(good.read_bytes())
    d = decide(store, BLEND, MODEL, "float32", "0")
    assert not d.on and d.warn and str(fake) in d.why and "it is for blend/0.5/float32" in d.why
    good.unlink()
    assert not decide(store, BLEND, MODEL, "float32").on


def test_blending_ratios_cover_those_above_them(store: VerdictStore) -> None:
    """A verdict at ratio r vouches for more recompute, not for less; unasked, the smallest
    passing ratio below 1 is chosen (at 1 blending saves nothing)."""
    store.write(verdict("0", kl=0.3))
    store.write(verdict("0.15"))
    store.write(verdict("0.5"))
    store.write(verdict("1"))
    assert decide(store, BLEND, MODEL, "float32").setting == "0.15"
    d = decide(store, BLEND, MODEL, "float32", "0.3")
    assert d.setting == "0.3" and "passed at 0.15" in d.why
    d = decide(store, BLEND, MODEL, "float32", "0.05")
    assert not d.on and "covers blend at 0.05" in d.why and "passed: 0.15, 0.5, 1" in d.why
    d = decide(store, BLEND, MODEL, "float32", "0")
    assert not d.on and "failed (KL 0.3000 > 0.01)" in d.why
    for s in ("0", "0.15", "0.5"):
        store.path("blend", s, "float32").unlink()
    assert not decide(store, BLEND, MODEL, "float32").on  # only ratio 1 passed
    assert decide(store, BLEND, MODEL, "float32", "1").on


def test_with_a_secret_a_tampered_verdict_is_a_warning(tmp_path: Path) -> None:
    secret = Integrity("s" * 32)
    store = VerdictStore(tmp_path, secret)
    path = store.write(verdict("0.15", kl=0.3))
    doc = json.loads(path.read_text())
    assert not decide(store, BLEND, MODEL, "float32").warn  # failed: news, not a warning
    doc.update(passed=True, failed=[])
    doc["measurement"]["kl_mean"] = 0.01
    path.write_text(json.dumps(doc))
    d = decide(store, BLEND, MODEL, "float32")
    assert not d.on and d.warn and "does not verify" in d.why
    del doc["tag"]
    path.write_text(json.dumps(doc))
    d = decide(store, BLEND, MODEL, "float32")
    assert not d.on and d.warn and "unsigned" in d.why
    assert decide(VerdictStore(tmp_path), BLEND, MODEL, "float32").on  # no secret: a file
