"""The quality gate: a lossy codec stores a model's KV only with a passing verdict for
(weights identity, dtype, codec and parameters); a failing, foreign, unsigned (under a
secret), badly signed or malformed verdict keeps the tier exact. Through a real engine: two
CacheEngines sharing a disk directory, the second loading what the first stored."""

import json

import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.storage.integrity import Integrity
from lmc.storage.kvcodecs.gate import CodecVerdict, decide, verdict_path
from tests.kvutil import make_caches, random_tokens, spec_for, token_kv

SECRET = "gate-test-secret-0123456789abcdef"
OTHER_SECRET = "another-secret-0123456789abcdef0"
CODEC = "int4-kivi.g32.h8"  # the engine below: heads of 8
LAYOUT = "sglang_mha"
N = 32


def verdict(passed=True, model="test-model", dtype="float32", codec=CODEC):
    return CodecVerdict(model, dtype, codec, passed, {"kl_max": 0.05},
                        {"kl_mean": 0.01 if passed else 0.3})


def _fill(caches, gen) -> None:
    """KV-like values (make_caches' random bits hold NaNs, which a codec stores exact)."""
    if isinstance(caches, torch.Tensor):
        caches.copy_(torch.randn(caches.shape, generator=gen))
    else:
        for c in caches:
            _fill(c, gen)


def run(tmp_path, **tier):
    """Store N tokens through engine A (write-through to the coded disk tier), load them
    with engine B over the same directory; returns (stored KV, loaded KV, B's tier stats)."""
    src = make_caches(LAYOUT, blocks=16, block_size=4, zeros=True)
    _fill(src, torch.Generator().manual_seed(1))
    dst = make_caches(LAYOUT, blocks=16, block_size=4, zeros=True)
    spec = spec_for(LAYOUT, src)
    secret = tier.pop("secret", None)
    entry = {"backend": "disk", "path": str(tmp_path / "disk"), "codec": "int4-kivi",
             "verdicts": str(tmp_path / "verdicts"), **tier}
    cfg = CacheConfig(chunk_size=16, local_cpu_size="8MiB", tiers=["memory", entry],
                      integrity_secret=secret)
    slots = torch.arange(N)
    toks = random_tokens(N)
    with CacheEngine(cfg, spec, model_id="test-model") as a:
        assert a.store(toks, src, slots) == N
        assert a.flush(30)
    with CacheEngine(cfg, spec, model_id="test-model") as b:
        assert b.retrieve(toks, dst, slots) == N
        stats = b.storage.lower[0].stats()
    return token_kv(spec, src, slots), token_kv(spec, dst, slots), stats


def test_a_passing_verdict_turns_the_codec_on(tmp_path):
    verdict().write(tmp_path / "verdicts")
    stored, loaded, stats = run(tmp_path)
    assert stats["codec_active"] and stats["codec_stored_bytes_read"] > 0
    assert not torch.equal(stored, loaded), "a 4-bit codec gave back every bit"
    assert float((stored - loaded).abs().max()) < 0.5 * float(stored.abs().max())


@pytest.mark.parametrize("case", ["none", "failed", "other model", "other dtype",
                                  "other codec", "malformed"])
def test_without_a_passing_verdict_for_this_model_the_tier_stays_exact(tmp_path, case):
    vdir = tmp_path / "verdicts"
    if case == "failed":
        verdict(passed=False).write(vdir)
    elif case in ("other model", "other dtype", "other codec"):
        v = {"other model": verdict(model="another-model"),
             "other dtype": verdict(dtype="bfloat16"),
             "other codec": verdict(codec="int4-kivi.g16.h8")}[case]
        # a foreign verdict renamed into this triple's place
        v.write(vdir).rename(verdict_path("test-model", "float32", CODEC, vdir))
    elif case == "malformed":
        path = verdict_path("test-model", "float32", CODEC, vdir)
        path.parent.mkdir(parents=True)
        path.write_text('{"passed": true, "passed": true}')
    stored, loaded, stats = run(tmp_path)
    assert not stats["codec_active"]
    assert torch.equal(stored, loaded)


@pytest.mark.parametrize("signed", [None, OTHER_SECRET, SECRET])
def test_under_a_secret_only_a_verdict_it_signed_opens_the_gate(tmp_path, signed):
    pytest.importorskip("cryptography")
    verdict().write(tmp_path / "verdicts", Integrity(signed) if signed else None)
    stored, loaded, stats = run(tmp_path, secret=SECRET)
    assert stats["codec_active"] == (signed == SECRET)
    assert torch.equal(stored, loaded) == (signed != SECRET)


def test_an_altered_signed_verdict_is_refused(tmp_path):
    pytest.importorskip("cryptography")
    path = verdict(passed=False).write(tmp_path, Integrity(SECRET))
    doc = json.loads(path.read_text())
    doc["passed"] = True
    path.write_text(json.dumps(doc))
    ok, why = decide(CODEC, "test-model", "float32", tmp_path, Integrity(SECRET))
    assert not ok and "does not verify" in why
    ok, why = decide(CODEC, "test-model", "float32", tmp_path)  # no secret: trusted as a file
    assert ok


def test_gate_off_uses_the_codec_without_a_verdict(tmp_path):
    stored, loaded, stats = run(tmp_path, gate="off")
    assert stats["codec_active"] and not torch.equal(stored, loaded)
