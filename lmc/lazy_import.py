"""A module imported on its first use, for modules that commands without KV touch.

Why: importing torch takes seconds (3-5 s on an idle 2-core machine, 8-34 s on a busy one),
and ``lmc config`` only reads YAML and the backends' declared options, yet the backend
modules it must import for those options load ``lmc.memory.pool``, which uses torch in
every method. Such a module binds ``torch = LazyModule("torch", globals())``: the stand-in
imports torch when an attribute is first read and puts the real module in its place, so
every later use is the plain global lookup it was before.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """Stands for module ``name`` in ``namespace`` (a module's ``globals()``) until an
    attribute of it is read; then imports it and binds it there under ``alias``."""

    def __init__(self, name: str, namespace: dict[str, Any], alias: str | None = None) -> None:
        self._name = name
        self._namespace = namespace
        self._alias = alias or name.rpartition(".")[2]

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        self._namespace[self._alias] = module  # later lookups find the module itself
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"
