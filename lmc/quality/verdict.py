"""Verdicts: what ``lmc quality`` measured for one (weights, dtype, feature, setting), and
whether it passed. One file each, in a folder next to the model's ``config.json``
(``lmc_quality/<feature>@<setting>@<dtype>.json``, or a folder given with ``--verdicts``), is
what a feature's gate reads before it turns the feature on (``lmc.quality.gate``).

A verdict binds the model identity (every byte of the weights, so new weights need a new
check), the KV dtype, the feature and its setting; a file whose content names another key
than its name is refused. Reading is strict: at most :data:`MAX_VERDICT_BYTES`, JSON parsed
by :mod:`lmc.strict_json` (no nesting past 32 levels, no key twice), fields typed and ranged;
a file that is not a verdict is an error naming what is wrong, which a gate treats as no
verdict, never a crash.

Who may write one. Without an integrity secret, a verdict is trusted as a file next to the
model: whoever can write there can turn a feature on, as they could replace the weights. With
``integrity_secret`` (or ``_file``) configured, ``lmc quality`` signs the verdict (``tag``:
keyed BLAKE2b over its canonical JSON, :meth:`lmc.storage.integrity.Integrity.document_tag`)
and a gate refuses one that is unsigned, altered or signed with another secret
(:class:`VerdictRefused`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmc.quality.feature import NAME, SETTING
from lmc.strict_json import load_json_file

if TYPE_CHECKING:
    from lmc.storage.integrity import Integrity

VERDICTS_DIR = "lmc_quality"
VERDICT_FORMAT = 2
MAX_VERDICT_BYTES = 1 << 20
MAX_VERDICT_FILES = 256  # per (feature, dtype): a gate reads at most this many
TAG_KIND = b"lmc-verdict/2"


class VerdictRefused(ValueError):
    """A verdict whose signature an integrity secret requires is missing or does not verify."""


@dataclass(frozen=True)
class Measurement:
    """One setting's figures against exact KV (see docs/quality.md, "Metrics")."""

    kl_mean: float  # KL(exact || served) of next-token distributions over the answers, nats
    kl_max: float  # the largest at any answer position
    top1: float  # fraction of answer positions whose most likely token is the same
    answer_tokens: int  # positions compared (every question's exact answer, teacher-forced)
    ppl_exact: float  # perplexity of the bundled text's continuation over exact KV
    ppl_served: float  # ... over the served KV of its first part
    ppl_change: float  # ppl_served / ppl_exact - 1
    text_tokens: int
    qa_identical: float  # fraction of questions whose greedy answer is token for token the same
    qa_agreement: float  # ... that is the same, or names the expected fact as the exact one does
    qa_correct_exact: int  # answers naming the expected fact, with exact KV
    qa_correct_served: int  # ... with the served KV
    questions: int
    kv_error: list[float]  # per layer: ||served - exact|| / ||exact||, over all prompts
    seconds: float  # wall time this setting's measurement took


@dataclass(frozen=True)
class Thresholds:
    """A setting passes when every figure is on the right side of its bound."""

    kl_mean_max: float
    top1_min: float
    ppl_change_max: float
    qa_agreement_min: float

    def failures(self, m: Measurement) -> list[str]:
        """What a measurement misses, one short phrase each (empty: it passes)."""
        out = []
        if not m.kl_mean <= self.kl_mean_max:
            out.append(f"KL {m.kl_mean:.4f} > {self.kl_mean_max}")
        if not m.top1 >= self.top1_min:
            out.append(f"top-1 {m.top1:.3f} < {self.top1_min}")
        if not m.ppl_change <= self.ppl_change_max:
            out.append(f"perplexity {m.ppl_change:+.1%} > +{self.ppl_change_max:.1%}")
        if not m.qa_agreement >= self.qa_agreement_min:
            out.append(f"QA agreement {m.qa_agreement:.2f} < {self.qa_agreement_min}")
        return out


