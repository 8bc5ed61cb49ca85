"""The reference connector with blending: the per-model gate and the no-flooding save rule.

``BlendConnector`` is ``LMCReferenceConnector`` plus two things:

* **The gate** (``lmc.quality.gate``). Blending is enabled for a model only where a verdict
  of ``lmc quality --feature blend`` passed for this checkpoint's identity and KV dtype: at
  the given ratio (a verdict at a ratio at or below it covers it), or, none given, at the
  smallest ratio below 1 that passed. ``override=True`` enables it anyway and logs a
  warning naming what was missing. Without either, segments are computed as plain prompt
  tokens and one INFO line says why.
* **No flooding.** A blended request's prefix chain is saved only up to its first segment
  (the system prompt, which really is a shared prefix); its segments are stored by the
  blender under their own keys and its question is not stored. A RAG stream of novel
  queries therefore adds at most each new document once, instead of a prefix chain of the
  whole prompt per query that evicts the documents themselves (LMCache #4663).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lmc.blend.blender import DEFAULT_RATIO, SegmentBlender, check_ratio
from lmc.blend.rope_shift import check_placeable
from lmc.blend.setting import BlendRatios, ratio_setting
from lmc.blend.store import SegmentStore
from lmc.connectors.core.metadata import ConnectorMetadata
from lmc.connectors.reference.connector import ConfigLike, LMCReferenceConnector
from lmc.quality.gate import decide
from lmc.quality.verdict import VerdictStore
from lmc.reference.connector_api import ConnectorRequest
from lmc.reference.model_config import ModelConfig
from lmc.reference.scheduler_output import SchedulerOutput
from lmc.storage.integrity import Integrity

logger = logging.getLogger(__name__)
LEGACY_VERDICT = "lmc_blend_verdict.json"  # lmc blend-check's one file, before lmc quality


@dataclass(frozen=True)
class BlendSettings:
    """``ratio``: recompute ratio (None: the smallest a verdict passed); ``verdicts``: the
    verdict folder (default: ``lmc_quality`` next to the model's config.json);
    ``override``: blend without a passing verdict (logged as a warning); ``check_layer``:
    the layer that picks the tokens."""

    ratio: float | None = None
    verdicts: str | os.PathLike | None = None
    override: bool = False
    check_layer: int = 1

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> BlendSettings:
        if "verdict" in raw:
            raise ValueError("the blend setting 'verdict' (one file) is now 'verdicts': the "
                             "folder lmc quality writes (default: lmc_quality next to the "
                             "model's config.json)")
        unknown = set(raw) - {"ratio", "verdicts", "override", "check_layer"}
        if unknown:
            raise ValueError(f"unknown blend setting(s): {', '.join(sorted(unknown))} "
                             "(known: ratio, verdicts, override, check_layer)")
        settings = cls(**raw)
        if settings.ratio is not None:
            check_ratio(settings.ratio)
        if not isinstance(settings.override, bool):
            raise ValueError(f"blend override must be true or false, got {settings.override!r}")
        return settings


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BlendConnector(LMCReferenceConnector):
    """See the module docstring. ``blend``: :class:`BlendSettings` fields as a mapping."""

    def __init__(self, config: ConfigLike = None, *, model_dir: str | os.PathLike,
                 blend: Mapping[str, Any] | BlendSettings | None = None, **kwargs: Any) -> None:
        self.settings = (blend if isinstance(blend, BlendSettings)
                         else BlendSettings.from_mapping(blend or {}))
        self.model_config = ModelConfig.from_file(Path(model_dir) / "config.json")
        check_placeable(self.model_config)  # refuses, by name, a model it cannot place
        super().__init__(config, model_dir=model_dir, **kwargs)
        self.model_dir = Path(model_dir)
        # with an integrity secret, only verdicts it signed count
        self.verdicts = (VerdictStore(self.settings.verdicts, Integrity.from_config(
            self.cache_config)) if self.settings.verdicts is not None else
            VerdictStore.next_to(model_dir, Integrity.from_config(self.cache_config)))
        self.blender: SegmentBlender | None = None
        self._save_limits: dict[str, int] = {}  # blended request -> end of its prefix saves

    # ------------------------------------------------------------------ the gate
    def gate(self, dtype: torch.dtype) -> float | None:
        """The ratio to blend with, or None when blending stays off (logged either way)."""
        want = dtype_name(dtype)
        rules = BlendRatios()
        wanted = None if self.settings.ratio is None else ratio_setting(self.settings.ratio)
        decision = decide(self.verdicts, rules, self.model_id, want, wanted)
        if decision.setting is not None:
            logger.info("blending on for %s (%s) at recompute ratio %s (%s)", self.model_id,
                        want, decision.setting, decision.why)
            return float(decision.setting)
        why = decision.why
        legacy = self.model_dir / LEGACY_VERDICT
        if legacy.is_file():
            why += f"; {legacy} (blend-check's old file) is no longer read"
        if self.settings.override:
            ratio = self.settings.ratio if self.settings.ratio is not None else DEFAULT_RATIO
            logger.warning("blending forced on for %s at recompute ratio %.2f without a "
                           "passing quality verdict (%s): outputs may differ from full "
                           "prefill", self.model_id, ratio, why)
            return ratio
        (logger.warning if decision.warn else logger.info)(
            "blending off for %s: %s (run `lmc quality --model %s --feature blend`)",
            self.model_id, why, self.model_dir)
        return None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        ratio = self.gate(next(iter(kv_caches.values())).dtype)
        self.blender = None
        if ratio is not None:
            self.blender = SegmentBlender(SegmentStore(self.cache), self.model_config, ratio,
                                          self.settings.check_layer)

    # ------------------------------------------------------------ no flooding
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        segments = getattr(request, "segments", None)
        if self.blender is not None and segments:
            self._save_limits[request.request_id] = segments[0][0]
        else:
            self._save_limits.pop(request.request_id, None)
        super().update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        if self._save_limits and meta.saves:
            saves = []
            for save in meta.saves:
                limit = self._save_limits.get(save.request_id)
                if limit is None:
                    saves.append(save)
                elif limit > save.start:
                    saves.append(replace(save, token_ids=save.token_ids[:limit]))
            meta.saves = saves
        return meta

    def request_finished(self, request: ConnectorRequest) -> dict | None:
        self._save_limits.pop(request.request_id, None)
        return super().request_finished(request)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if self.blender is not None:
            out.update({f"blend.{k}": v for k, v in self.blender.stats.as_dict().items()})
        return out
