"""lmc for SGLang. SGLang loads ``LMCHiCacheStorage`` (``module_path: lmc.connectors.sglang``) and
``LMCCacheLinker`` (``linker_module_path: lmc.connectors.sglang``) from this module path; both are
imported on first use, so ``pages`` imports without SGLang."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"LMCHiCacheStorage": "lmc.connectors.sglang.hicache",
            "LMCCacheLinker": "lmc.connectors.sglang.linker"}
__all__ = ["LMCHiCacheStorage", "LMCCacheLinker"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
