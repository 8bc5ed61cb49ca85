"""The quality gate: a lossy codec stores a model's KV only with a passing ``lmc quality``
verdict (feature ``kv-codec``) for (weights identity, dtype, codec and parameters); a failing,
foreign, unsigned (under a secret), badly signed or malformed verdict keeps the tier exact.
Through a real engine: two CacheEngines sharing a disk directory, the second loading what the
first stored."""

import dataclasses
import json

import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.quality.verdict import Measurement, Thresholds, Verdict, VerdictStore
from lmc.storage.integrity import Integrity
from lmc.storage.kvcodecs.feature import CodecSettings, canonical_setting
from tests.kvutil import make_caches, random_tokens, spec_for, token_kv

SECRET = "gate-test-secret-0123456789abcdef"
OTHER_SECRET = "another-secret-0123456789abcdef0"
SETTING = "int4-kivi,group=32"
LAYOUT = "sglang_mha"
N = 32
THRESHOLDS = Thresholds(kl_mean_max=0.05, top1_min=0.95, ppl_change_max=0.02,
                        qa_agreement_min=0.9)
GOOD = Measurement(kl_mean=0.01, kl_max=0.05, top1=0.99, answer_tokens=100, ppl_exact=13.0,
                   ppl_served=13.1, ppl_change=0.0077, text_tokens=200, qa_identical=1.0, qa_agreement=1.0,
                   qa_correct_exact=7, qa_correct_served=7, questions=8,
                   kv_error=[0.01], seconds=1.0)
BAD = dataclasses.replace(GOOD, kl_mean=0.3, top1=0.8)


def verdict(passed=True, model="test-model", dtype="float32", setting=SETTING):
    m = GOOD if passed else BAD
    return Verdict(model, dtype, "kv-codec", setting, passed, THRESHOLDS.failures(m),
                   THRESHOLDS, m)


def _fill(caches, gen) -> None:
    """KV-like values (make_caches' random bits hold NaNs, which a codec stores exact)."""
    if isinstance(caches, torch.Tensor):
        caches.copy_(torch.randn(caches.shape, generator=gen))
    else:
        for c in caches:
            _fill(c, gen)


def run(tmp_path, secret=None, model_dir=None, **tier):
    """Store N tokens through engine A (write-through to the coded disk tier), load them
    with engine B over the same directory; returns (stored KV, loaded KV, B's tier stats)."""
    src = make_caches(LAYOUT, blocks=16, block_size=4, zeros=True)
    _fill(src, torch.Generator().manual_seed(1))
    dst = make_caches(LAYOUT, blocks=16, block_size=4, zeros=True)
    spec = spec_for(LAYOUT, src)
    entry = {"backend": "disk", "path": str(tmp_path / "disk"), "codec": "int4-kivi", **tier}
    if model_dir is None:
        entry.setdefault("verdicts", str(tmp_path / "verdicts"))
    cfg = CacheConfig(chunk_size=16, local_cpu_size="8MiB", tiers=["memory", entry],
                      integrity_secret=secret)
    slots = torch.arange(N)
    toks = random_tokens(N)
    kw = {"model_dir": model_dir} if model_dir else {}
    with CacheEngine(cfg, spec, model_id="test-model", **kw) as a:
        assert a.store(toks, src, slots) == N
        assert a.flush(30)
    with CacheEngine(cfg, spec, model_id="test-model", **kw) as b:
        assert b.retrieve(toks, dst, slots) == N
        stats = b.storage.lower[0].stats()
    return token_kv(spec, src, slots), token_kv(spec, dst, slots), stats


def test_a_passing_verdict_turns_the_codec_on(tmp_path):
    VerdictStore(tmp_path / "verdicts").write(verdict())
    stored, loaded, stats = run(tmp_path)
    assert stats["codec_active"] and stats["codec_stored_bytes_read"] > 0
    assert not torch.equal(stored, loaded), "a 4-bit codec gave back every bit"
    assert float((stored - loaded).abs().max()) < 0.5 * float(stored.abs().max())


def test_verdicts_next_to_the_checkpoint_by_default(tmp_path):
    model = tmp_path / "model"
    VerdictStore.next_to(model).write(verdict())
    _, _, stats = run(tmp_path, model_dir=model)
    assert stats["codec_active"]


@pytest.mark.parametrize("case", ["none", "failed", "other model", "other dtype",
                                  "other codec", "malformed"])
