"""A model identity for the key namespace, derived from a local checkpoint directory.

Two engines share KV only if they run the same weights, so the identity must change when
the weights do, and must not change with where the checkpoint lies on disk (a copy on
another machine, a vLLM and a reference engine loading the same files). It is the
directory's name plus a fingerprint of ``config.json`` and of every ``*.safetensors`` file's
size and three 1 MiB samples (start, middle, end): cheap for a 100 GB checkpoint, yet two
random-weight checkpoints of the same shape get different identities. Every adapter uses
this function, so KV saved through one engine loads through another.
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

_SAMPLE = 1 << 20


def _file_fingerprint(path: Path, h: xxhash.xxh3_128) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
            f.seek(offset)
            h.update(f.read(_SAMPLE))


def model_identity(model_dir: str | os.PathLike) -> str:
    """``"<dir name>@<16 hex digits>"`` for a local checkpoint directory."""
    root = Path(model_dir)
    config = root / "config.json"
    if not config.is_file():
        raise ValueError(f"{root} is not a checkpoint directory: no config.json")
    h = xxhash.xxh3_128()
    h.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        _file_fingerprint(path, h)
    return f"{root.resolve().name}@{h.hexdigest()[:16]}"
