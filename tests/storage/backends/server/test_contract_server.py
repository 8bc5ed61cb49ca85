"""The tier contract (:mod:`lmc.testing`, every class) against the ``lmc://`` tier on a real ``lmc server``
process, with and without ``integrity_secret``. The daemon refuses values failing their
checksums at PUT, so only a keyed tier can detect a rewrite: the keyed run's damage is a
self-consistent value put by a writer without the secret."""

import os
import signal
import uuid

import pytest
import torch

from lmc.config import CacheConfig
from lmc.storage.tier import create_backend
from lmc.testing import SHAPE, TierContract, TierSpec, fill, key_of
from tests.server.daemon_proc import DaemonProc

pytestmark = pytest.mark.integration
SECRET = "contract-suite-secret-0123456789"


@pytest.fixture(scope="module")
def contract_server(tmp_path_factory):
    """A daemon of this module's own: the fault tests kill and stop it."""
    d = DaemonProc(tmp_path_factory.mktemp("contract-daemon"), ["--size", "64MiB"])
    d.start()
    yield d
    d.kill()


def _forge(tier, key) -> None:
    """A writer without the secret replaces the chunk with other, self-consistent bytes."""
    writer = create_backend(f"{tier.url}?ns={tier.namespace}", CacheConfig(), tier.pool)
    forged = fill(tier.pool.allocate(SHAPE, torch.float16, SHAPE[2]), key_of("forged"))
    try:
        assert writer.delete([key]) == 1 and writer.put([key], [forged]) == 1
    finally:
        forged.release()
        writer.close()


def _signal(d: DaemonProc, sig: int) -> None:
    os.kill(d.pid, sig)


@pytest.fixture(params=["plain", "keyed"])
def tier_spec(request, contract_server):
    keyed = request.param == "keyed"
    return TierSpec(
        contract_server.url,
        config=lambda: {"remote_key_prefix": f"c{uuid.uuid4().hex[:10]}", "remote_timeout": 1.0,
                        **({"integrity_secret": SECRET} if keyed else {})},
        corrupt=_forge if keyed else None,
        kill=lambda tier: contract_server.kill(), revive=lambda tier: contract_server.start(),
        hang=lambda tier: _signal(contract_server, signal.SIGSTOP),
        unhang=lambda tier: _signal(contract_server, signal.SIGCONT),
        reopen=lambda tier: {"remote_key_prefix": tier.namespace},  # the namespace
        # another namespace on the same daemon (tokens' tenants: test_contract_p2p.py and
        # tests/server's attack tests)
        other_tenants=lambda tier: [{"remote_key_prefix": f"o{uuid.uuid4().hex[:10]}"}],
        # a killed daemon answers the tags' reads as it does the chunks': the plain run's
        # kill covers it, and each kill costs a daemon restart (seconds of imports)
        skip={"test_dead_backend_answers_misses_within_a_deadline":
              "killed in the plain run (one daemon restart per run)"} if keyed else {})


class TestDaemonContract(TierContract):
    """Every contract test, plain and keyed."""
