"""The tier contract (``contract.py``) against the L1 memory tier."""

import pytest

from .contract import TierContract, TierSpec


@pytest.fixture
def tier_spec():
    return TierSpec("cpu")


class TestCPUContract(TierContract):
    """Every contract test; the fault tests skip (nothing outside process memory)."""
