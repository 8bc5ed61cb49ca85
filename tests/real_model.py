"""The real model the tests share: SmolLM2-135M-Instruct converted once (``lmc model get``,
into the user's cache, where a second run is a no-op) and its source GGUF. Missing packages
skip the test naming what installs them, except under ``CI=true`` (``.ci/run`` installs them)."""

from __future__ import annotations

from pathlib import Path

from lmc.models import DEFAULT_MODEL, SourceMissing, get_model, known_model
from lmc.models.source import locate, verify
from tests.requirements import missing


def real_model_dir(dtype: str = "fp32") -> Path:
    """The converted checkpoint's folder (converting it on first use, ~35 s on 2 cores)."""
    try:
        return get_model(DEFAULT_MODEL, dtype).path
    except (SourceMissing, ImportError) as e:
        missing(str(e))


def real_model_gguf() -> Path:
    """The verified source file the checkpoint is converted from."""
    model = known_model(DEFAULT_MODEL)
    try:
        path = locate(model)
    except SourceMissing as e:
        missing(str(e))
    verify(path, model.source)
    return path
