"""The model identity under SGLang: :mod:`lmc.connectors.core.model_id`'s rule, with the
model SGLang runs.

SGLang hands a storage backend only a name (``--served-model-name``, or the model path, with
the host pool's format tag): two servers that serve different weights under one name would
share KV. So the identity comes from the checkpoint SGLang loaded (``model_path``, a local
folder or a hub name in the local cache: every byte of its weights, or ``lmc.model_revision``),
and only an explicit ``lmc.model_id`` is taken as given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmc.config import CacheConfig
from lmc.connectors.core.model_id import engine_model_id


def running_model() -> tuple[str | None, str | None]:
    """``(model_path, revision)`` of the SGLang server this process belongs to (its published
    model settings), or ``(None, None)`` when they are not reachable."""
    try:
        from sglang.srt.runtime_context import get_model

        bag = get_model()
    except Exception:  # not published in this process, or another SGLang version
        return None, None
    path, rev = getattr(bag, "model_path", None), getattr(bag, "revision", None)
    return (str(path) if path else None), (str(rev) if rev else None)


def sglang_model_id(opts: Mapping[str, Any], config: CacheConfig, model: str | None,
                    hub_revision: str | None, who: str, where: str) -> str:
    """The identity for ``who`` (the backend's name): ``lmc.model_id`` as given, else that of
    ``model`` (SGLang's model path); ``where`` names the extra config to set it in."""
    explicit = opts.get("model_id")
    if not explicit and not model:
        raise ValueError(f"{who} needs a model identity for its key namespace: SGLang named "
                         f"no model; set lmc.model_id in {where}")
    return engine_model_id(str(model or ""), explicit=str(explicit) if explicit else None,
                           revision=config.model_revision, hub_revision=hub_revision,
                           setting="lmc.model_id")
