"""lmc for vLLM. vLLM loads ``LMCConnector`` from this module path (``kv_connector_module_path:
lmc.connectors.vllm``); it is imported on first use, so the parts that need no vLLM
(``config``, ``layout``, ``requests``...) import without it."""

from __future__ import annotations

from typing import Any

__all__ = ["LMCConnector"]


def __getattr__(name: str) -> Any:
    if name == "LMCConnector":
        from lmc.connectors.vllm.connector import LMCConnector

        return LMCConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
