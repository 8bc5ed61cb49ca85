"""The tier contract (:mod:`lmc.testing`) against the L1 memory tier: every class whose promises
an in-process tier can keep (nothing outside process memory to damage, share, kill or hang; no
``get_layers``)."""

import pytest

from lmc.testing import (
    BasicContract,
    BatchContract,
    ClearContract,
    ConcurrencyContract,
    ModelContract,
    ReferenceContract,
    TierSpec,
)


@pytest.fixture
def tier_spec():
    return TierSpec("cpu")


class TestCPUContract(BasicContract, BatchContract, ModelContract, ReferenceContract,
                      ConcurrencyContract, ClearContract):
    """Round trips, batches, call sequences, references under eviction, threads, clears."""
