"""Verdicts made from given figures (judged by the real thresholds), for the store and gate
tests: what is tested there is reading, binding and deciding, not measuring."""

from __future__ import annotations

from lmc.quality.check import DEFAULT_THRESHOLDS
from lmc.quality.verdict import Measurement, Thresholds, Verdict

MODEL = "model@00112233aabbccdd"


def measurement(kl: float = 0.001, top1: float = 1.0, ppl_change: float = 0.0,
                same: float = 1.0) -> Measurement:
    return Measurement(kl_mean=kl, kl_max=kl * 10, top1=top1, answer_tokens=200,
                       ppl_exact=13.5, ppl_served=13.5 * (1 + ppl_change),
                       ppl_change=ppl_change, text_tokens=290, qa_identical=same,
                       qa_agreement=same,
                       qa_correct_exact=14, qa_correct_served=14, questions=14,
                       kv_error=[0.0, 0.01, 0.02], seconds=1.5)


def verdict(setting: str = "0.15", *, feature: str = "blend", dtype: str = "float32",
            model_id: str = MODEL, thresholds: Thresholds = DEFAULT_THRESHOLDS,
            **figures: float) -> Verdict:
    m = measurement(**figures)
    failed = thresholds.failures(m)
    return Verdict(model_id, dtype, feature, setting, not failed, failed, thresholds, m,
                   {"qa": "docqa-1", "questions": 14})
