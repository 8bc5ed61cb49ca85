"""The optional lossless stage: a fast general-purpose compressor over what the lossy stage
left (or over the exact chunk, with no lossy stage).

``zstd`` (the ``zstandard`` package, level 1-19, default 1) or ``lz4`` (the ``lz4`` package,
its block format): both release the GIL while they work. Installed by lmc's ``compress``
extra; naming one without its package is a one-line error naming the extra. A value the
stage does not shrink is stored as it was (its header says which), so incompressible KV
costs one try, never bytes.

zstd frames carry their own checksum of the decompressed bytes (a damaged body fails to
decompress even where a tier's framing checksum was rewritten with it); lz4 blocks have none,
and rely on the framing's, as every value does. Reading is bounded: the decompressed size must be exactly what the header's geometry says,
and the compressor is never asked for more (``max_output_size``), so a forged value cannot
make a reader allocate past the chunk it expects. A value that does not decompress is a
corrupt value: a miss.
"""

from __future__ import annotations

import threading
from typing import Any

from lmc.storage.integrity import MissingPackage
from lmc.storage.serde import CorruptValue

NAMES = ("zstd", "lz4")
CODES = {"zstd": 1, "lz4": 2}


def _need(module: str, what: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise MissingPackage(f"codec lossless stage {what!r} needs the {module.split('.')[0]!r} "
                             "package: pip install 'lmc-kvcache[compress]'") from None


class Lossless:
    """One compressor, by name; thread-safe (a compressor object per thread for zstd)."""

    def __init__(self, name: str, level: int = 1) -> None:
        if name not in NAMES:
            raise ValueError(f"unknown lossless stage {name!r}; choose one of {', '.join(NAMES)}")
        if not isinstance(level, int) or not 1 <= level <= 19:
            raise ValueError(f"lossless level must be an int in 1..19, got {level!r}")
        self.name = name
        self.level = level if name == "zstd" else 1
        self.code = CODES[name]
        self._mod = _need("zstandard" if name == "zstd" else "lz4.block", name)
        self._local = threading.local()

    @property
    def ident(self) -> str:
        return f"{self.name}{self.level}" if self.name == "zstd" else self.name

    def compress(self, data: Any) -> bytes:
        if self.name == "lz4":
            return bytes(self._mod.compress(data, store_size=False))
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = self._mod.ZstdCompressor(level=self.level, write_checksum=True)
        return bytes(c.compress(data))

    def decompress(self, data: Any, size: int) -> bytes:
        """Exactly ``size`` bytes from ``data``, or :class:`CorruptValue`."""
        try:
            if self.name == "lz4":
                out = self._mod.decompress(data, uncompressed_size=size)
            else:
                declared = self._mod.frame_content_size(data)
                if declared not in (-1, size):  # a declared size is allocated whole: check it
                    raise CorruptValue(f"zstd stage: the frame declares {declared} bytes, the "
                                       f"header says {size}")
                d = getattr(self._local, "d", None)
                if d is None:
                    d = self._local.d = self._mod.ZstdDecompressor()
                out = d.decompress(data, max_output_size=size)
        except CorruptValue:
            raise
        except Exception as e:  # each library's own error type: a bad value either way
            raise CorruptValue(f"{self.name} stage: the value does not decompress ({e})") from None
        if len(out) != size:
            raise CorruptValue(f"{self.name} stage: {len(out)} bytes decompressed, the header "
                               f"says {size}")
        return out
