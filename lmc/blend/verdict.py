"""The quality gate's verdict file: what ``lmc blend-check`` measured for one model and
dtype, and whether blending passed. It lies next to the model's ``config.json`` by default
(``lmc_blend_verdict.json``) and is what the blend connector reads before it blends.

A verdict binds the model identity (the checkpoint's fingerprint, so new weights need a new
check) and the KV dtype. Reading is strict: a file that is not a verdict is an error naming
what is wrong, and the connector treats it as no verdict.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

VERDICT_NAME = "lmc_blend_verdict.json"
VERDICT_FORMAT = 1
MAX_VERDICT_BYTES = 1 << 20


def default_verdict_path(model_dir: str | os.PathLike) -> Path:
    return Path(model_dir) / VERDICT_NAME


@dataclass(frozen=True)
class RatioResult:
    """One recompute ratio's figures, over all prompts."""

    ratio: float
    kv_deviation: list[float]  # per layer: ||KV_blend - KV_full|| / ||KV_full||, mean
    kl_mean: float  # KL(full || blended) of the next-token distribution, nats
    kl_max: float
    agreement: float  # mean fraction of the first N greedy tokens equal before a divergence
    passed: bool


@dataclass(frozen=True)
class Verdict:
    model_id: str
    dtype: str
    passed: bool
    ratio: float | None  # the smallest passing ratio (what the connector uses)
    thresholds: dict[str, float]
    results: list[RatioResult] = field(default_factory=list)
    prompts: int = 0
    generated_tokens: int = 0
    format: int = VERDICT_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, allow_nan=False) + "\n"

    def write(self, path: str | os.PathLike) -> Path:
        """Atomically (a reader never sees half a verdict)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verdict-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def read_verdict(path: str | os.PathLike) -> Verdict | None:
    """The verdict at ``path``; None when there is none; ``ValueError`` naming the problem
    when the file is not a verdict."""
    path = Path(path)
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_VERDICT_BYTES:
        raise ValueError(f"{path}: larger than {MAX_VERDICT_BYTES} bytes, not a verdict")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if raw.get("format") != VERDICT_FORMAT:
        raise ValueError(f"{path}: format {raw.get('format')!r}, expected {VERDICT_FORMAT}")
    try:
        results = [RatioResult(**r) for r in raw.get("results", [])]
        verdict = Verdict(**{**raw, "results": results})
    except TypeError as e:
        raise ValueError(f"{path}: fields do not match a verdict: {e}") from None
    _check(verdict, path)
    return verdict


def _check(v: Verdict, path: Path) -> None:
    if not isinstance(v.model_id, str) or not isinstance(v.dtype, str):
        raise ValueError(f"{path}: model_id and dtype must be strings")
    if not isinstance(v.passed, bool):
        raise ValueError(f"{path}: passed must be true or false")
    if v.passed and not (isinstance(v.ratio, (int, float)) and 0 <= v.ratio <= 1
                         and math.isfinite(v.ratio)):
        raise ValueError(f"{path}: a passing verdict needs a ratio in [0, 1], got {v.ratio!r}")


def as_dict(v: Verdict) -> dict[str, Any]:
    return asdict(v)
