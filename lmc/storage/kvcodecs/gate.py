"""The quality gate for lossy codecs: a codec stores a model's KV only where a verdict for
(weights identity, KV dtype, codec and its parameters) says the model keeps its answers.

A verdict is a small JSON file (at most :data:`MAX_VERDICT_BYTES`, read with
:mod:`lmc.strict_json`) written by the quality harness after measuring the codec on the
model: KL divergence and top-1 agreement of next-token distributions, perplexity change and
QA agreement against exact KV, the thresholds it was judged by, and ``passed``. It lies in a
verdict directory (``<lmc cache>/verdicts`` unless a tier's ``verdicts:`` says otherwise)
under a name derived from the triple (:func:`verdict_path`), so verdicts of many models
and codecs sit side by side.

Refused, each a reason the tier logs once while it stores exact KV instead (the codec off,
never an error): no verdict; one whose identity, dtype or codec is not this one (a foreign
verdict copied or renamed into place); one that failed; one that is not a verdict (too
large, malformed JSON, wrong fields); and, with ``integrity_secret`` configured, one not
signed with that secret (keyed BLAKE2b over its canonical JSON,
:meth:`lmc.storage.integrity.Integrity.document_tag`). The lossless stage alone needs no
verdict: it gives back every bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmc.strict_json import load_json_file

if TYPE_CHECKING:
    from lmc.storage.integrity import Integrity

VERDICT_FORMAT = 1
MAX_VERDICT_BYTES = 1 << 20
TAG_KIND = b"lmc-codec/1"
FEATURE = "kv-codec"


@dataclasses.dataclass(frozen=True)
class CodecVerdict:
    """What the quality harness found for one (model, dtype, codec)."""

    model_id: str
    dtype: str
    codec: str  # the lossy codec's ident, parameters included (``int4-kivi.g32.h64``)
    passed: bool
    thresholds: dict[str, float]
    results: dict[str, float]
    feature: str = FEATURE
    format: int = VERDICT_FORMAT

    def to_json(self, integrity: Integrity | None = None) -> str:
        doc: dict[str, Any] = dataclasses.asdict(self)
        if integrity is not None:
            doc["tag"] = integrity.document_tag(TAG_KIND, canonical(doc))
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"

    def write(self, directory: str | os.PathLike | None = None,
              integrity: Integrity | None = None) -> Path:
        """Atomically into ``directory`` (default: lmc's), under :func:`verdict_path`."""
        path = verdict_path(self.model_id, self.dtype, self.codec, directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verdict-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json(integrity))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def canonical(doc: dict[str, Any]) -> bytes:
    """The bytes a tag covers: every field but the tag, sorted and compact."""
    return json.dumps({k: v for k, v in doc.items() if k != "tag"}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def default_directory() -> Path:
    from lmc.user_cache import cache_dir

    return cache_dir() / "verdicts"


def verdict_path(model_id: str, dtype: str, codec: str,
                 directory: str | os.PathLike | None = None) -> Path:
    digest = hashlib.blake2b("\0".join((model_id, dtype, codec)).encode(),
                             digest_size=12).hexdigest()
    return Path(directory or default_directory()) / f"codec-{digest}.json"


def read_verdict(path: Path, integrity: Integrity | None = None) -> CodecVerdict | None:
    """The verdict at ``path``, ``None`` when there is none; ``ValueError`` naming what is
    wrong otherwise (unsigned or badly signed under a secret included)."""
    if not path.is_file():
        return None
    raw = load_json_file(path, MAX_VERDICT_BYTES)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    tag = raw.pop("tag", None)
    if integrity is not None:
        if tag is None:
            raise ValueError(f"{path}: unsigned, and an integrity secret is configured")
        try:
            content = canonical(raw)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if not integrity.document_tag_valid(TAG_KIND, content, tag):
            raise ValueError(f"{path}: its tag does not verify (altered, or signed with "
                             "another secret)")
    if raw.get("format") != VERDICT_FORMAT or raw.get("feature") != FEATURE:
        raise ValueError(f"{path}: not a codec verdict (format {raw.get('format')!r}, "
                         f"feature {raw.get('feature')!r})")
    try:
        v = CodecVerdict(**raw)
    except TypeError as e:
        raise ValueError(f"{path}: fields do not match a codec verdict: {e}") from None
    if not all(isinstance(getattr(v, f), str) for f in ("model_id", "dtype", "codec")):
        raise ValueError(f"{path}: model_id, dtype and codec must be strings")
    if not isinstance(v.passed, bool):
        raise ValueError(f"{path}: passed must be true or false")
    for name in ("thresholds", "results"):
        d = getattr(v, name)
        if not isinstance(d, dict) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                for x in d.values()):
            raise ValueError(f"{path}: {name} must map names to finite numbers")
    return v


def open_gates(tiers: Any, model_id: str, dtype: Any) -> int:
    """Tell every codec tier among ``tiers`` (through any wrapper) which model's KV it will
    hold, so each decides whether its lossy stage is used; returns how many codec tiers."""
    n = 0
    for tier in tiers:
        fn = getattr(tier, "open_gate", None)
        if callable(fn):
            fn(model_id, dtype)
            n += 1
    return n


def decide(codec: str, model_id: str, dtype: str, directory: str | os.PathLike | None = None,
           integrity: Integrity | None = None) -> tuple[bool, str]:
    """Whether ``codec`` may store this model's KV, and why (one line for the log)."""
    path = verdict_path(model_id, dtype, codec, directory)
    try:
        v = read_verdict(path, integrity)
    except ValueError as e:
        return False, f"verdict refused: {e}"
    if v is None:
        return False, (f"no quality verdict for {codec} on this model's {dtype} KV at {path} "
                       "(measure it with the quality harness)")
    if (v.model_id, v.dtype, v.codec) != (model_id, dtype, codec):
        return False, (f"the verdict at {path} is for ({v.model_id}, {v.dtype}, {v.codec}), "
                       f"not this ({model_id}, {dtype}, {codec})")
    if not v.passed:
        shown = ", ".join(f"{k} {x:.4g}" for k, x in sorted(v.results.items()))
        return False, f"the verdict at {path} failed ({shown})"
    return True, f"verdict passed at {path}"
