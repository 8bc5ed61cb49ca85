"""The quality gate for a tier's lossy codec: it stores a model's KV only where a verdict of
``lmc quality`` (feature ``kv-codec``, :mod:`lmc.storage.kvcodecs.feature`) passed for these
weights, this KV dtype and this codec with these parameters (:mod:`lmc.quality.gate`).

The verdicts are read from the tier's ``verdicts:`` folder, else from ``lmc_quality/`` next to
the model's checkpoint when the engine knows it (``CacheEngine(model_dir=...)``: the reference
connector passes it); with neither, no verdict can be found and the codec stays off. With
``integrity_secret`` only verdicts that secret signed count. Refused, each logged once while
the tier stores exact KV: no verdict, a failed one, one for other weights, dtype or codec (a
file renamed into place), an unreadable, unsigned or badly signed one. A lossless stage
alone needs no verdict: it gives back every bit.
"""

from __future__ import annotations

import os
from typing import Any

from lmc.quality.gate import Decision, decide
from lmc.quality.verdict import VerdictStore


def verdict_store(folder: str | os.PathLike | None, model_dir: str | os.PathLike | None,
                  integrity: Any = None) -> VerdictStore | None:
    """Where a codec tier reads verdicts (see the module docstring); None: nowhere."""
    if folder:
        return VerdictStore(folder, integrity)
    if model_dir:
        return VerdictStore.next_to(model_dir, integrity)
    return None


def decide_codec(setting: str, model_id: str, dtype: str, store: VerdictStore | None
                 ) -> Decision:
    """Whether the codec at canonical ``setting`` may store this model's KV, and why."""
    from lmc.storage.kvcodecs.feature import CodecSettings

    if store is None:
        return Decision(None, "no verdict folder: give the tier verdicts: <folder of lmc "
                              "quality's verdicts> (the engine was not told the checkpoint)")
    return decide(store, CodecSettings(), model_id, dtype, setting)


def open_gates(tiers: Any, model_id: str, dtype: Any,
               model_dir: str | os.PathLike | None = None) -> int:
    """Tell every codec tier among ``tiers`` (through any wrapper) which model's KV it will
    hold, so each decides whether its lossy stage is used; returns how many codec tiers."""
    n = 0
    for tier in tiers:
        fn = getattr(tier, "open_gate", None)
        if callable(fn):
            fn(model_id, dtype, model_dir)
            n += 1
    return n
