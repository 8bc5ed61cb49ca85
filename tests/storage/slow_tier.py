"""A real disk tier made slow on purpose: a lower tier that must never slow L1 or stores."""

from __future__ import annotations

import threading

from lmc.storage.backends.disk.backend import DiskBackend


class SlowDisk(DiskBackend):
    """The disk tier with ``delay`` seconds added to every value it reads or writes, until
    :meth:`release` (then none). A test that tells "waited for the slow tier" from "did not"
    gives a delay only a hang would match (``tests.deadlines.HANG_S``), never one a loaded
    machine's own slowness could be mistaken for, and releases it once it has checked."""

    def __init__(self, *args, delay: float, **kw) -> None:
        super().__init__(*args, **kw)
        self.delay = delay
        self.released = threading.Event()
        self.entered = threading.Event()  # a write has started (and waits for release)

    def release(self) -> None:
        """No delay from now on (values held in one finish at once)."""
        self.released.set()

    def _write(self, key, obj):
        self.entered.set()
        self.released.wait(self.delay)
        return super()._write(key, obj)

    def _read(self, key, entry):
        self.released.wait(self.delay)
        return super()._read(key, entry)
