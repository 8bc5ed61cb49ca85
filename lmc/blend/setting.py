"""Blending's settings as the quality gate reads them: a setting is a recompute ratio.

Canonical spelling ``f"{ratio:g}"`` (``0.15``, ``0``, ``1``). A passing verdict at ratio r
vouches for every ratio above it: recomputing more tokens brings the KV closer to full
prefill (``tests/blend/test_selective_recompute.py``: the KV deviation falls strictly and KL
does not rise over ratios 0, 0.15, 0.5, 1). Unasked, the gate picks the smallest passing
ratio below 1 (at 1 every token is recomputed and blending saves nothing).
"""

from __future__ import annotations

from typing import ClassVar

from lmc.blend.blender import check_ratio
from lmc.quality.feature import FeatureSettings, check_setting


def ratio_setting(ratio: float) -> str:
    return f"{check_ratio(ratio):g}"


class BlendRatios(FeatureSettings):
    name: ClassVar[str] = "blend"

    def parse_setting(self, text: str) -> str:
        check_setting(text)
        try:
            ratio = float(text)
        except ValueError:
            raise ValueError(f"a blend setting is a recompute ratio in [0, 1], got "
                             f"{text!r}") from None
        return ratio_setting(ratio)

    def covers(self, measured: str, wanted: str) -> bool:
        return float(wanted) >= float(measured)

    def preference(self, setting: str) -> float | None:
        ratio = float(setting)
        return ratio if ratio < 1.0 else None
