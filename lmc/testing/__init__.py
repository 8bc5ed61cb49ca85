"""The storage-tier contract as pytest classes a tier's tests compose, one class per concern.

Any tier, built in or third-party, proves it keeps ``StorageBackend``'s contract
(``lmc/storage/tier.py``) by importing these classes: nothing here reads lmc's own
``tests/``. A tier's test module provides one fixture, ``tier_spec`` (a :class:`TierSpec`
saying how to build the tier and, optionally, how to damage, kill, hang, reopen or share its
backend), and one class composing what the tier should pass::

    from lmc.testing import BasicContract, BatchContract, IntegrityContract, TierSpec

    @pytest.fixture
    def tier_spec(tmp_path):
        return TierSpec("mytier", config={...}, corrupt=flip_one_stored_bit)

    class TestMyTier(BasicContract, BatchContract, IntegrityContract): ...

The classes (each in its own module): :class:`BasicContract` (bit-exact round trips of
every dtype, I/O inside each object, odd chunks skipped), :class:`BatchContract` (each key in
its place), :class:`ModelContract` (random call sequences, drawn and shrunk by hypothesis,
against a model of what may be present), :class:`ReferenceContract` (references and leaks), :class:`ConcurrencyContract`
(threads, ``close()`` racing calls), :class:`SharedStoreContract` (a second tier over the same
store), :class:`IsolationContract` (other tenants), :class:`IntegrityContract` (damaged values,
a writer without the secret), :class:`FailureContract` (dead and hung backends),
:class:`LayeredReadContract` (``get_layers``) and :class:`ClearContract`
(``clear_namespace``: all, a key prefix, never another tenant's). :class:`TierContract` is all of them. A test
whose hook the spec lacks skips, saying so; ``TierSpec.skip`` leaves out named tests.

Every test also checks, after it, that each tier it built gave all its pool memory back at
``close()`` and that no pool invariant broke (:mod:`lmc.memory.invariants`). Needs pytest and
hypothesis (lmc's ``testing`` extra); pytest rewrites the assertions here for readable
failures.
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401  (ModelContract)
    import pytest
except ImportError as e:  # a plain install: the suite is an extra
    raise ImportError(f"lmc.testing needs pytest and hypothesis ({e}); "
                      "pip install 'lmc-kvcache[testing]'") from e

_MODULES = ("harness", "basics", "batches", "references", "concurrency", "model", "sharing",
            "isolation", "integrity", "layered", "failures", "clearing")
pytest.register_assert_rewrite(*(f"lmc.testing.{m}" for m in _MODULES))

from lmc.testing.basics import BasicContract  # noqa: E402
from lmc.testing.batches import BatchContract  # noqa: E402
from lmc.testing.clearing import ClearContract  # noqa: E402
from lmc.testing.concurrency import ConcurrencyContract  # noqa: E402
from lmc.testing.failures import FailureContract  # noqa: E402
from lmc.testing.harness import (  # noqa: E402
    CHUNK_BYTES,
    POOL_BYTES,
    ROUND_TRIPS,
    SHAPE,
    TierHarness,
    TierSpec,
    check_hit,
    expected_bytes,
    fill,
    get_checked,
    key_of,
    release,
)
from lmc.testing.integrity import IntegrityContract  # noqa: E402
from lmc.testing.isolation import IsolationContract  # noqa: E402
from lmc.testing.layered_reads import LayeredReadContract  # noqa: E402
from lmc.testing.model import ModelContract  # noqa: E402
from lmc.testing.references import ReferenceContract  # noqa: E402
from lmc.testing.sharing import SharedStoreContract  # noqa: E402


class TierContract(BasicContract, BatchContract, ModelContract, ReferenceContract,
                   ConcurrencyContract, SharedStoreContract, IsolationContract, IntegrityContract,
                   LayeredReadContract, FailureContract, ClearContract):
    """Every contract class: the tests whose hooks a spec lacks skip, saying so."""


__all__ = [
    "get_checked",
    "CHUNK_BYTES", "POOL_BYTES", "ROUND_TRIPS", "SHAPE",
    "BasicContract", "BatchContract", "ClearContract", "ConcurrencyContract",
    "FailureContract",
    "IntegrityContract", "IsolationContract", "LayeredReadContract", "ModelContract",
    "ReferenceContract",
    "SharedStoreContract", "TierContract", "TierHarness", "TierSpec",
    "check_hit", "expected_bytes", "fill", "key_of", "release",
]
