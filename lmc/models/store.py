"""Where converted checkpoints live and how one appears there: whole or not at all.

A checkpoint is the folder ``<cache>/models/<name>-<dtype>`` (``<cache>`` is
``$XDG_CACHE_HOME/lmc``, else ``~/.cache/lmc``), holding the HF files and ``lmc-model.json``,
a manifest naming the source file's digest, the converter's version and each file's size and
SHA-256. A conversion writes into a hidden temporary sibling (its name carries the writer's
pid) and renames it into place, so a reader sees either no folder or a complete one; a
writer killed midway leaves only its temporary folder, which the next conversion removes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmc.models.registry import CONVERTER_VERSION, KnownModel
from lmc.user_cache import cache_dir

MANIFEST = "lmc-model.json"
MAX_MANIFEST = 1 << 20


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/lmc``, else ``~/.cache/lmc`` (the reference engine's too)."""
    return cache_dir()


def models_root(root: str | Path | None = None) -> Path:
    return Path(root) if root is not None else cache_root() / "models"


def checkpoint_path(model: KnownModel, dtype: str, root: str | Path | None = None) -> Path:
    return models_root(root) / f"{model.name}-{dtype}"


@dataclass(frozen=True)
class Installed:
    """A folder under the models root and what its manifest says."""

    path: Path
    name: str
    dtype: str
    size: int                 # bytes of the files the manifest lists
    problem: str | None       # None when complete and made by this converter


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, or None if absent, oversized or not a JSON object."""
    path = folder / MANIFEST
    try:
        if path.stat().st_size > MAX_MANIFEST:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_folder(folder: Path, model: KnownModel | None = None, dtype: str | None = None
                 ) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, problem)``: the problem is None when every listed file is there at its
    size and the manifest matches ``model``/``dtype`` and this converter (sizes, not digests:
    a get that finds a checkpoint must be instant; the rename made the folder whole)."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None, "no readable lmc-model.json"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return manifest, "lmc-model.json lists no files"
    if manifest.get("converter_version") != CONVERTER_VERSION:
        return manifest, (f"made by converter v{manifest.get('converter_version')}, "
                          f"this lmc writes v{CONVERTER_VERSION}")
    if model is not None and (manifest.get("name") != model.name
                              or manifest.get("source", {}).get("sha256") != model.source.sha256):
        return manifest, "made from another source file"
    if dtype is not None and manifest.get("dtype") != dtype:
        return manifest, f"dtype {manifest.get('dtype')}, not {dtype}"
    for name, info in files.items():
        try:
            size = (folder / name).stat().st_size
        except OSError:
            return manifest, f"{name} is missing"
        if not isinstance(info, dict) or size != info.get("size"):
            return manifest, f"{name} has {size:,} bytes, the manifest says {info.get('size')}"
    return manifest, None


def installed(root: str | Path | None = None) -> list[Installed]:
    """Every checkpoint folder under the models root, complete or not, by name."""
    base = models_root(root)
    out = []
    for folder in sorted(base.iterdir()) if base.is_dir() else []:
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        manifest, problem = check_folder(folder)
        files = (manifest or {}).get("files") or {}
        size = sum(i.get("size", 0) for i in files.values() if isinstance(i, dict))
        out.append(Installed(folder, str((manifest or {}).get("name", folder.name)),
                             str((manifest or {}).get("dtype", "?")), size, problem))
    return out


def file_record(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fix_modes(folder: Path) -> None:
    """Give the folder's files the modes a plain ``open`` would (some writers make 0600)."""
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~_umask())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim_temporaries(target: Path) -> list[Path]:
    """Remove ``target``'s temporary folders whose writer is no longer running."""
    removed = []
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


@contextlib.contextmanager
def staging(target: Path) -> Iterator[Path]:
    """A temporary folder beside ``target`` to write into; removed unless published."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # as a plain mkdir would (mkdtemp makes it 0700)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish(tmp: Path, target: Path, model: KnownModel, dtype: str,
            replace: bool = False) -> bool:
    """Rename the finished ``tmp`` to ``target``. A folder already at ``target`` that is not
    a complete checkpoint of ``model`` in ``dtype`` (an older converter's, a damaged one), or
    any with ``replace``, is moved aside first and removed after. Returns False when a
    complete one is already there and not replaced (a concurrent conversion won; ``tmp`` is
    left to :func:`staging` to remove)."""
    if not replace and check_folder(target, model, dtype)[1] is None:
        return False
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-old-",
                                    dir=target.parent))
        os.rename(target, old / "replaced")
        try:
            os.rename(tmp, target)
        finally:
            shutil.rmtree(old, ignore_errors=True)
        return True
    try:
        os.rename(tmp, target)
    except OSError:
        if check_folder(target, model, dtype)[1] is None:
            return False  # lost a race to a complete checkpoint
        raise
    return True
