"""The quality gate's verdict file: what ``lmc blend-check`` measured for one model and
dtype, and whether blending passed. It lies next to the model's ``config.json`` by default
(``lmc_blend_verdict.json``) and is what the blend connector reads before it blends.

A verdict binds the model identity (every byte of the weights, so new weights need a new
check) and the KV dtype. Reading is strict: at most :data:`MAX_VERDICT_BYTES`, JSON parsed by
:mod:`lmc.strict_json` (no nesting past 32 levels, no key twice), fields typed and ranged; a
file that is not a verdict is an error naming what is wrong, and the connector treats it as
no verdict (blending off), never a crash.

Who may write one. Without an integrity secret, a verdict is trusted as a file next to the
model: whoever can write there can turn blending on (``passed: true, ratio: 0.0``), as they
could replace the weights. With ``integrity_secret`` (or ``_file``) configured, ``lmc
blend-check`` signs the verdict (``tag``: keyed BLAKE2b over its canonical JSON,
:meth:`lmc.storage.integrity.Integrity.document_tag`) and the connector refuses one that is
unsigned, altered or signed with another secret (:class:`VerdictRefused`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmc.strict_json import load_json_file

if TYPE_CHECKING:
    from lmc.storage.integrity import Integrity

VERDICT_NAME = "lmc_blend_verdict.json"
VERDICT_FORMAT = 1
MAX_VERDICT_BYTES = 1 << 20
TAG_KIND = b"lmc-verdict/1"


class VerdictRefused(ValueError):
    """A verdict whose signature an integrity secret requires is missing or does not verify."""


def canonical(doc: dict[str, Any]) -> bytes:
    """The bytes a verdict's tag covers: its fields but the tag, sorted, compact, ASCII (so
    re-indenting the file keeps the tag valid, and changing any value does not)."""
    return json.dumps({k: v for k, v in doc.items() if k != "tag"}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


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

    def to_json(self, integrity: Integrity | None = None) -> str:
        """The file's text; signed (a ``tag`` field) when ``integrity`` is given."""
        doc: dict[str, Any] = asdict(self)
        if integrity is not None:
            doc["tag"] = integrity.document_tag(TAG_KIND, canonical(doc))
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"

    def write(self, path: str | os.PathLike, integrity: Integrity | None = None) -> Path:
        """Atomically (a reader never sees half a verdict); signed with ``integrity``."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verdict-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json(integrity))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def read_verdict(path: str | os.PathLike, integrity: Integrity | None = None
                 ) -> Verdict | None:
    """The verdict at ``path``; None when there is none; ``ValueError`` naming the problem
    when the file is not a verdict (:class:`VerdictRefused` when ``integrity`` is given and
    its tag is missing or does not verify)."""
    path = Path(path)
    if not path.is_file():
        return None
    raw = load_json_file(path, MAX_VERDICT_BYTES)  # InputError (a ValueError) names it
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    tag = raw.pop("tag", None)
    if integrity is not None:
        if tag is None:
            raise VerdictRefused(f"{path}: unsigned, and an integrity secret is configured "
                                 "(sign it: run lmc blend-check with the same secret)")
        try:
            content = canonical(raw)
        except ValueError as e:  # NaN or infinity: never written by blend-check
            raise ValueError(f"{path}: {e}") from None
        if not integrity.document_tag_valid(TAG_KIND, content, tag):
            raise VerdictRefused(f"{path}: its tag does not verify (the file was altered, or "
                                 "signed with another secret)")
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