def test_without_a_passing_verdict_for_this_model_the_tier_stays_exact(tmp_path, case):
    store = VerdictStore(tmp_path / "verdicts")
    if case == "failed":
        store.write(verdict(passed=False))
    elif case in ("other model", "other dtype"):
        store.write({"other model": verdict(model="another-model"),
                     "other dtype": verdict(dtype="bfloat16")}[case])
    elif case == "other codec":  # a verdict for another group, renamed into this one's place
        store.write(verdict(setting="int4-kivi,group=16")).rename(
            store.path("kv-codec", SETTING, "float32"))
    elif case == "malformed":
        path = store.path("kv-codec", SETTING, "float32")
        path.parent.mkdir(parents=True)
        path.write_text('{"passed": true, "passed": true}')
    stored, loaded, stats = run(tmp_path)
    assert not stats["codec_active"]
    assert torch.equal(stored, loaded)


@pytest.mark.parametrize("signed", [None, OTHER_SECRET, SECRET])
def test_under_a_secret_only_a_verdict_it_signed_opens_the_gate(tmp_path, signed):
    pytest.importorskip("cryptography")
    VerdictStore(tmp_path / "verdicts", Integrity(signed) if signed else None).write(verdict())
    stored, loaded, stats = run(tmp_path, secret=SECRET)
    assert stats["codec_active"] == (signed == SECRET)
    assert torch.equal(stored, loaded) == (signed != SECRET)


def test_an_altered_signed_verdict_is_refused(tmp_path):
    pytest.importorskip("cryptography")
    path = VerdictStore(tmp_path / "verdicts", Integrity(SECRET)).write(verdict(passed=False))
    doc = json.loads(path.read_text())
    doc["passed"], doc["failed"], doc["measurement"] = True, [], dataclasses.asdict(GOOD)
    path.write_text(json.dumps(doc))
    stored, loaded, stats = run(tmp_path, secret=SECRET)
    assert not stats["codec_active"] and torch.equal(stored, loaded)


def test_gate_off_uses_the_codec_without_a_verdict(tmp_path):
    stored, loaded, stats = run(tmp_path, gate="off")
    assert stats["codec_active"] and not torch.equal(stored, loaded)


@pytest.mark.parametrize("spec,setting", [
    ("int4-kivi", "int4-kivi,group=32"), ("int4-kivi+zstd", "int4-kivi,group=32"),
    ({"name": "int4", "group": 64, "lossless": "lz4"}, "int4-kivi,group=64"),
    ("fp8", "fp8-e4m3"), ("int8", "int8")])
def test_one_canonical_setting_per_stored_form(spec, setting):
    """A lossless stage changes no value: one verdict covers the codec with and without it."""
    assert canonical_setting(spec) == setting
    assert CodecSettings().parse_setting(setting) == setting
    assert canonical_setting("int8", head_size=32) == "int8,head_size=32"


def test_lmc_quality_finds_the_feature_and_judges_what_a_tier_serves():
    from pathlib import Path

    from lmc.quality.feature import ModelUnderTest, PromptKV, load_feature
    from lmc.storage.kvcodecs.serve import served_kv
    from lmc.storage.kvcodecs.stage import parse_stage

    feature = load_feature("kv-codec")
    model = ModelUnderTest(Path("."), "m", torch.bfloat16, torch.device("cpu"), 2, 3, 8, 16,
                           64)
    feature.open(model)
    exact = torch.randn(2, 2, 40, 3, 8).to(torch.bfloat16)
    setting = feature.parse_setting("int4-kivi+zstd")
    served = feature.served_kv(PromptKV([1] * 41, [], exact), setting)
    assert served.shape == exact.shape and served.dtype == exact.dtype
    assert torch.equal(served, served_kv(exact, parse_stage("int4-kivi", head_size=8), 16))
    assert feature.preference("int4-kivi,group=32") < feature.preference("fp8-e4m3")


def test_lmc_quality_settings_keep_a_codecs_parameters_together():
    from lmc.quality.cli import settings_list
    from lmc.quality.feature import load_feature

    got = settings_list(load_feature("kv-codec"), "int4-kivi,group=64,fp8,int8,head_size=32")
    assert got == ["int4-kivi,group=64", "fp8-e4m3", "int8,head_size=32"]
    assert settings_list(load_feature("kv-cast"), "bf16,fp16") == ["bfloat16", "float16"]
