"""The harness on a small random-weight model (fast; what a feature does to a trained
model's answers is judged in test_real_model.py): serving exact KV measures nothing, bit for
bit; rounding measures a little; destroying the KV fails every threshold."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch

from lmc.quality.cast import CastFeature
from lmc.quality.check import DEFAULT_THRESHOLDS, run_quality
from lmc.quality.feature import LossyKVFeature, PromptKV
from lmc.reference import make_tiny_checkpoint


class Exact(LossyKVFeature):
    name: ClassVar[str] = "exact"
    summary: ClassVar[str] = "serves the exact KV"
    default_settings: ClassVar[tuple[str, ...]] = ("on",)

    def parse_setting(self, text: str) -> str:
        return text

    def served_kv(self, prompt: PromptKV, setting: str) -> torch.Tensor:
        kv = prompt.exact_kv
        if setting == "scribble":  # a feature writing into what it was given: a copy
            kv.zero_()
        if setting == "noise":  # V of the later layers replaced by noise
            kv = kv.clone()
            gen = torch.Generator().manual_seed(0)
            kv[1:, 1] = torch.randn(kv[1:, 1].shape, generator=gen) * kv[1:, 1].std() * 4
        if setting == "short":
            return kv[:, :, 1:]
        return kv


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", seed=5, hidden=128,
                                layers=4, heads=4, kv_heads=2, vocab=512)


FAST = dict(questions=3, answer_tokens=6)


@pytest.fixture(scope="module")
def runs(model: Path) -> dict:
    """One run, three settings: the scribbling one first, so the others would see its harm."""
    return {v.setting: v for v in run_quality(model, Exact(), ["scribble", "noise", "on"],
                                              **FAST)}


def test_serving_exact_kv_measures_exactly_nothing(runs: dict) -> None:
    v = runs["on"]
    m = v.measurement
    assert v.passed and v.failed == [] and v.key == ("exact", "on", "float32")
    assert m.kl_mean == 0.0 and m.kl_max == 0.0 and m.top1 == 1.0
    assert m.ppl_served == m.ppl_exact and m.ppl_change == 0.0
    assert m.qa_identical == 1.0 and m.questions == 3 and m.answer_tokens > 3
    assert m.kv_error == [0.0] * 4 and m.text_tokens > 100
    assert v.workload["qa"] == "docqa-1" and v.workload["questions"] == 3


def test_rounding_to_bfloat16_measures_a_little(model: Path) -> None:
    [bf16] = run_quality(model, CastFeature(), ["bfloat16"], **FAST)
    m = bf16.measurement
    # bf16 keeps 8 significant bits: each value within 2^-9 of itself
    assert all(0 < e <= 2 ** -8 for e in m.kv_error), m.kv_error
    assert 0 < m.kl_mean < 1e-3 and m.ppl_change != 0.0 and bf16.passed


def test_destroyed_kv_fails_and_a_feature_cannot_spoil_the_reference(runs: dict) -> None:
    scribbled, noise = runs["scribble"], runs["noise"]
    assert runs["on"].measurement.kl_mean == 0.0  # the scribble changed only its own copy
    assert scribbled.measurement.kv_error == [1.0] * 4 and not scribbled.passed
    m = noise.measurement
    assert not noise.passed and len(noise.failed) >= 2, noise.failed
    assert m.kl_mean > DEFAULT_THRESHOLDS.kl_mean_max and m.kv_error[0] == 0.0


def test_served_kv_of_the_wrong_shape_is_named(model: Path) -> None:
    with pytest.raises(ValueError, match=r"exact at short served KV \(4, 2, "):
        run_quality(model, Exact(), ["short"], questions=1, answer_tokens=2, text=None)
