"""The toy tier against lmc's contract: the classes it should pass, imported from lmc.testing
(nothing from lmc's own tests), and one fixture saying how to build, damage, reopen and kill
it. A tier that keeps no secret, no tenants and no layer-wise reads composes no class for them."""

from __future__ import annotations

import itertools
import os
import shutil

import pytest
from lmc_toy_tier.backend import FileTier

from lmc.storage.tier import Key
from lmc.testing import (
    BasicContract,
    BatchContract,
    ConcurrencyContract,
    FailureContract,
    IntegrityContract,
    ModelContract,
    ReferenceContract,
    SharedStoreContract,
    TierSpec,
)


def _flip_a_payload_bit(tier: FileTier, key: Key) -> None:
    path = os.path.join(tier.path, key.hex())
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.fixture
def tier_spec(tmp_path):
    dirs = (tmp_path / f"store{i}" for i in itertools.count())
    return TierSpec("toyfiles", config=lambda: {"remote_url": f"toyfiles://{next(dirs)}"},
                    corrupt=_flip_a_payload_bit,
                    reopen=lambda tier: {"remote_url": f"toyfiles://{tier.path}"},
                    kill=lambda tier: shutil.rmtree(tier.path),   # the device is gone
                    revive=lambda tier: os.makedirs(tier.path))   # and back, empty


class TestToyFileTier(BasicContract, BatchContract, ModelContract, ReferenceContract,
                      ConcurrencyContract, SharedStoreContract, IntegrityContract, FailureContract):
    """Every class whose promises a directory of files can keep."""
