"""The engine suite (tests/core/test_cache_engine.py) again, every copy late and poisoning
(tests/late_transfer.py): a store or retrieve that released, committed or returned before its
copy completed fails here."""

from __future__ import annotations

import pytest

from tests.core.test_cache_engine import *  # noqa: F403 - its tests, collected again here
from tests.late_transfer import late_copies, new_seed


@pytest.fixture(autouse=True)
def _late_copies():
    with late_copies(new_seed()) as watch:
        yield watch
    watch.check()
