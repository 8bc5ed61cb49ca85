"""LMCCacheLinker variants for the linker tests, loaded by SGLang's linker factory by name.

Only the per-layer copy step changes: ``SlowLayerLinker`` adds a fixed latency to each layer
(a slow tier, so the overlap with compute can be measured), ``FailingLayerLinker`` fails one
layer the way a tier read can fail. The copies themselves are lmc's real ones.
"""

from __future__ import annotations

import time
from typing import Any

from lmc.connectors.sglang import LMCCacheLinker
from lmc.layerwise import LayerwiseRetrieve

TRACE: list[tuple[float, str, int]] = []  # (time, "load_done", layer)


class SlowLayerLinker(LMCCacheLinker):
    def __init__(self, *args: Any, **kw: Any) -> None:
        self.layer_delay_s = float((kw.get("extra_config") or {}).get("test.layer_delay_s", 0))
        kw["extra_config"] = {k: v for k, v in (kw.get("extra_config") or {}).items()
                              if not k.startswith("test.")}
        super().__init__(*args, **kw)

    def _load_layer(self, retrieve: LayerwiseRetrieve, layer: int) -> None:
        time.sleep(self.layer_delay_s)
        super()._load_layer(retrieve, layer)
        TRACE.append((time.perf_counter(), "load_done", layer))


class FailingLayerLinker(LMCCacheLinker):
    FAIL_AT = 2

    def _load_layer(self, retrieve: LayerwiseRetrieve, layer: int) -> None:
        if layer == self.FAIL_AT:
            raise OSError(f"injected read failure at layer {layer}")
        super()._load_layer(retrieve, layer)
