"""A real disk tier made slow on purpose: a lower tier that must never slow L1 or stores."""

from __future__ import annotations

import time

from lmc.storage.backends.disk.backend import DiskBackend


class SlowDisk(DiskBackend):
    """The disk tier with ``delay`` seconds added to every value it reads or writes."""

    def __init__(self, *args, delay: float, **kw) -> None:
        super().__init__(*args, **kw)
        self.delay = delay

    def _write(self, key, obj):
        time.sleep(self.delay)
        return super()._write(key, obj)

    def _read(self, key, entry):
        time.sleep(self.delay)
        return super()._read(key, entry)