@dataclass(frozen=True)
class Verdict:
    model_id: str
    dtype: str
    feature: str
    setting: str
    passed: bool
    failed: list[str]  # Thresholds.failures of the measurement
    thresholds: Thresholds
    measurement: Measurement
    workload: dict[str, Any] = field(default_factory=dict)  # what was measured on
    format: int = VERDICT_FORMAT

    @property
    def key(self) -> tuple[str, str, str]:
        return self.feature, self.setting, self.dtype

    def to_json(self, integrity: Integrity | None = None) -> str:
        """The file's text; signed (a ``tag`` field) when ``integrity`` is given."""
        doc: dict[str, Any] = asdict(self)
        if integrity is not None:
            doc["tag"] = integrity.document_tag(TAG_KIND, canonical(doc))
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def canonical(doc: dict[str, Any]) -> bytes:
    """The bytes a verdict's tag covers: its fields but the tag, sorted, compact, ASCII (so
    re-indenting the file keeps the tag valid, and changing any value does not)."""
    return json.dumps({k: v for k, v in doc.items() if k != "tag"}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def file_name(feature: str, setting: str, dtype: str) -> str:
    for what, value, rule in (("feature", feature, NAME), ("setting", setting, SETTING),
                              ("dtype", dtype, NAME)):
        if not rule.fullmatch(value):
            raise ValueError(f"{what} {value!r} cannot name a verdict")
    return f"{feature}@{setting}@{dtype}.json"


class VerdictStore:
    """The verdict files of one model (``folder``: usually ``<model>/lmc_quality``);
    ``integrity``: a configured secret (signs on write, required on read)."""

    def __init__(self, folder: str | os.PathLike, integrity: Integrity | None = None) -> None:
        self.folder = Path(folder)
        self.integrity = integrity

    @classmethod
    def next_to(cls, model_dir: str | os.PathLike, integrity: Integrity | None = None
                ) -> VerdictStore:
        return cls(Path(model_dir) / VERDICTS_DIR, integrity)

    def path(self, feature: str, setting: str, dtype: str) -> Path:
        return self.folder / file_name(feature, setting, dtype)

    def write(self, verdict: Verdict) -> Path:
        """Atomically (a reader never sees half a verdict); signed when a secret is set."""
        path = self.path(*verdict.key)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".verdict-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(verdict.to_json(self.integrity))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def read(self, feature: str, setting: str, dtype: str) -> Verdict | None:
        """The verdict for this key; None when there is none; ``ValueError`` naming the
        problem when the file is not a verdict for this key (:class:`VerdictRefused` when
        its signature is missing or wrong)."""
        path = self.path(feature, setting, dtype)
        return read_verdict(path, self.integrity, (feature, setting, dtype)) \
            if path.is_file() else None

    def entries(self, feature: str, dtype: str) -> Iterator[tuple[Path, Verdict | ValueError]]:
        """Every verdict file for ``feature`` on ``dtype`` (at most
        :data:`MAX_VERDICT_FILES`), each read or the error that refused it."""
        if not self.folder.is_dir():
            return
        prefix, suffix = f"{feature}@", f"@{dtype}.json"
        names = sorted(p.name for p in self.folder.iterdir()
                       if p.name.startswith(prefix) and p.name.endswith(suffix))
        for name in names[:MAX_VERDICT_FILES]:
            path = self.folder / name
            setting = name[len(prefix):-len(suffix)]
            try:
                yield path, read_verdict(path, self.integrity, (feature, setting, dtype))
            except ValueError as e:
                yield path, e
            except OSError as e:
                yield path, ValueError(f"{path}: {e.strerror or e}")


def read_verdict(path: str | os.PathLike, integrity: Integrity | None = None,
                 key: tuple[str, str, str] | None = None) -> Verdict:
    """The verdict in ``path``, checked (see the module docstring); ``key``: the (feature,
    setting, dtype) it must be for."""
    path = Path(path)
    raw = load_json_file(path, MAX_VERDICT_BYTES)  # InputError (a ValueError) names it
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    tag = raw.pop("tag", None)
    if integrity is not None:
        if tag is None:
            raise VerdictRefused(f"{path}: unsigned, and an integrity secret is configured "
                                 "(sign it: run lmc quality with the same secret)")
        try:
            content = canonical(raw)
        except ValueError as e:  # NaN or infinity: never written by lmc quality
            raise ValueError(f"{path}: {e}") from None
        if not integrity.document_tag_valid(TAG_KIND, content, tag):
            raise VerdictRefused(f"{path}: its tag does not verify (the file was altered, or "
                                 "signed with another secret)")
    if raw.get("format") != VERDICT_FORMAT:
        raise ValueError(f"{path}: format {raw.get('format')!r}, expected {VERDICT_FORMAT}")
    verdict = _from_dict(raw, path)
    if key is not None and verdict.key != key:
        raise ValueError(f"{path}: it is for {'/'.join(verdict.key)} (feature/setting/dtype), "
                         f"not {'/'.join(key)}")
    return verdict


def _from_dict(raw: dict[str, Any], path: Path) -> Verdict:
    try:
        m, t = raw.get("measurement"), raw.get("thresholds")
        if not isinstance(m, dict) or not isinstance(t, dict):
            raise TypeError("measurement and thresholds must be objects")
        verdict = Verdict(**{**raw, "measurement": Measurement(**m),
                             "thresholds": Thresholds(**t)})
    except TypeError as e:
        raise ValueError(f"{path}: fields do not match a verdict: {e}") from None
    _check_types(verdict, path)
    return verdict


def _check_types(v: Verdict, path: Path) -> None:
    for name in ("model_id", "dtype", "feature", "setting"):
        if not isinstance(getattr(v, name), str):
            raise ValueError(f"{path}: {name} must be a string")
    if not isinstance(v.passed, bool):
        raise ValueError(f"{path}: passed must be true or false")
    if not isinstance(v.failed, list) or not all(isinstance(f, str) for f in v.failed):
        raise ValueError(f"{path}: failed must be a list of strings")
    if not isinstance(v.workload, dict):
        raise ValueError(f"{path}: workload must be an object")
    for part in (v.measurement, v.thresholds):
        for f in fields(part):
            value = getattr(part, f.name)
            values = value if isinstance(value, list) else [value]
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                       and math.isfinite(x) for x in values):
                raise ValueError(f"{path}: {f.name} must be a finite number")
    if v.failed != v.thresholds.failures(v.measurement) or v.passed == bool(v.failed):
        raise ValueError(f"{path}: passed and failed disagree with its own figures and "
                         "thresholds")
