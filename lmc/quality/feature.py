"""What a lossy KV feature gives the quality harness, and where features are found.

A *lossy KV feature* serves a prompt KV that is not bit-exact: blending serves segments
computed elsewhere with a few tokens recomputed, a codec serves what its decoder makes of
what its encoder stored. The harness judges every feature one way: it computes a prompt's
exact KV, asks the feature for the KV it would serve instead (:meth:`LossyKVFeature.served_kv`),
puts that in the cache, and measures the model's next-token distributions, answers and
perplexity on top of it against exact KV (``lmc.quality.harness``).

A feature registers under a name (``FEATURES``: ``"name": "module:Class"``, imported only
when used) and names its settings as short strings (a ratio, a codec and its parameters);
a verdict is kept per (weights, dtype, feature, setting). See docs/quality.md.
"""

from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # a gate (any tier's) imports this module: no torch at load time
    import torch

Span = tuple[int, int]
NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")
SETTING = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=,-]{0,63}")

# name -> "module:Class"; a feature outside lmc registers with register_feature()
FEATURES: dict[str, str] = {
    "blend": "lmc.blend.lossy:BlendFeature",
    "kv-cast": "lmc.quality.cast:CastFeature",
    "kv-codec": "lmc.storage.kvcodecs.feature:CodecFeature",
}


@dataclass(frozen=True)
class ModelUnderTest:
    """What a feature may need to know about the model it is judged on."""

    model_dir: Path
    model_id: str  # the weights' identity (every byte), as verdicts and the gate use it
    dtype: torch.dtype  # the model's and its KV cache's
    device: torch.device
    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_size: int  # tokens per lmc chunk: a per-chunk codec works on these
    max_len: int  # the longest prompt plus answer the harness will run


@dataclass(frozen=True)
class PromptKV:
    """One prompt as the feature sees it. ``exact_kv`` is the KV of the prompt's context
    (every token but the last, which an engine always computes to get the first logits):
    ``[layers, 2 (K, V), tokens, kv_heads, head_dim]`` in the cache dtype, K rotated (as
    engines store it). ``spans`` are the prompt's reusable segments (for blending)."""

    ids: Sequence[int]
    spans: Sequence[Span]
    exact_kv: torch.Tensor

    @property
    def context_len(self) -> int:
        return self.exact_kv.shape[2]


class FeatureSettings(ABC):
    """A feature's name and what its settings mean: what the gate needs (the component that
    serves the feature uses this part alone, without the harness)."""

    name: ClassVar[str]

    @abstractmethod
    def parse_setting(self, text: str) -> str:
        """The setting's canonical spelling (verdicts are keyed by it: ``0.10`` and ``0.1``
        must be one setting); ``ValueError`` naming what is wrong."""

    def covers(self, measured: str, wanted: str) -> bool:
        """Whether a passing verdict for setting ``measured`` vouches for ``wanted`` (both
        canonical). Only the same setting, unless the feature knows better."""
        return measured == wanted

    def preference(self, setting: str) -> float | None:
        """Among passing settings the gate picks the lowest preference (the most saving);
        None: never picked unasked (e.g. a setting that saves nothing)."""
        return 0.0


class LossyKVFeature(FeatureSettings):
    """A feature the harness can judge. Subclasses set ``name``, ``summary`` and
    ``default_settings`` and implement :meth:`parse_setting` and :meth:`served_kv`."""

    summary: ClassVar[str]  # one line for `lmc quality --help`
    default_settings: ClassVar[tuple[str, ...]]

    def open(self, model: ModelUnderTest) -> None:
        """Build what serving needs, once per run (an engine, a codec's tables)."""

    @abstractmethod
    def served_kv(self, prompt: PromptKV, setting: str) -> torch.Tensor:
        """The KV this feature at ``setting`` would serve for ``prompt``'s context: the
        shape and dtype of ``prompt.exact_kv`` (which it must not modify)."""

    def close(self) -> None:
        """Release what :meth:`open` built."""


def register_feature(name: str, target: str) -> None:
    """Make ``name`` judgeable: ``target`` is ``"module:Class"`` of a :class:`LossyKVFeature`."""
    if not NAME.fullmatch(name):
        raise ValueError(f"feature name {name!r}: lowercase letters, digits and '-', "
                         "starting with a letter, at most 32")
    if ":" not in target:
        raise ValueError(f"feature target {target!r}: expected 'module:Class'")
    FEATURES[name] = target


def load_feature(name: str) -> LossyKVFeature:
    """A fresh instance of the feature registered as ``name``; ``ValueError`` naming the
    known ones when there is none."""
    target = FEATURES.get(name)
    if target is None:
        raise ValueError(f"no lossy KV feature {name!r}; known: {', '.join(sorted(FEATURES))}")
    module, _, cls_name = target.partition(":")
    cls = getattr(importlib.import_module(module), cls_name)
    feature = cls()
    if not isinstance(feature, LossyKVFeature) or feature.name != name:
        raise TypeError(f"{target} is not the LossyKVFeature {name!r}")
    return feature


def check_setting(text: str) -> str:
    """A setting string's common rule (before the feature's own): short, no spaces or '/'."""
    if not isinstance(text, str) or not SETTING.fullmatch(text):
        raise ValueError(f"setting {text!r}: 1 to 64 of letters, digits and ._+=,- "
                         "(starting with a letter or digit)")
    return text
