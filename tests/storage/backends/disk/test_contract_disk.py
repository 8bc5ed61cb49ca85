"""The tier contract (:mod:`lmc.testing`) against the disk tier, on real files: every class but
the tenants' (one directory, one tenant)."""

import itertools
import os
import shutil

import pytest

from lmc.testing import (
    BasicContract,
    BatchContract,
    ClearContract,
    ConcurrencyContract,
    FailureContract,
    IntegrityContract,
    LayeredReadContract,
    ModelContract,
    ReferenceContract,
    SharedStoreContract,
    TierSpec,
)


def _flip_payload_byte(tier, key) -> None:
    """A bad block: one payload bit of the key's file flipped, name and size unchanged."""
    name = next(n for n in os.listdir(tier.path) if n.startswith(key.hex()))
    fd = os.open(os.path.join(tier.path, name), os.O_RDWR)
    try:
        b = os.pread(fd, 1, 4096 + 100)
        os.pwrite(fd, bytes([b[0] ^ 0x10]), 4096 + 100)
    finally:
        os.close(fd)


@pytest.fixture
def tier_spec(tmp_path):
    dirs = (tmp_path / f"disk{i}" for i in itertools.count())
    return TierSpec("disk", config=lambda: {"local_disk": str(next(dirs)),
                                            "local_disk_size": "512KiB"},
                    corrupt=_flip_payload_byte,
                    kill=lambda tier: shutil.rmtree(tier.path),  # the device is gone
                    reopen=lambda tier: {"local_disk": tier.path})  # a restart


class TestDiskContract(BasicContract, BatchContract, ModelContract, ReferenceContract,
                       ConcurrencyContract, SharedStoreContract, IntegrityContract,
                       LayeredReadContract, FailureContract, ClearContract):
    """Every class but the tenants'; 512 KiB of disk, so floods evict and recycle files."""
