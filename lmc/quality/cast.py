"""``kv-cast``: KV stored in a narrower float type and read back, the simplest lossy KV.

Each K/V value is rounded to the setting's dtype (saturating at its largest finite value, no
scales) and widened back to the cache's dtype. It is what an engine's plain fp8 KV cache
does, and it calibrates the harness: bfloat16 rounding of an fp32 model's KV is noise every
bf16 deployment accepts, unscaled fp8 is the crudest lossy storage. A real codec (scales,
grouping, entropy coding) registers as its own feature and is judged the same way.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from lmc.quality.feature import LossyKVFeature, PromptKV, check_setting

CAST_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp8-e4m3": "float8_e4m3fn",
           "fp8-e5m2": "float8_e5m2"}


def round_trip(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kv`` rounded to ``dtype`` (clamped to its finite range) and back to ``kv.dtype``."""
    top = torch.finfo(dtype).max
    return kv.float().clamp(-top, top).to(dtype).to(kv.dtype)


class CastFeature(LossyKVFeature):
    name: ClassVar[str] = "kv-cast"
    summary: ClassVar[str] = "KV rounded to a narrower float (bfloat16 ... float8) and back"
    default_settings: ClassVar[tuple[str, ...]] = ("bfloat16", "float8_e4m3fn", "float8_e5m2")

    def parse_setting(self, text: str) -> str:
        name = ALIASES.get(check_setting(text), text)
        if name not in CAST_DTYPES:
            raise ValueError(f"kv-cast setting {text!r}: one of "
                             f"{', '.join([*CAST_DTYPES, *ALIASES])}")
        return name

    def preference(self, setting: str) -> float | None:
        """Unasked, the narrowest type that passed (the most KV for the bytes)."""
        return float(CAST_DTYPES[setting].itemsize)

    def served_kv(self, prompt: PromptKV, setting: str) -> torch.Tensor:
        return round_trip(prompt.exact_kv, CAST_DTYPES[setting])
