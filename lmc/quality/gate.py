"""The gate: a lossy KV feature is on for a model only where a verdict of ``lmc quality``
passed for these weights, this KV dtype, this feature and (a setting covering) this setting.

A component that serves lossy KV (the blend connector today, a tier's codec next) asks
:func:`decide` once at start-up with the model's identity and dtype and the setting it was
configured with (or None: the feature's preferred passing setting) and logs the one line it
returns. A verdict that cannot be used (unreadable, unsigned where a secret is configured,
altered, a file named for another key) makes the decision a warning; one for other weights or
that failed is ordinary news. Never an exception: a broken verdict is no verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmc.quality.feature import FeatureSettings
from lmc.quality.verdict import Verdict, VerdictStore


@dataclass(frozen=True)
class Decision:
    setting: str | None  # the setting to run with; None: the feature stays off
    why: str  # one line for the log: which verdict allows it, or why not
    warn: bool = False  # a verdict was there but could not be used
    verdict: Path | None = None  # the file that decided (when one did)

    @property
    def on(self) -> bool:
        return self.setting is not None


def decide(store: VerdictStore, feature: FeatureSettings, model_id: str, dtype: str,
           wanted: str | None = None) -> Decision:
    """Whether ``feature`` may run on this model, and at which setting (see the module
    docstring). ``wanted`` must be canonical (``feature.parse_setting``)."""
    usable: list[tuple[Path, Verdict]] = []
    problems: list[str] = []  # unusable files: warnings
    news: list[str] = []  # usable files that do not allow it: ordinary reasons
    for path, entry in store.entries(feature.name, dtype):
        if isinstance(entry, ValueError):
            problems.append(str(entry))
        elif entry.model_id != model_id:
            news.append(f"the verdict at {path} is for {entry.model_id}, not {model_id}")
        elif not entry.passed:
            news.append(f"the verdict at {path} failed ({'; '.join(entry.failed)})")
        else:
            usable.append((path, entry))
    passing = sorted(v.setting for _, v in usable)
    choice = _choose(store, feature, dtype, wanted, usable)
    if choice is not None:
        path, verdict, setting = choice
        return Decision(setting, f"verdict {path} passed at {verdict.setting}", verdict=path)
    return Decision(None, *_why_not(store, feature.name, dtype, wanted, passing, problems,
                                    news))


def _choose(store: VerdictStore, feature: FeatureSettings, dtype: str, wanted: str | None,
            usable: list[tuple[Path, Verdict]]) -> tuple[Path, Verdict, str] | None:
    """The passing verdict that decides, and the setting to run with: one covering
    ``wanted`` (its own file first), or, unasked, the feature's preferred one."""
    if wanted is not None:
        exact = store.path(feature.name, wanted, dtype)
        covering = sorted(((p, v) for p, v in usable if feature.covers(v.setting, wanted)),
                          key=lambda pv: pv[0] != exact)
        return (*covering[0], wanted) if covering else None
    ranked = [(pref, p, v) for p, v in usable
              if (pref := feature.preference(v.setting)) is not None]
    if not ranked:
        return None
    _, path, verdict = min(ranked, key=lambda t: t[0])
    return path, verdict, verdict.setting


def _why_not(store: VerdictStore, feature: str, dtype: str, wanted: str | None,
             passing: list[str], problems: list[str], news: list[str]) -> tuple[str, bool]:
    """The one line saying why the feature stays off, and whether it is a warning."""
    what = f"{feature} at {wanted}" if wanted is not None else feature
    if problems:
        return "; ".join(problems[:3]), True
    if wanted is not None:
        exact = str(store.path(feature, wanted, dtype))
        mine = [n for n in news if exact in n]
        if mine:
            return mine[0], False
    if passing:
        return (f"no passing verdict in {store.folder} covers {what} on {dtype} (passed: "
                f"{', '.join(passing)})"), False
    if len(news) == 1:
        return news[0], False
    if news:
        return (f"no passing verdict for {what} on {dtype} in {store.folder} ({len(news)} "
                f"verdicts, e.g. {news[0]})"), False
    return f"no verdict for {what} on {dtype} in {store.folder}", False
