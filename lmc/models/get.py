"""``get_model``: a known model's checkpoint folder, converted on first use, offline.

A second call finds the folder complete and returns at once (nothing is read but the
manifest and the files' sizes). A conversion verifies the source file's size and SHA-256
against the registry before reading anything else from it, and publishes its folder with one
rename (:mod:`lmc.models.store`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lmc.models import store
from lmc.models.registry import KnownModel, check_dtype, known_model
from lmc.models.source import locate, verify

Progress = Callable[[str], None]
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Checkpoint:
    """Where a model's checkpoint is, and whether this call made it."""

    path: Path
    model: KnownModel
    dtype: str
    converted: bool        # False: it was already there
    seconds: float


def get_model(name: str = DEFAULT_MODEL, dtype: str | None = None, *,
              gguf: str | Path | None = None, root: str | Path | None = None,
              force: bool = False, progress: Progress | None = None) -> Checkpoint:
    """The checkpoint of ``name`` in ``dtype`` ("fp32" or "bf16"; the model's default when
    None) under ``root`` (``store.models_root()`` when None), converting it if it is not there
    complete (or ``force``). ``gguf``: convert this file instead of the installed package's
    copy (it must still have the registry's digest). Raises ``SourceMissing`` (an
    ``ImportError`` naming what to install) or ``SourceError``/``ValueError`` with a
    one-line reason."""
    say = progress or (lambda _line: None)
    t0 = time.perf_counter()
    model = known_model(name)
    dtype = check_dtype(dtype or model.default_dtype)
    target = store.checkpoint_path(model, dtype, root)
    for stale in store.reclaim_temporaries(target):
        say(f"removed {stale.name}, left by a conversion that did not finish")
    # a file named by the caller is checked even when nothing is to be converted from it
    source = Path(gguf) if gguf is not None else None
    digest = verify(source, model.source, say) if source is not None else None
    problem = store.check_folder(target, model, dtype)[1] if target.exists() else "absent"
    if problem is None and not force:
        return Checkpoint(target, model, dtype, False, time.perf_counter() - t0)
    if problem not in ("absent", None):
        say(f"{target} is not usable ({problem}): converting again")
    if source is None or digest is None:
        source = locate(model)
        digest = verify(source, model.source, say)
    say(f"converting {model.name} to {dtype} from {source}")
    from lmc.models.convert import convert_gguf

    with store.staging(target) as tmp:
        convert_gguf(source, digest, model, dtype, tmp, say)
        published = store.publish(tmp, target, model, dtype, replace=force)
    seconds = time.perf_counter() - t0
    say(f"{'converted' if published else 'another conversion finished first'}: {target} "
        f"in {seconds:.1f} s")
    return Checkpoint(target, model, dtype, published, seconds)


def checkpoint_dir(name: str = DEFAULT_MODEL, dtype: str | None = None,
                   progress: Progress | None = None) -> Path:
    """The folder to pass to ``lmc.reference.LLM`` (or vLLM): :func:`get_model`'s path."""
    return get_model(name, dtype, progress=progress).path
